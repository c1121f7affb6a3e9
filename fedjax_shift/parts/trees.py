"""Pytree arithmetic of client updates and their weighted aggregation."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def tree_sub(a, b):
  return jax.tree.map(jnp.subtract, a, b)


def weighted_sum(stacked, weights):
  """Σ_c weights[c] · stacked[c] over the leading cohort axis."""
  return jax.tree.map(lambda leaf: jnp.tensordot(weights, leaf, axes=1), stacked)


def clipped_and_decayed(optimizer, clip_norm: float, weight_decay: float):
  """``optimizer`` after a global-norm clip of the gradient at ``clip_norm`` (0: none),
  then ``weight_decay``·θ added (0: none): PyTorch's ``clip_grad_norm_`` followed by
  ``SGD(weight_decay=…)``, the order of the authors' code that Tent (UPFL) and FedTTA's
  meta-optimizer follow."""
  return optax.chain(*([optax.clip_by_global_norm(clip_norm)] if clip_norm else []),
                     *([optax.add_decayed_weights(weight_decay)] if weight_decay else []),
                     optimizer)
