"""Pytree arithmetic of client updates and their weighted aggregation."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def tree_sub(a, b):
  return jax.tree.map(jnp.subtract, a, b)


def weighted_sum(stacked, weights):
  """Σ_c weights[c] · stacked[c] over the leading cohort axis."""
  return jax.tree.map(lambda leaf: jnp.tensordot(weights, leaf, axes=1), stacked)
