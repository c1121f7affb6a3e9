"""Tent: Fully Test-Time Adaptation by Entropy Minimization. Wang et al., ICLR 2021,
Sec. 3: minimise the mean prediction entropy H(ŷ) = −Σ_c ŷ_c log ŷ_c of each test
batch w.r.t. the BatchNorm affine parameters only (scale γ, shift β), with BatchNorm
normalising by the test batch's statistics; one optimizer step per batch (Adam 1e-3
for CIFAR). ``predict='before'`` returns the logits computed before the batch's
update (the ATP authors' baseline code), 'after' re-runs the model after it.

Other papers ran it otherwise, and the fields say how:
  * the ATP authors' baseline: SGD at their lr 0.1 (``optimizer='sgd'``);
  * the UPFL paper's TENT (Ye et al. 2023, App. C–D, Table 4; the authors'
    ``hetero_tent``): the same BatchNorm-free model as every other method, so
    ``parameters='all'``, SGD at FedAvg's rate with the gradient clipped at global norm
    10 (``clip``) and weight decay 1e-4 (``weight_decay``, added after the clip, as
    PyTorch's SGD does), the entropy in bits (``entropy_units='bits'``, their log2), one
    step on the client's whole data, predicting after it.

``learning_rate`` may be one rate per BatchNorm layer ({'encoder/BatchNorm_0': η_0, …}:
the optimizer's direction times each layer's rate), the form ``learned_rates`` trains.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Union

import optax

from fedjax_shift import models
from fedjax_shift.adapters import common
from fedjax_shift.core.test_time import Adapter, register_constructor
from fedjax_shift.parts import losses
from fedjax_shift.parts.trees import clipped_and_decayed
from fedjax_shift.registry import NONNEGATIVE, one_of

PARAMETERS = ('batch_norm', 'all')
ENTROPY_UNITS = {'nats': 1.0, 'bits': 1.0 / math.log(2.0)}


@register_constructor(
    'tent', ranges={**common.OPTIMIZER_RANGES, 'parameters': one_of(*PARAMETERS),
                    'clip': NONNEGATIVE, 'weight_decay': NONNEGATIVE,
                    'entropy_units': one_of(*ENTROPY_UNITS), 'predict': common.PREDICT_RANGE},
    learnable={'learning_rate': 'log_per_bn_layer'}, streams=True)
def tent(module, learning_rate: Union[float, Dict[str, Any]] = 1e-3, predict: str = 'before',
         optimizer: optax.GradientTransformation | str = 'adam', parameters: str = 'batch_norm',
         clip: float = 0.0, weight_decay: float = 0.0, entropy_units: str = 'nats') -> Adapter:
  """Tent: ``optimizer`` 'adam' | 'sgd' at ``learning_rate`` (Tent: Adam 1e-3 on CIFAR)
  after the global-norm ``clip`` (0 = none) and ``weight_decay``, or a
  GradientTransformation used as it is; ``parameters``: 'batch_norm' (BN scale and bias,
  Tent's choice) or 'all'; ``predict``: 'before' (the ATP code: logits before the
  update) or 'after'."""
  if parameters not in PARAMETERS:
    raise ValueError(f'tent parameters: unknown {parameters!r}; choose from {list(PARAMETERS)}')
  if isinstance(optimizer, str):
    optimizer = clipped_and_decayed(common.make_optimizer(optimizer, learning_rate), clip,
                                    weight_decay)
  scale = ENTROPY_UNITS[entropy_units]

  def forward(variables, x):
    return models.apply(module, variables, x, 'batch_stats')[0]

  def loss_fn(variables, batch, extra):
    logits = forward(variables, batch.x)
    return scale * losses.weighted_entropy(logits, batch.weight), (logits, extra)

  if parameters == 'all':
    return common.gradient_adapter('tent', lambda path: True, 'tent (all parameters)',
                                   loss_fn, forward, optimizer, predict)
  return common.gradient_adapter(
      'tent', models.is_batch_norm_path, 'tent (BatchNorm affine parameters)', loss_fn,
      forward, optimizer, predict,
      check=common.require_batch_norm('tent'))
