"""PL: Pseudo-Label, the simple and efficient semi-supervised learning method for deep
neural networks. Lee, ICML 2013 workshop, Eq. 1, as the online test-time benchmark of
Alfarra et al. (ICML 2024) runs it.

Each test example whose top softmax probability is at least the threshold counts with
its hard pseudo-label y' = argmax p (Lee's Eq. 1); the loss is the mean cross-entropy of
those examples, one optimizer step per batch on the BatchNorm affine parameters (BatchNorm
on the test batch's statistics, as Tent), predicting with the logits before the step. A
batch with no confident example takes no step and is counted out of ``adapted_batches``.
"""
from __future__ import annotations

from typing import Any, Dict, Union

import jax
import jax.numpy as jnp
import optax

from fedjax_shift import models
from fedjax_shift.adapters import common
from fedjax_shift.core.local import masked_mean
from fedjax_shift.core.test_time import Adapter, register_constructor
from fedjax_shift.registry import interval


def confident_labels(logits: jax.Array, weight: jax.Array, threshold) -> tuple:
  """(hard pseudo-labels [B], the mask [B] of examples with max softmax >= threshold and
  weight > 0)."""
  probs = jax.nn.softmax(logits)
  return jnp.argmax(probs, -1), (jnp.max(probs, -1) >= threshold) & (weight > 0)


@register_constructor(
    'pl', ranges={**common.OPTIMIZER_RANGES, 'threshold': interval(0, 1, low_open=True,
                                                                    high_open=True),
                  'momentum': interval(0, 1, high_open=True)},
    learnable={'learning_rate': 'log'}, streams=True)
def pl(module, learning_rate: Union[float, Dict[str, Any]] = 0.00025, optimizer: str = 'sgd',
       momentum: float = 0.9, threshold: float = 0.9) -> Adapter:
  """PL: ``optimizer`` at ``learning_rate`` (``momentum`` for SGD) on the BatchNorm affine
  parameters, examples with confidence >= ``threshold`` in (0, 1)."""
  if isinstance(threshold, (int, float)) and not 0.0 < threshold < 1.0:
    raise ValueError(f'config.adapters.pl.threshold: must be in (0, 1), got {threshold}')
  common.check_fields('pl', choices={'optimizer': (optimizer, common.DIRECTIONS)})
  opt = (optax.sgd(learning_rate, momentum=momentum or None) if optimizer == 'sgd'
         else common.make_optimizer(optimizer, learning_rate))

  def forward(variables, x):
    return models.apply(module, variables, x, 'batch_stats')[0]

  def loss_fn(variables, batch, extra):
    logits = forward(variables, batch.x)
    labels, confident = confident_labels(jax.lax.stop_gradient(logits), batch.weight, threshold)
    loss = masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels),
                       confident.astype(jnp.float32))
    return loss, (logits, jnp.any(confident))

  return common.gradient_adapter(
      'pl', models.is_batch_norm_path, 'pl (BatchNorm affine parameters)', loss_fn, forward,
      opt, 'before', init_extra=lambda variables: jnp.bool_(False),
      check=common.require_batch_norm('pl'), step_if=lambda extra: extra,
      took_step=lambda extra: extra)
