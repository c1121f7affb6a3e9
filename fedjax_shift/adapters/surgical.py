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

from typing import Dict, List, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util

from fedjax_shift import models
from fedjax_shift.adapters import common
from fedjax_shift.core.test_time import Adapter, SourceContext, register_constructor, whole_context
from fedjax_shift.parts import losses
from fedjax_shift.registry import POSITIVE_INT, Range, one_of, require, sequence_of


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
  return models.prefix_selector(block)


def layer_of_paths(module, input_shape: tuple, params) -> Tuple[List[str], Dict[tuple, int]]:
  """(the model's layers in order, {flat parameter path: its layer's index})."""
  layers = list(models.layer_order(module, tuple(input_shape)))
  flat = traverse_util.flatten_dict(params)
  return layers, {path: layers.index('/'.join(path[:-1])) for path in flat}


def candidate_masks(module, input_shape: tuple, candidates: Sequence) -> Tuple[List[str], np.ndarray]:
  """(candidate names, masks [C, L]): row c is 1 on the layers candidate c selects
  (``models.layer_selector``); no candidates: every layer of the model on its own."""
  layers = list(models.layer_order(module, tuple(input_shape)))
  candidates = list(candidates) or layers
  masks = np.zeros((len(candidates), len(layers)), np.float32)
  for c, block in enumerate(candidates):
    select = models.layer_selector(module, input_shape, block, 'config.adapters.surgical.candidates')
    masks[c] = [select(tuple(layer.split('/')) + ('kernel',)) for layer in layers]
  return [str(c) for c in candidates], masks


def masked_sgd_step(module, variables, x, weight, mask, index_of, learning_rate: float):
  """One SGD step of the batch's mean prediction entropy on the layers ``mask`` [L]
  selects (the others keep their values exactly), BatchNorm in eval mode."""
  params = variables['params']

  def entropy(params):
    logits = models.apply(module, {**variables, 'params': params}, x, 'eval')[0]
    return losses.weighted_entropy(logits, weight)

  flat_params = traverse_util.flatten_dict(params)
  flat_grads = traverse_util.flatten_dict(jax.grad(entropy)(params))
  stepped = {path: jnp.where(mask[index_of[path]] > 0,
                             value - learning_rate * flat_grads[path], value)
             for path, value in flat_params.items()}
  return {**variables, 'params': traverse_util.unflatten_dict(stepped)}


def selection_scores(module, context: SourceContext, learning_rate: float,
                     candidates: Sequence, selection_examples: int):
  """The ATP release's block selection: (scores [candidates], masks [candidates, layers],
  {flat parameter path: layer index}). A candidate's score is the accuracy on the
  labelled source held-out examples (``context.source_x/y``, the first
  ``selection_examples``, in batches of the test batch size) after one SGD step of
  ``learning_rate`` from the global model on each batch's entropy, predicting after it;
  every candidate is one vmapped scan over the source batches, one compiled call."""
  if context.source_x is None or context.variables is None:
    raise ValueError("config.adapters.surgical.select='source_accuracy' scores the blocks on "
                     'labelled source data, which this pipeline does not give its adapters; '
                     "use select='fixed'")
  input_shape = tuple(context.source_x.shape[1:])
  _, masks = candidate_masks(module, input_shape, candidates)
  _, index_of = layer_of_paths(module, input_shape, context.variables['params'])
  batch = context.batch_size
  count = min(len(context.source_x), selection_examples) // batch * batch
  if count == 0:
    raise ValueError(f'config.adapters.surgical.selection_examples: {selection_examples} '
                     f'source examples make no batch of {batch}')
  xs = jnp.reshape(context.source_x[:count], (count // batch, batch, *input_shape))
  ys = jnp.reshape(context.source_y[:count], (count // batch, batch))

  @jax.jit
  def scores(variables, masks, xs, ys):
    def score(mask):
      def one(correct, xy):
        x, y = xy
        adapted = masked_sgd_step(module, variables, x, jnp.ones(batch), mask, index_of,
                                  learning_rate)
        logits = models.apply(module, adapted, x, 'eval')[0]
        return correct + jnp.sum(jnp.argmax(logits, -1) == y), None
      correct, _ = jax.lax.scan(one, jnp.float32(0.0), (xs, ys))
      return correct / count
    return jax.vmap(score)(masks)

  masks = jnp.asarray(masks)
  return scores(context.variables, masks, xs, ys), masks, index_of


def source_selected(module, context: SourceContext, learning_rate: float, predict: str,
                    candidates: Sequence, selection_examples: int) -> Adapter:
  """The authors' Surgical (the ATP release): the block is the candidate whose
  adaptation gives the best accuracy on the labelled source held-out examples
  (``selection_scores``, once per build); then one SGD step of ``learning_rate`` per
  test batch on that block."""
  scores, masks, index_of = selection_scores(module, context, learning_rate, candidates,
                                             selection_examples)
  chosen = masks[jnp.argmax(scores)]

  def forward(variables, x):
    return models.apply(module, variables, x, 'eval')[0]

  def init(variables, rng):
    del rng
    return variables

  def step(variables, batch_data):
    before = forward(variables, batch_data.x)
    adapted = masked_sgd_step(module, variables, batch_data.x, batch_data.weight, chosen,
                              index_of, learning_rate)
    return adapted, (forward(adapted, batch_data.x) if predict == 'after' else before)

  common.check_predict('surgical', predict)
  return Adapter(init, step, forward)


SELECT = ('fixed', 'source_accuracy')
# A block as ``models.layer_selector`` reads it (whether it names a layer is known only
# with the model); a candidate may also be a layer index.
BLOCK = Range("a layer's path prefix ('encoder/Dense_0', 'head'), 'first' or 'last'",
              lambda value: isinstance(value, str) and value != '', '')
CANDIDATE = Range("a layer's path prefix, 'first', 'last' or a layer index",
                  lambda value: BLOCK.accepts(value) or (
                      isinstance(value, int) and not isinstance(value, bool)), '')


def check(hparams) -> None:
  """config.adapters.surgical's optimizer for its selection rule (errors name the field)."""
  require(hparams.select == 'fixed' or hparams.optimizer == 'sgd', 'adapters.surgical.optimizer',
          "select='source_accuracy' takes the authors' SGD step: set optimizer='sgd'")


# Lee et al.: input-level shift → the first block, label (output-level) shift → the last
# layer; one block name, or one per ATP shift (resolved by the 'atp' pipeline).
BLOCK_PER_SHIFT = {'feature': 'first', 'label': 'head', 'hybrid': 'head'}


@register_constructor('surgical', from_context={'source': whole_context},
                      ranges={**common.OPTIMIZER_RANGES, 'predict': common.PREDICT_RANGE,
                              'block': BLOCK,   # each shift's, or one for all
                              'select': one_of(*SELECT),
                              'candidates': sequence_of(CANDIDATE),
                              'selection_examples': POSITIVE_INT},
                      check=check, streams=True)
def surgical(module, source: SourceContext, block=BLOCK_PER_SHIFT,
             learning_rate: float = 1e-3, predict: str = 'before',
             optimizer: optax.GradientTransformation | str = 'adam', select: str = 'fixed',
             candidates: Sequence = (), selection_examples: int = 1000) -> Adapter:
  """Surgical fine-tuning of ``block`` (a name; a mapping per shift is resolved by the atp
  pipeline) by ``optimizer`` ('adam' | 'sgd' at ``learning_rate``, or a
  GradientTransformation), one step per test batch. ``select``: 'fixed' (``block``) or
  'source_accuracy', the ATP release's rule: the candidate whose one-step adaptation
  scores best on ``source``'s labelled held-out data (``candidates``: block names,
  () = every layer of the model; the first ``selection_examples``). ``source``'s input
  shape places 'first', 'last' and layer indices in the model's layer order."""
  if select == 'source_accuracy':
    return source_selected(module, source, learning_rate, predict, tuple(candidates),
                           selection_examples)
  if not isinstance(block, str):
    raise ValueError(f'config.adapters.surgical.block: name one block here; a mapping per '
                     f'shift ({dict(block)}) is resolved by the atp pipeline')
  if isinstance(optimizer, str):
    optimizer = common.make_optimizer(optimizer, learning_rate)
  input_shape = source.input_shape or (tuple(source.source_x.shape[1:])
                                       if source.source_x is not None else ())

  def forward(variables, x):
    return models.apply(module, variables, x, 'eval')[0]

  def loss_fn(variables, batch, extra):
    logits = forward(variables, batch.x)
    return losses.weighted_entropy(logits, batch.weight), (logits, extra)

  return common.gradient_adapter('surgical', block_selector(module, block, input_shape),
                                 f'surgical block {block!r}', loss_fn, forward,
                                 optimizer, predict)
