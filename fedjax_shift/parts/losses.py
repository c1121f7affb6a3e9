"""Losses that training methods and test-time methods share."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_shift.core.local import masked_mean


def entropy(logits: jax.Array) -> jax.Array:
  """Per-example prediction entropy −Σ_c ŷ_c log ŷ_c. logits [B, C] -> [B]."""
  log_probs = jax.nn.log_softmax(logits)
  return -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)


def weighted_entropy(logits: jax.Array, weight: jax.Array) -> jax.Array:
  """Mean prediction entropy over the examples with weight > 0."""
  return masked_mean(entropy(logits), weight)
