"""Test-time methods (``Adapter(init, step)``), one file each, and the registry the
experiment pipeline builds them from.

Each file exposes a constructor with explicit arguments (``tent(module, lr, …)``).
``ADAPTERS`` maps a name to ``build(module, adapter_config, context) -> Adapter``,
where ``adapter_config`` is the method's config section (its paper's defaults, see
configs/atp.py) and ``context`` carries what some methods take from the source side:
the global model, labelled source held-out examples (EATA's Fisher, BBSE's
confusion matrix) and ATP's learned α.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import ml_collections
import numpy as np

from fedjax_shift.adapters import (atp, bbse, bn_adapt, eata, em, memo, no_adapt, shot,
                                   surgical, t3a, tent)
from fedjax_shift.core.test_time import Adapter
from fedjax_shift.registry import Registry


class SourceContext(NamedTuple):
  """What adapters may use besides the test batches.

  Attributes:
    variables: the global model θ_G.
    num_classes: C.
    batch_size: the test-time batch size B.
    source_x, source_y: labelled source held-out examples [M, ...], [M].
    alpha: ATP's learned rates (None before α training).
  """
  variables: Any
  num_classes: int
  batch_size: int
  source_x: np.ndarray
  source_y: np.ndarray
  alpha: Optional[Any] = None


ADAPTERS: Registry = Registry('adapter')
Config = ml_collections.ConfigDict


@ADAPTERS.register('no_adapt')
def _no_adapt(module, cfg: Config, context: SourceContext) -> Adapter:
  return no_adapt.no_adapt(module)


@ADAPTERS.register('bn_adapt')
def _bn_adapt(module, cfg: Config, context: SourceContext) -> Adapter:
  return bn_adapt.bn_adapt(module, bn_adapt.prior_weight(cfg.prior_strength, context.batch_size))


@ADAPTERS.register('tent')
def _tent(module, cfg: Config, context: SourceContext) -> Adapter:
  return tent.tent(module, cfg.learning_rate, cfg.predict)


@ADAPTERS.register('eata')
def _eata(module, cfg: Config, context: SourceContext) -> Adapter:
  fisher = eata.fisher_information(module, context.variables,
                              context.source_x[:cfg.fisher_samples]) if cfg.fisher_weight else None
  return eata.eata(module, context.num_classes, fisher, cfg.learning_rate, cfg.momentum,
              cfg.entropy_margin, cfg.redundancy_epsilon, cfg.fisher_weight, cfg.predict)


@ADAPTERS.register('shot')
def _shot(module, cfg: Config, context: SourceContext) -> Adapter:
  return shot.shot(module, cfg.learning_rate, cfg.pseudo_label_weight, cfg.predict)


@ADAPTERS.register('t3a')
def _t3a(module, cfg: Config, context: SourceContext) -> Adapter:
  return t3a.t3a(module, cfg.filter_k)


@ADAPTERS.register('memo')
def _memo(module, cfg: Config, context: SourceContext) -> Adapter:
  return memo.memo(module, cfg.num_augmentations, cfg.learning_rate,
                   num_steps=cfg.get('num_steps', 1))


@ADAPTERS.register('em')
def _em(module, cfg: Config, context: SourceContext) -> Adapter:
  return em.em(module, context.num_classes, cfg.num_iterations)


@ADAPTERS.register('bbse')
def _bbse(module, cfg: Config, context: SourceContext) -> Adapter:
  return bbse.bbse(module, bbse.confusion_matrix(module, context.variables, context.source_x,
                                       context.source_y, context.num_classes))


@ADAPTERS.register('surgical')
def _surgical(module, cfg: Config, context: SourceContext) -> Adapter:
  return surgical.surgical(module, cfg.block, cfg.learning_rate, cfg.predict)


@ADAPTERS.register('atp')
def _atp(module, cfg: Config, context: SourceContext) -> Adapter:
  if context.alpha is None:
    raise ValueError('atp: no learned alpha; the pipeline trains it before test time')
  return atp.atp(module, context.alpha)
