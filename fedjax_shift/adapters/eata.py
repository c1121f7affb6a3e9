"""EATA: Efficient Test-Time Model Adaptation without Forgetting. Niu et al.,
ICML 2022, Eq. 3–9.

Tent-style entropy minimisation of the BatchNorm affine parameters, with
  * a reliability filter: only examples with entropy H < E0 = 0.4·ln C count,
    each weighted by 1 / exp(H − E0)                                   (Eq. 6)
  * a redundancy filter: an example is skipped when the cosine similarity of its
    prediction to the moving average of past predictions is ≥ ε = 0.05  (Eq. 7–8;
    the average m ← 0.9·m + 0.1·mean p over kept examples)
  * an anti-forgetting regulariser β · Σ_i F_i (θ_i − θ_i^0)², β = 2000, with the
    diagonal Fisher F from 2000 source samples and the model's own labels (Eq. 9).
As the official code (github.com/mr-eggplant/EATA): a batch that keeps no example takes
no step (parameters and momentum unchanged), and SGD's rate is 0.00025 with momentum
0.9 at batch 64, scaled linearly to the test batch B (0.00025 · B / 64).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_shift import models
from fedjax_shift.adapters import common
from fedjax_shift.core.local import masked_mean
from fedjax_shift.core.test_time import Adapter, SourceContext, register_constructor, whole_context
from fedjax_shift.parts import losses
from fedjax_shift.registry import NONNEGATIVE, POSITIVE, POSITIVE_INT, interval


class EATAExtra(NamedTuple):
  mean_probs: jax.Array   # [C] moving average of kept predictions
  seen: jax.Array         # [] bool, False until the first kept batch
  anchor: dict            # θ^0: the source BN affine parameters (flat dict)
  kept: jax.Array         # [] bool: the last batch kept an example (else no step)


def fisher_information(module, variables, x, batch_size: int = 64):
  """Diagonal Fisher of the BN affine parameters: mean over batches of the squared
  gradient of the CE against the model's own predictions (EATA's construction).
  x: [N, ...] source examples. Returns a flat {path: [..]} dict like the parameters."""
  selected, rest = common.split_params(variables['params'], models.is_batch_norm_path,
                                       'eata (BatchNorm affine parameters)')

  @jax.jit
  def squared_grad(selected, xb):
    def loss(selected):
      v = {**variables, 'params': common.join_params(selected, rest)}
      logits = models.apply(module, v, xb, 'batch_stats')[0]
      labels = jax.lax.stop_gradient(jnp.argmax(logits, -1))
      return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))
    return jax.tree.map(jnp.square, jax.grad(loss)(selected))

  total, count = jax.tree.map(jnp.zeros_like, selected), 0
  for start in range(0, len(x), batch_size):
    total = jax.tree.map(jnp.add, total, squared_grad(selected, jnp.asarray(x[start:start +
                                                                              batch_size])))
    count += 1
  return jax.tree.map(lambda t: t / max(count, 1), total)


@register_constructor(
    'eata', from_context={'source': whole_context},
    ranges={'learning_rate': POSITIVE, 'lr_batch_size': POSITIVE_INT,
            'momentum': interval(0, 1, high_open=True), 'entropy_margin': POSITIVE,
            # ε > 0: at 0 every example after the first kept batch counts as redundant
            'redundancy_epsilon': POSITIVE,
            'fisher_weight': NONNEGATIVE,   # 0: no regulariser (no source data needed)
            'fisher_samples': POSITIVE_INT, 'predict': common.PREDICT_RANGE},
    learnable={'learning_rate': 'log'}, streams=True)
def eata(module, source: SourceContext, learning_rate: float = 0.00025,
         lr_batch_size: int = 64, momentum: float = 0.9, entropy_margin: float = 0.4,
         redundancy_epsilon: float = 0.05, fisher_weight: float = 2000.0,
         fisher_samples: int = 2000, predict: str = 'before') -> Adapter:
  """EATA on ``source``'s test batch size B and C classes, with the official code's
  values: SGD at ``learning_rate`` 0.00025 for batch ``lr_batch_size`` 64, scaled
  linearly to B, ``momentum`` 0.9; E0 = ``entropy_margin`` · ln C (0.4); ε =
  ``redundancy_epsilon`` (0.05); β = ``fisher_weight`` (2000; 0: no regulariser), the
  Fisher from the first ``fisher_samples`` (2000) of ``source``'s labelled examples."""
  if fisher_weight and source.source_x is None:
    raise ValueError('config.adapters.eata.fisher_weight: the Fisher regulariser needs '
                     'labelled source data, which this pipeline does not give its adapters '
                     '(the federated pipeline\'s eval_adapters); set it to 0 (EATA without '
                     'the regulariser)')
  fisher = fisher_information(module, source.variables, source.source_x[:fisher_samples]
                              ) if fisher_weight else None
  learning_rate = learning_rate * source.batch_size / lr_batch_size
  num_classes = source.num_classes
  margin = entropy_margin * float(np.log(num_classes))

  def forward(variables, x):
    return models.apply(module, variables, x, 'batch_stats')[0]

  def loss_fn(variables, batch, extra: EATAExtra):
    logits = forward(variables, batch.x)
    probs = jax.nn.softmax(logits)
    ents = losses.entropy(logits)
    reliable = (ents < margin) & (batch.weight > 0)
    cosine = (probs @ extra.mean_probs) / jnp.maximum(
        jnp.linalg.norm(probs, axis=1) * jnp.linalg.norm(extra.mean_probs), 1e-12)
    keep = reliable & (~extra.seen | (jnp.abs(cosine) < redundancy_epsilon))
    coeff = jax.lax.stop_gradient(1.0 / jnp.exp(ents - margin))
    loss = masked_mean(ents * coeff, keep.astype(jnp.float32))
    if fisher is not None:
      selected, _ = common.split_params(variables['params'], models.is_batch_norm_path, 'eata')
      penalty = sum(jnp.sum(fisher[p] * (selected[p] - extra.anchor[p]) ** 2)
                    for p in selected)
      loss = loss + fisher_weight * penalty
    kept = keep.astype(jnp.float32)[:, None]
    batch_mean = jnp.sum(probs * kept, 0) / jnp.maximum(jnp.sum(kept), 1e-12)
    any_kept = jnp.sum(kept) > 0
    updated = jnp.where(extra.seen, 0.9 * extra.mean_probs + 0.1 * batch_mean, batch_mean)
    extra = EATAExtra(jax.lax.stop_gradient(jnp.where(any_kept, updated, extra.mean_probs)),
                      extra.seen | any_kept, extra.anchor, any_kept)
    return loss, (logits, extra)

  def init_extra(variables):
    anchor, _ = common.split_params(variables['params'], models.is_batch_norm_path, 'eata')
    return EATAExtra(jnp.zeros((num_classes,)), jnp.bool_(False), anchor, jnp.bool_(False))

  return common.gradient_adapter(
      'eata', models.is_batch_norm_path, 'eata (BatchNorm affine parameters)', loss_fn,
      forward, optax.sgd(learning_rate, momentum=momentum or None), predict,
      init_extra=init_extra, check=common.require_batch_norm('eata'),
      step_if=lambda extra: extra.kept)
