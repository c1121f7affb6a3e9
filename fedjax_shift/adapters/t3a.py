"""T3A: Test-Time Classifier Adjustment Module for Model-Agnostic Domain
Generalization. Iwasawa & Matsuo, NeurIPS 2021, Eq. 3–6.

The linear head is replaced by per-class prototypes of a support set. The support
set starts from the head's weight vectors (each labelled by the head's own
prediction); every test feature z is added with its pseudo-label argmax head(z)
and entropy; per class only the ``filter_k`` lowest-entropy supports are kept
(Eq. 6). Prediction: z · normalise(Σ_{s ∈ S_c} s / ‖s‖) for every class c, on the
batch after it joined the supports. Fixed-size buffers [C, K, F] keep shapes static.
With hidden layers in the head, z is the input of its final linear layer (T3A's
"output of the featurizer" is what the linear classifier reads).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_shift import models
from fedjax_shift.parts.losses import entropy
from fedjax_shift.core.test_time import Adapter, register_constructor
from fedjax_shift.registry import POSITIVE_INT


class Supports(NamedTuple):
  features: jax.Array   # [C, K, F], L2-normalised
  entropy: jax.Array    # [C, K], +inf where empty


def _normalize(v, axis=-1):
  return v / jnp.maximum(jnp.linalg.norm(v, axis=axis, keepdims=True), 1e-12)


def merge(supports: Supports, features: jax.Array, labels: jax.Array, ents: jax.Array
          ) -> Supports:
  """Adds candidates (features [M, F], labels [M], entropies [M], +inf = skip) and
  keeps the K lowest-entropy supports per class."""
  num_classes, k, dim = supports.features.shape
  pool_features = jnp.concatenate([supports.features.reshape(-1, dim), _normalize(features)])
  pool_labels = jnp.concatenate([jnp.repeat(jnp.arange(num_classes), k), labels])
  pool_ents = jnp.concatenate([supports.entropy.reshape(-1), ents])

  def keep(c):
    score = jnp.where(pool_labels == c, -pool_ents, -jnp.inf)
    top, idx = jax.lax.top_k(score, k)
    return pool_features[idx], -top

  new_features, new_ents = jax.vmap(keep)(jnp.arange(num_classes))
  return Supports(new_features, new_ents)


def prototype_logits(supports: Supports, features: jax.Array) -> jax.Array:
  """features [B, F] -> [B, C] = z · normalise(Σ valid supports of c)."""
  valid = jnp.isfinite(supports.entropy)[..., None]
  prototypes = _normalize(jnp.sum(supports.features * valid, axis=1))
  return features @ prototypes.T


@register_constructor('t3a', ranges={'filter_k': POSITIVE_INT})
def t3a(module, filter_k: int = 100) -> Adapter:
  """T3A with ``filter_k`` supports kept per class (T3A / DomainBed's default K)."""
  if filter_k < 1:
    raise ValueError(f't3a filter_k must be >= 1, got {filter_k}')

  def head_outputs(variables, features):
    logits = models.linear_head(variables, features)
    return jnp.argmax(logits, -1), entropy(logits)

  def init(variables, rng):
    del rng
    kernel = variables['params']['head']['kernel']          # [F, C]
    num_classes, dim = kernel.shape[1], kernel.shape[0]
    empty = Supports(jnp.zeros((num_classes, filter_k, dim)),
                     jnp.full((num_classes, filter_k), jnp.inf))
    warmup = kernel.T
    labels, ents = head_outputs(variables, warmup)
    return variables, merge(empty, warmup, labels, ents)

  def step(state, batch):
    variables, supports = state
    features = models.head_hidden(variables, models.features(module, variables, batch.x))
    labels, ents = head_outputs(variables, features)
    supports = merge(supports, features, labels, jnp.where(batch.weight > 0, ents, jnp.inf))
    return (variables, supports), prototype_logits(supports, features)

  return Adapter(init, step)
