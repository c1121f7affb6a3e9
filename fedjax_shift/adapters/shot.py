"""SHOT: Do We Really Need to Access the Source Data? Source Hypothesis Transfer for
Unsupervised Domain Adaptation. Liang et al., ICML 2020, Eq. 2–6.

The head is frozen; the encoder minimises, on each test batch,

  L = mean_x H(p(x)) − H(mean_x p(x)) + β · CE(p(x), ŷ(x))        (β = 0.3)

(the ATP authors' baseline: β = 0 and SGD at their lr 0.1, set by configs/atp.py)

(information maximisation: confident and diverse predictions) with pseudo-labels ŷ
from self-supervised clustering: centroids c_k = Σ_x p_k(x) f(x) / Σ_x p_k(x),
labels by nearest centroid in cosine distance, centroids recomputed from those
labels and labels assigned once more (Eq. 4–5). One optimizer step per batch;
BatchNorm in batch-statistic mode as in Tent; the logits before the update are
returned by default (the ATP authors' baseline code).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from fedjax_shift import models
from fedjax_shift.adapters import common
from fedjax_shift.core.local import masked_mean
from fedjax_shift.core.test_time import Adapter, register_constructor
from fedjax_shift.parts import losses
from fedjax_shift.registry import NONNEGATIVE


def cluster_pseudo_labels(features: jax.Array, probs: jax.Array, weight: jax.Array
                          ) -> jax.Array:
  """SHOT's pseudo-labels [B] from features [B, F] and probabilities [B, C]."""
  feats = jnp.concatenate([features, jnp.ones((features.shape[0], 1))], axis=1)
  feats = feats / jnp.maximum(jnp.linalg.norm(feats, axis=1, keepdims=True), 1e-12)

  def assign(soft):
    soft = soft * weight[:, None]
    centroids = soft.T @ feats / jnp.maximum(soft.sum(0)[:, None], 1e-8)
    centroids = centroids / jnp.maximum(jnp.linalg.norm(centroids, axis=1, keepdims=True),
                                        1e-12)
    return jnp.argmax(feats @ centroids.T, axis=1)

  labels = assign(probs)
  return assign(jax.nn.one_hot(labels, probs.shape[1]))


@register_constructor(
    'shot', ranges={**common.OPTIMIZER_RANGES,
                    'pseudo_label_weight': NONNEGATIVE,   # 0: information maximisation only (ATP)
                    'predict': common.PREDICT_RANGE},
    learnable={'learning_rate': 'log'}, streams=True)
def shot(module, learning_rate: float = 1e-3, pseudo_label_weight: float = 0.3,
         predict: str = 'before', optimizer: optax.GradientTransformation | str = 'adam'
         ) -> Adapter:
  """``optimizer``: 'adam' | 'sgd' at ``learning_rate`` (Tent's Adam 1e-3), or a
  GradientTransformation; ``pseudo_label_weight``: SHOT's β = 0.3; ``predict``:
  'before' (the ATP code: logits before the update) or 'after'."""
  if isinstance(optimizer, str):
    optimizer = common.make_optimizer(optimizer, learning_rate)

  def forward(variables, x):
    features = models.features(module, variables, x, 'batch_stats')
    return features, models.head(variables, features)

  def loss_fn(variables, batch, extra):
    features, logits = forward(variables, batch.x)
    probs = jax.nn.softmax(logits)
    mean_probs = jnp.sum(probs * batch.weight[:, None], 0) / jnp.maximum(
        jnp.sum(batch.weight), 1e-12)
    diversity = -jnp.sum(mean_probs * jnp.log(mean_probs + 1e-5))
    loss = losses.weighted_entropy(logits, batch.weight) - diversity
    if pseudo_label_weight:
      labels = jax.lax.stop_gradient(cluster_pseudo_labels(features, probs, batch.weight))
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
      loss = loss + pseudo_label_weight * masked_mean(ce, batch.weight)
    return loss, (logits, extra)

  return common.gradient_adapter(
      'shot', lambda path: path[0] == 'encoder', 'shot (encoder parameters)', loss_fn,
      lambda variables, x: forward(variables, x)[1], optimizer, predict)
