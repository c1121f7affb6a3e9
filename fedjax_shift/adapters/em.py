"""EM label-prior re-estimation: Adjusting the Outputs of a Classifier to New a Priori
Probabilities. Saerens et al., Neural Computation 2002, Eq. 2.9–2.10.

With source posteriors p_s(y|x) and source prior π_s (uniform in the ATP authors'
code), iterate on a test batch

  p(y|x) ∝ p_s(y|x) · π(y) / π_s(y),   π(y) ← mean_x p(y|x)

from π = π_s for ``num_iterations`` steps, and predict with log p(y|x). Episodic
mode re-estimates on each batch; online mode starts each batch from the previous
batch's estimate.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_shift import models
from fedjax_shift.core.test_time import Adapter, class_count, register_constructor
from fedjax_shift.registry import POSITIVE_INT


def reweight(log_probs: jax.Array, ratio: jax.Array) -> jax.Array:
  """log of p(y|x)·ratio(y), renormalised. log_probs [B, C], ratio [C] -> [B, C]."""
  return jax.nn.log_softmax(log_probs + jnp.log(jnp.maximum(ratio, 1e-12)), axis=-1)


def em_prior(log_probs: jax.Array, weight: jax.Array, source_prior: jax.Array,
             start: jax.Array, num_iterations: int) -> jax.Array:
  """Saerens EM: the target prior [C] of a batch (weights [B] mask repeats)."""

  def body(_, prior):
    posterior = jnp.exp(reweight(log_probs, prior / source_prior))
    total = jnp.maximum(jnp.sum(weight), 1e-12)
    return jnp.sum(posterior * weight[:, None], axis=0) / total

  prior = jax.lax.fori_loop(0, num_iterations, body, start)
  return jnp.where(jnp.sum(weight) > 0, prior, start)


@register_constructor('em', from_context={'num_classes': class_count},
                      ranges={'num_iterations': POSITIVE_INT})
def em(module, num_classes: int, num_iterations: int = 100, *, source_prior=None) -> Adapter:
  """``num_iterations``: EM steps per batch (100, Saerens et al.); ``source_prior`` π_s
  [C] (None: uniform, as the ATP authors' code)."""
  source_prior = (jnp.full((num_classes,), 1.0 / num_classes) if source_prior is None
                  else jnp.asarray(source_prior, jnp.float32))

  def init(variables, rng):
    del rng
    return variables, source_prior

  def step(state, batch):
    variables, prior = state
    log_probs = jax.nn.log_softmax(models.apply(module, variables, batch.x)[0])
    prior = em_prior(log_probs, batch.weight, source_prior, prior, num_iterations)
    return (variables, prior), reweight(log_probs, prior / source_prior)

  return Adapter(init, step)

