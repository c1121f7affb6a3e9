"""Class prototypes and the prototype classifier (Snell et al. 2017), shared by
FedEvolve and FedEvp. A class with no (weighted) example has no prototype: it is
marked absent, excluded from every softmax, never predicted, and examples of an
absent class carry no loss — no NaN prototype is ever formed.
"""
from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp

ABSENT_LOGIT = -1e9


def class_prototypes(features: jax.Array, labels: jax.Array, weight: jax.Array,
                     num_classes: int) -> Tuple[jax.Array, jax.Array]:
  """Per-class mean feature. features [B, F], labels [B], weight [B] ->
  (prototypes [C, F] (0 where absent), counts [C] (weighted))."""
  onehot = jax.nn.one_hot(labels, num_classes) * weight[:, None]
  counts = onehot.sum(0)
  sums = onehot.T @ features
  return sums / jnp.maximum(counts, 1e-12)[:, None], counts


DISTANCES = ('euclidean', 'squared_euclidean')


def distances(features: jax.Array, prototypes: jax.Array, kind: str = 'euclidean'
              ) -> jax.Array:
  """Distances [B, C]: 'euclidean' (the FedEvolve paper's d; smooth at 0) or
  'squared_euclidean' (Snell et al. 2017's d)."""
  sq = jnp.sum((features[:, None, :] - prototypes[None]) ** 2, -1)
  if kind == 'squared_euclidean':
    return sq
  if kind != 'euclidean':
    raise ValueError(f'unknown distance {kind!r}; choose from {list(DISTANCES)}')
  return jnp.sqrt(sq + 1e-12)


def prototype_loss(features: jax.Array, labels: jax.Array, weight: jax.Array,
                   prototypes: jax.Array, present: jax.Array, distance: str = 'euclidean'
                   ) -> jax.Array:
  """Mean over examples of −log softmax_y(−d(f(x), C)) over present classes
  (FedEvolve Eq. 4, FedEvp Eq. 6); examples whose class is absent are skipped."""
  logits = jnp.where(present[None, :], -distances(features, prototypes, distance),
                     ABSENT_LOGIT)
  log_probs = jax.nn.log_softmax(logits, -1)
  picked = jnp.take_along_axis(log_probs, labels[:, None], 1)[:, 0]
  weight = weight * present[labels]
  return -jnp.sum(picked * weight) / jnp.maximum(jnp.sum(weight), 1e-12)


def prototype_head(prototypes: jax.Array, present: jax.Array):
  """A linear head whose argmax is the nearest present prototype:
  −‖z − c‖² = 2 z·c − ‖c‖² − ‖z‖², so kernel = 2Cᵀ [F, C], bias = −‖c‖²
  (absent classes get bias ABSENT_LOGIT). Its logits are negative squared
  distances up to a per-example constant."""
  bias = jnp.where(present, -jnp.sum(prototypes ** 2, -1), ABSENT_LOGIT)
  return {'kernel': 2.0 * prototypes.T, 'bias': bias}
