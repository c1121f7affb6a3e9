"""Surgical fine-tuning: Surgical Fine-Tuning Improves Adaptation to Distribution
Shifts. Lee et al., ICLR 2023, Sec. 3.

Only one block is tuned, chosen by the kind of shift (input-level shifts: the first
block; output-level / label shifts: the last layer). Test clients have no labels,
so, as in the ATP authors' comparison, the block minimises the mean prediction
entropy of each test batch (one optimizer step per batch; running BatchNorm
statistics). ``block`` is a parameter-path prefix such as 'encoder/Dense_0' or
'head', or 'first' (the encoder's first layer).
"""
from __future__ import annotations

import optax

from fedjax_shift import models
from fedjax_shift.adapters import common
from fedjax_shift.core.test_time import ADAPTERS, Adapter, SourceContext


def block_selector(block: str, params):
  """Path predicate of ``block`` (prefix 'a/b', or 'first') for these params."""
  if block == 'first':
    first = next(iter(params['encoder']))
    prefix = ('encoder', first)
  else:
    prefix = tuple(block.split('/'))
  return lambda path: tuple(path[:len(prefix)]) == prefix


def surgical(module, block: str = 'first', learning_rate: float = 1e-3,
             predict: str = 'before', optimizer: optax.GradientTransformation | None = None
             ) -> Adapter:
  def forward(variables, x):
    return models.apply(module, variables, x, 'eval')[0]

  def loss_fn(variables, batch, extra):
    logits = forward(variables, batch.x)
    return common.weighted_entropy(logits, batch.weight), (logits, extra)

  return common.gradient_adapter('surgical', lambda params: block_selector(block, params),
                                 f'surgical block {block!r}', loss_fn, forward,
                                 optimizer or optax.adam(learning_rate), predict,
                                 selector_of_params=True)


@ADAPTERS.register('surgical', defaults={
    'learning_rate': 1e-3, 'predict': 'before',
    # Lee et al.: input-level shift → first block, label (output-level) shift → last
    # layer; one block name, or one per ATP shift (resolved by the 'atp' pipeline)
    'block': {'feature': 'first', 'label': 'head', 'hybrid': 'head'}})
def build_surgical(module, hparams, context: SourceContext) -> Adapter:
  """The registry's builder: this method from its ``config.adapters.surgical``."""
  block = hparams.block
  if not isinstance(block, str):
    raise ValueError(f'config.adapters.surgical.block: name one block here; a mapping per '
                     f'shift ({dict(block)}) is resolved by the atp pipeline')
  return surgical(module, block, hparams.learning_rate, hparams.predict)
