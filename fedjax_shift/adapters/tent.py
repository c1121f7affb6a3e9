"""Tent: Fully Test-Time Adaptation by Entropy Minimization. Wang et al., ICLR 2021,
Sec. 3: minimise the mean prediction entropy H(ŷ) = −Σ_c ŷ_c log ŷ_c of each test
batch w.r.t. the BatchNorm affine parameters only (scale γ, shift β), with BatchNorm
normalising by the test batch's statistics; one optimizer step per batch (Adam 1e-3
for CIFAR). ``predict='before'`` returns the logits computed before the batch's
update (the ATP authors' baseline code), 'after' re-runs the model after it.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from fedjax_shift import models
from fedjax_shift.core.test_time import Adapter

PREDICT = ('before', 'after')


class TentState(NamedTuple):
  variables: dict     # model variables; only BatchNorm scale/bias change
  opt_state: optax.OptState


def split_affine(params):
  flat = traverse_util.flatten_dict(params)
  affine = {p: v for p, v in flat.items() if models.is_batch_norm_path(p)}
  rest = {p: v for p, v in flat.items() if not models.is_batch_norm_path(p)}
  return affine, rest


def join(affine, rest):
  return traverse_util.unflatten_dict({**rest, **affine})


def weighted_entropy(logits, weight):
  log_probs = jax.nn.log_softmax(logits)
  entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
  return jnp.sum(entropy * weight) / jnp.maximum(jnp.sum(weight), 1e-12)


def tent(module, learning_rate: float = 1e-3, predict: str = 'before',
         optimizer: optax.GradientTransformation | None = None) -> Adapter:
  if predict not in PREDICT:
    raise ValueError(f"tent predict must be one of {PREDICT}, got {predict!r}")
  optimizer = optimizer or optax.adam(learning_rate)

  def init(variables, rng):
    del rng
    if not models.has_batch_norm(variables):
      raise ValueError('tent needs a model with BatchNorm; this model has none')
    affine, _ = split_affine(variables['params'])
    return TentState(variables, optimizer.init(affine))

  def step(state, batch):
    affine, rest = split_affine(state.variables['params'])

    def loss_fn(affine):
      variables = {**state.variables, 'params': join(affine, rest)}
      logits, _ = models.apply(module, variables, batch.x, 'batch_stats')
      return weighted_entropy(logits, batch.weight), logits

    (_, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(affine)
    updates, opt_state = optimizer.update(grads, state.opt_state, affine)
    affine = optax.apply_updates(affine, updates)
    variables = {**state.variables, 'params': join(affine, rest)}
    if predict == 'after':
      logits, _ = models.apply(module, variables, batch.x, 'batch_stats')
    return TentState(variables, opt_state), logits

  return Adapter(init, step)
