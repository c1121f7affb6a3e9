"""BBSE: Detecting and Correcting for Label Shift with Black Box Predictors.
Lipton et al., ICML 2018, Sec. 4 (Eq. 4–5).

On labelled source held-out data, the joint confusion matrix
C[i, j] = P_s(ŷ = i, y = j); on target data the predicted-label distribution μ̂[i].
The importance weights solve C w = μ̂ (least squares, clipped at 0), and the
classifier predicts with p(y|x)·w_y renormalised. Episodic mode estimates μ̂ from
each batch; online mode from every target example seen so far.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_shift import models
from fedjax_shift.adapters.em import reweight
from fedjax_shift.core.test_time import ADAPTERS, Adapter, SourceContext


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


def bbse(module, confusion: jax.Array) -> Adapter:
  confusion = jnp.asarray(confusion, jnp.float32)
  num_classes = confusion.shape[0]

  def init(variables, rng):
    del rng
    return variables, jnp.zeros((num_classes,))

  def step(state, batch):
    variables, counts = state
    logits = models.apply(module, variables, batch.x)[0]
    onehot = jax.nn.one_hot(jnp.argmax(logits, -1), num_classes) * batch.weight[:, None]
    counts = counts + jnp.sum(onehot, axis=0)
    predicted = counts / jnp.maximum(jnp.sum(counts), 1e-12)
    w = importance_weights(confusion, predicted)
    return (variables, counts), reweight(jax.nn.log_softmax(logits), w)

  return Adapter(init, step)


@ADAPTERS.register('bbse', defaults={})
def build_bbse(module, hparams, context: SourceContext) -> Adapter:
  """The registry's builder: this method from its ``config.adapters.bbse``."""
  return bbse(module, confusion_matrix(module, context.variables, context.source_x,
                                      context.source_y, context.num_classes))
