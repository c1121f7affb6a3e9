"""BBSE: Detecting and Correcting for Label Shift with Black Box Predictors.
Lipton et al., ICML 2018, Sec. 4 (Eq. 4–5).

On labelled source held-out data, the joint confusion matrix
C[i, j] = P_s(ŷ = i, y = j); on target data the predicted-label distribution μ̂[i].
The importance weights solve C w = μ̂ (least squares, clipped at 0), and the
classifier predicts with p(y|x)·w_y renormalised. Episodic mode estimates μ̂ from
each batch; online mode from every target example seen so far.

``projection='simplex'`` is the ATP authors' baseline (their BBSE.py): the target label
distribution q = Π_Δ(C̃⁺ μ̂), with C̃ the confusion normalised per true class (columns
P(ŷ = i | y = j)), C̃⁺ its pseudo-inverse and Π_Δ the Euclidean projection onto the
probability simplex, smoothed to (1 − ε)·q + ε/K (ε = 0.001), and the logits shifted by
log q. With a uniform source prior the two agree wherever the clip keeps a distribution.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_shift import models
from fedjax_shift.adapters.em import reweight
from fedjax_shift.core.test_time import Adapter, SourceContext, register_constructor
from fedjax_shift.registry import one_of


def confusion_matrix(module, variables, x: jax.Array, y: jax.Array, num_classes: int,
                     batch_size: int = 256) -> jax.Array:
  """C [C, C] with C[i, j] = fraction of source examples predicted i with label j."""
  predict = jax.jit(lambda xb: jnp.argmax(models.apply(module, variables, xb)[0], -1))
  preds = jnp.concatenate([predict(x[i:i + batch_size]) for i in range(0, len(x), batch_size)])
  counts = jnp.zeros((num_classes, num_classes)).at[preds, jnp.asarray(y)].add(1.0)
  return counts / max(len(y), 1)


def importance_weights(confusion: jax.Array, predicted: jax.Array) -> jax.Array:
  """w ≥ 0 solving confusion @ w = predicted; all ones when nothing was seen."""
  w = jnp.linalg.lstsq(confusion, predicted)[0]
  w = jnp.maximum(w, 0.0)
  return jnp.where((jnp.sum(predicted) > 0) & (jnp.sum(w) > 0), w, jnp.ones_like(w))


def project_to_simplex(v: jax.Array) -> jax.Array:
  """The Euclidean projection of v [K] onto {q ≥ 0, Σq = 1} (sort-based; Held et al.
  1974): q = max(v − θ, 0) with θ from the largest ρ such that v_(ρ) > (Σ_{i≤ρ} v_(i) − 1)/ρ."""
  ordered = jnp.sort(v)[::-1]
  cumulative = jnp.cumsum(ordered)
  ranks = jnp.arange(1, v.shape[0] + 1, dtype=v.dtype)
  rho = jnp.sum(ordered * ranks > cumulative - 1) - 1
  theta = (cumulative[rho] - 1) / (rho + 1).astype(v.dtype)
  return jnp.maximum(v - theta, 0.0)


SIMPLEX_SMOOTHING = 0.001   # the ATP authors' ε


def simplex_label_distribution(inverse_conditional: jax.Array, predicted: jax.Array
                               ) -> jax.Array:
  """q [K] = (1 − ε)·Π_Δ(C̃⁺ μ̂) + ε/K from the pseudo-inverse C̃⁺ [K, K] of the
  class-conditional confusion and the predicted-label distribution μ̂ [K]."""
  num_classes = predicted.shape[0]
  q = project_to_simplex(inverse_conditional @ predicted)
  return (1 - SIMPLEX_SMOOTHING) * q + SIMPLEX_SMOOTHING / num_classes


PROJECTIONS = ('clip', 'simplex')


def source_confusion(module, context: SourceContext) -> jax.Array:
  """The joint confusion [K, K] of the global model on the labelled source examples."""
  return confusion_matrix(module, context.variables, context.source_x, context.source_y,
                          context.num_classes)


@register_constructor('bbse', from_context={'confusion': source_confusion},
                      ranges={'projection': one_of(*PROJECTIONS)})
def bbse(module, confusion: jax.Array, projection: str = 'clip') -> Adapter:
  """``confusion`` [K, K]: the joint C[i, j] = P_s(ŷ = i, y = j); ``projection``: 'clip'
  (Lipton et al.'s least squares clipped at 0, the default) or 'simplex' (the ATP
  authors')."""
  if projection not in PROJECTIONS:
    raise ValueError(f'bbse projection: unknown {projection!r}; choose from {list(PROJECTIONS)}')
  confusion = jnp.asarray(confusion, jnp.float32)
  num_classes = confusion.shape[0]
  conditional = confusion / jnp.maximum(jnp.sum(confusion, axis=0, keepdims=True), 1e-12)
  inverse_conditional = jnp.linalg.pinv(conditional)

  def weights(predicted):
    if projection == 'simplex':
      seen = jnp.sum(predicted) > 0
      return jnp.where(seen, simplex_label_distribution(inverse_conditional, predicted),
                       jnp.ones((num_classes,)))
    return importance_weights(confusion, predicted)

  def init(variables, rng):
    del rng
    return variables, jnp.zeros((num_classes,))

  def step(state, batch):
    variables, counts = state
    logits = models.apply(module, variables, batch.x)[0]
    onehot = jax.nn.one_hot(jnp.argmax(logits, -1), num_classes) * batch.weight[:, None]
    counts = counts + jnp.sum(onehot, axis=0)
    predicted = counts / jnp.maximum(jnp.sum(counts), 1e-12)
    return (variables, counts), reweight(jax.nn.log_softmax(logits), weights(predicted))

  return Adapter(init, step)

