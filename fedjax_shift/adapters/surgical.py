"""Surgical fine-tuning: Surgical Fine-Tuning Improves Adaptation to Distribution
Shifts. Lee et al., ICLR 2023, Sec. 3.

Only one block is tuned, chosen by the kind of shift (input-level shifts: the first
block; output-level / label shifts: the last layer). Test clients have no labels,
so, as in the ATP authors' comparison, the block minimises the mean prediction
entropy of each test batch (one optimizer step per batch; running BatchNorm
statistics). ``block`` is a parameter-path prefix such as 'encoder/Dense_0' or
'head', 'first' / 'last' (the encoder's first / last layer in the order the model
defines them: ``models.layer_order``) or a layer index.
"""
from __future__ import annotations

import optax

from fedjax_shift import models
from fedjax_shift.adapters import common
from fedjax_shift.core.test_time import ADAPTERS, Adapter, SourceContext


def block_selector(module, block, input_shape: tuple):
  """Path predicate of ``block``: a path prefix ('encoder/Dense_0', 'head') as given;
  'first', 'last' or an index from the model's layer order, which needs one example's
  ``input_shape``."""
  field = 'config.adapters.surgical.block'
  if input_shape:
    return models.layer_selector(module, input_shape, block, field)
  if block in ('first', 'last') or isinstance(block, int):
    raise ValueError(f'{field}: {block!r} is a position in the model\'s layer order, which '
                     f'needs the input shape (SourceContext.input_shape); name the layer '
                     f'instead, e.g. \'encoder/Dense_0\'')
  prefix = tuple(block.split('/'))
  return lambda path: tuple(path[:len(prefix)]) == prefix


def surgical(module, block='first', learning_rate: float = 1e-3,
             predict: str = 'before', optimizer: optax.GradientTransformation | None = None,
             input_shape: tuple = ()) -> Adapter:
  def forward(variables, x):
    return models.apply(module, variables, x, 'eval')[0]

  def loss_fn(variables, batch, extra):
    logits = forward(variables, batch.x)
    return common.weighted_entropy(logits, batch.weight), (logits, extra)

  return common.gradient_adapter('surgical', block_selector(module, block, input_shape),
                                 f'surgical block {block!r}', loss_fn, forward,
                                 optimizer or optax.adam(learning_rate), predict)


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
  input_shape = context.input_shape or (tuple(context.source_x.shape[1:])
                                         if context.source_x is not None else ())
  return surgical(module, block, hparams.learning_rate, hparams.predict,
                  input_shape=input_shape)
