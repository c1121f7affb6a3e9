"""Adaptation rates as differentiable inputs (issue 18, first part): an adapter built
from traced rates, and the K-step test-time objective differentiated through the
``lax.scan`` of ``core.test_time.client_runner``.

Tent with one learning rate per BatchNorm layer (scale and bias of a layer share it),
parameterised in log space so every rate stays positive: rate_l = exp(log_rate_l). Its
step is Adam's direction times −rate_l, so with every log-rate at log(η) it is Tent with
Adam(η) (tests/test_learned_rates.py).

The objective of a client's K consecutive test batches (online: the adapted state carries
over) is the mean cross-entropy of the adapter's predictions; ``jax.grad`` of it w.r.t.
the rates runs backward through all K steps. ``remat=True`` wraps the adapter step in
``jax.checkpoint`` so the backward pass recomputes each step's activations instead of
storing them (same gradient).

Not yet in the registry or a pipeline: training the rates federatedly, the other
adapters' rates and ATP-online through K batches are still to build.
"""
from __future__ import annotations

from typing import Dict

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from fedjax_shift import models
from fedjax_shift.adapters.tent import tent
from fedjax_shift.core.test_time import Adapter, client_runner

LogRates = Dict[str, jax.Array]   # BatchNorm layer path 'encoder/BatchNorm_0' -> [] log-rate


def layer_of(path) -> str:
  """The BatchNorm layer a flat parameter path belongs to ('encoder/BatchNorm_0')."""
  return '/'.join(str(part) for part in path[:-1])


def init_log_rates(variables, learning_rate: float) -> LogRates:
  """log(``learning_rate``) for every BatchNorm layer of ``variables``."""
  flat = traverse_util.flatten_dict(variables['params'])
  layers = sorted({layer_of(p) for p in flat if models.is_batch_norm_path(p)})
  if not layers:
    raise ValueError('learned Tent rates need a model with BatchNorm; this model has none')
  return {layer: jnp.log(jnp.asarray(learning_rate, jnp.float32)) for layer in layers}


def per_layer_adam(log_rates: LogRates) -> optax.GradientTransformation:
  """Adam's direction scaled by −exp(log_rate) of each parameter's layer; updates are
  the flat {path: leaf} dicts of ``common.gradient_adapter``."""
  def scale(updates, params=None):
    del params
    return {path: -jnp.exp(log_rates[layer_of(path)]).astype(u.dtype) * u
            for path, u in updates.items()}
  return optax.chain(optax.scale_by_adam(), optax.stateless(scale))


def rated_tent(module, log_rates: LogRates, predict: str = 'before') -> Adapter:
  """Tent whose BatchNorm layers adapt at the rates exp(``log_rates``)."""
  return tent(module, predict=predict, optimizer=per_layer_adam(log_rates))


def k_step_loss(adapter: Adapter, batch_size: int, variables, x: jax.Array, y: jax.Array,
                num_examples: jax.Array, rng: jax.Array, remat: bool = False) -> jax.Array:
  """Mean cross-entropy of ``adapter``'s predictions over one client's test stream x
  [N, ...] (K = ceil(N / B) online batches), differentiable in whatever the adapter was
  built from. ``remat``: recompute each step in the backward pass."""
  if remat:
    adapter = Adapter(adapter.init, jax.checkpoint(adapter.step))
  sums = client_runner(adapter, batch_size, 'online')(variables, x, y, num_examples, rng)
  return sums['loss'] / jnp.maximum(sums['count'], 1.0)
