"""Tent: Fully Test-Time Adaptation by Entropy Minimization. Wang et al., ICLR 2021,
Sec. 3: minimise the mean prediction entropy H(ŷ) = −Σ_c ŷ_c log ŷ_c of each test
batch w.r.t. the BatchNorm affine parameters only (scale γ, shift β), with BatchNorm
normalising by the test batch's statistics; one optimizer step per batch (Adam 1e-3
for CIFAR; ``optimizer='sgd'`` for the ATP authors' baseline, SGD at their lr 0.1). ``predict='before'`` returns the logits computed before the batch's
update (the ATP authors' baseline code), 'after' re-runs the model after it.

``learning_rate`` may be one rate per BatchNorm layer ({'encoder/BatchNorm_0': η_0, …}:
Adam's direction times each layer's rate), the form ``learned_rates`` trains.
"""
from __future__ import annotations

from typing import Any, Dict, Union

import optax

from fedjax_shift import models
from fedjax_shift.adapters import common
from fedjax_shift.core.test_time import ADAPTERS, Adapter, SourceContext


def tent(module, learning_rate: Union[float, Dict[str, Any]] = 1e-3, predict: str = 'before',
         optimizer: optax.GradientTransformation | str = 'adam') -> Adapter:
  """``optimizer``: 'adam' | 'sgd' at ``learning_rate``, or a GradientTransformation."""
  if isinstance(optimizer, str):
    optimizer = common.make_optimizer(optimizer, learning_rate)

  def forward(variables, x):
    return models.apply(module, variables, x, 'batch_stats')[0]

  def loss_fn(variables, batch, extra):
    logits = forward(variables, batch.x)
    return common.weighted_entropy(logits, batch.weight), (logits, extra)

  return common.gradient_adapter(
      'tent', models.is_batch_norm_path, 'tent (BatchNorm affine parameters)', loss_fn,
      forward, optimizer, predict,
      check=common.require_batch_norm('tent'))


@ADAPTERS.register('tent', defaults={
    'learning_rate': 1e-3,            # Tent: Adam 1e-3 (CIFAR)
    'optimizer': 'adam',
    'predict': 'before'},             # ATP code: logits before the update
    check=lambda hparams: common.check_optimizer('tent', hparams),
    learnable={'learning_rate': 'log_per_bn_layer'})
def build_tent(module, hparams, context: SourceContext) -> Adapter:
  """The registry's builder: this method from its ``config.adapters.tent``."""
  return tent(module, hparams.learning_rate, hparams.predict, hparams.optimizer)
