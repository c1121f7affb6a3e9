"""Conjugate PL: Test-Time Adaptation via Conjugate Pseudo-labels. Goyal et al.,
NeurIPS 2022, Eq. 6–9.

For a source model trained with loss L(h, y) = f(h) − yᵀh, the conjugate
pseudo-label is ỹ = ∇f(h) and the test-time loss is L(h, ỹ) = −f*(∇f(h)) (Eq. 9). For the
cross-entropy, f(h) = log Σ exp h: ỹ = softmax(h) and the conjugate loss is
−Σ_c softmax(h)_c h_c + logsumexp(h), the softmax entropy (their Sec. 4: Tent's loss);
with the temperature T of their experiments both are taken of h / T. One optimizer step
per batch on the BatchNorm affine parameters (BatchNorm on the test batch's statistics),
predicting with the logits before the step, as their code (github.com/locuslab/tta_conjugate,
built on Tent's).
"""
from __future__ import annotations

from typing import Any, Dict, Union

import jax
import jax.numpy as jnp

from fedjax_shift import models
from fedjax_shift.adapters import common
from fedjax_shift.core.local import masked_mean
from fedjax_shift.core.test_time import Adapter, register_constructor
from fedjax_shift.registry import POSITIVE


def conjugate_loss(logits: jax.Array, temperature) -> jax.Array:
  """Per-example conjugate loss of the cross-entropy, −Σ_c ỹ_c h_c + logsumexp(h) with
  h = logits / T and ỹ = softmax(h). [B, C] -> [B]."""
  h = logits / temperature
  return -jnp.sum(jax.nn.softmax(h) * h, -1) + jax.scipy.special.logsumexp(h, -1)


@register_constructor(
    'conjugate_pl', ranges={**common.OPTIMIZER_RANGES, 'temperature': POSITIVE,
                            'predict': common.PREDICT_RANGE},
    learnable={'learning_rate': 'log'}, streams=True)
def conjugate_pl(module, learning_rate: Union[float, Dict[str, Any]] = 1e-3,
                 optimizer: str = 'adam', temperature: float = 1.0,
                 predict: str = 'before') -> Adapter:
  """Conjugate PL of the cross-entropy at ``temperature`` T, ``optimizer`` at
  ``learning_rate`` on the BatchNorm affine parameters."""
  common.check_fields('conjugate_pl', choices={'optimizer': (optimizer, common.DIRECTIONS)})
  opt = common.make_optimizer(optimizer, learning_rate)

  def forward(variables, x):
    return models.apply(module, variables, x, 'batch_stats')[0]

  def loss_fn(variables, batch, extra):
    logits = forward(variables, batch.x)
    return masked_mean(conjugate_loss(logits, temperature), batch.weight), (logits, extra)

  return common.gradient_adapter(
      'conjugate_pl', models.is_batch_norm_path, 'conjugate_pl (BatchNorm affine parameters)',
      loss_fn, forward, opt, predict, check=common.require_batch_norm('conjugate_pl'))
