"""FedICON's test-time adaptation (Tan et al., NeurIPS 2023 Sec. 4.2, Eq. 7): the trained encoder
(and projection) is tuned on the unlabelled test data by an unsupervised contrastive
loss, the anchor x against its augmented view x' with every other test view in A(x):

  L_us = Σ_x −log exp(z_x·z'_x/τ) / Σ_{a∈A(x)} exp(z_x·z_a/τ)

Batch variant (mode 'episodic'): A(x) = the other views of the test batch; the model
restarts from the trained one at every batch. Online variant (mode 'online'): the
adapted model carries over and a memory of ``memory_size`` past test features joins
A(x) as negatives; each batch's features replace the oldest entries. The paper seeds
that memory with training samples and replaces a random one per test sample; an
adapter sees no training data here, so the memory starts empty and is first-in
first-out. With an empty memory the online variant's first batch is the batch
variant's (tests/test_fedicon.py).

Transductive variant (mode 'transductive', Eq. 2 as written: Eq. 7 minimised over the
client's whole local test set before predicting): ``epochs`` passes over the client's
shuffled test split, the model and memory carried, then every test example predicted by
the adapted model.

Each batch takes ``steps`` SGD steps (lr 0.005, the paper's contrastive rate; weight
decay 5e-4 as in training) on the encoder and projection, in batch-statistics mode,
then predicts with the personal head in eval mode ('after'; 'before' predicts with the
model it started the batch with). ``anchors``: 'raw' (Eq. 7: each raw test sample is an
anchor against its view, the views joining A(x) as candidates) or 'symmetric' (views
anchor too, as SupCon's training loss). ``batch_norm``: 'frozen' (predict with the
training running statistics) or 'test' (after each batch's steps, the running
statistics take the batch's, momentum 0.9 as in training).
The pipeline adapts only models trained by FedICON (fedicon, fedicon_us and the Table 5
ablations: the registry's ``trained_by``); without a projection z is the normalised
encoder output, as in training.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_shift import models
from fedjax_shift.adapters import common
from fedjax_shift.parts.contrastive import MIN_BATCH, projection_of, representation, supcon_loss
from fedjax_shift.core.test_time import Adapter, register_constructor, test_batch_size
from fedjax_shift.data import augment
from fedjax_shift.registry import (NONNEGATIVE, NONNEGATIVE_INT, POSITIVE, POSITIVE_INT, one_of,
                                   registered, sequence_of)


class ContrastiveState(NamedTuple):
  variables: dict
  opt_state: optax.OptState
  memory: jax.Array        # [M, D] normalised test features (negatives)
  memory_valid: jax.Array  # [M] bool
  next_slot: jax.Array     # [] int32, where the next feature is written
  rng: jax.Array


def write_memory(memory, valid, next_slot, features, weight):
  """First-in first-out write of the rows of ``features`` [B, D] with weight > 0."""
  size = memory.shape[0]
  keep = weight > 0
  offsets = jnp.cumsum(keep) - 1
  slots = jnp.where(keep, (next_slot + offsets) % size, size)  # size = dropped
  memory = memory.at[slots].set(features, mode='drop')
  valid = valid.at[slots].set(True, mode='drop')
  return memory, valid, (next_slot + jnp.sum(keep)) % size


ANCHORS = ('raw', 'symmetric')
BATCH_NORM = ('frozen', 'test')


class ContrastiveTTA(NamedTuple):
  """The section ``config.adapters.fedicon``: Eq. 7's adaptation (module docstring)."""
  temperature: float = 0.1          # Sec. 5.1: τ = 0.1 in Eq. 7
  learning_rate: float = 0.005      # Sec. 5.1: lr 0.005 for the contrastive loss
  steps: int = 1                    # SGD steps per test batch (our choice)
  memory_size: int = 128            # online variant: test features kept as negatives
  augmentations: tuple = ('random_resized_crop', 'colour_jitter', 'grayscale',
                          'gaussian_blur')
  predict: str = 'after'
  epochs: int = 1                   # passes over the test split ('transductive' mode)
  anchors: str = 'raw'              # Eq. 7: raw samples anchor; 'symmetric': views too
  batch_norm: str = 'frozen'        # running statistics: training's, or 'test' (updated)
  weight_decay: float = 5e-4        # Sec. 5.1: SGD weight decay 5e-4, as in training


@register_constructor(
    'fedicon', from_context={'batch_size': test_batch_size},
    ranges={'temperature': POSITIVE, 'learning_rate': POSITIVE, 'steps': POSITIVE_INT,
            # 0: no memory; else at least the test batch (fedicon_tta checks)
            'memory_size': NONNEGATIVE_INT,
            'augmentations': sequence_of(registered(augment.VIEW_AUGMENTATIONS)),
            'predict': common.PREDICT_RANGE, 'epochs': POSITIVE_INT,
            'anchors': one_of(*ANCHORS), 'batch_norm': one_of(*BATCH_NORM),
            'weight_decay': NONNEGATIVE},
    # FedICON's methods, and Local and FedAvg: Table 5's cells without local invariance
    # extraction, adapted by Eq. 7 on their encoder output (they have no projection).
    trained_by=('fedicon', 'fedicon_us', 'fedicon_no_sharing', 'fedicon_ce',
                'fedicon_ce_no_sharing', 'local', 'fedavg'), transductive=True, streams=True)
def fedicon_tta(module, batch_size: int = 0,
                settings: ContrastiveTTA = ContrastiveTTA()) -> Adapter:
  """FedICON's Eq. 7 adaptation with ``settings`` at test batch ``batch_size`` (0: not
  checked against the memory and the contrastive minimum)."""
  (temperature, learning_rate, steps, memory_size, augmentations, predict, epochs, anchors,
   batch_norm, weight_decay) = settings
  common.check_predict('fedicon', predict)
  common.check_fields('fedicon', {'anchors': (anchors, ANCHORS),
                                  'batch_norm': (batch_norm, BATCH_NORM)},
                       {'epochs': (epochs, 1), 'steps': (steps, 1),
                        'weight_decay': (weight_decay, 0)})
  augment.check_view_names(augmentations, 'adapters.fedicon.augmentations')
  if memory_size < 0 or (memory_size and memory_size < batch_size):
    raise ValueError(f'config.adapters.fedicon.memory_size: must be 0 or at least the test '
                     f'batch size ({batch_size}), got {memory_size}')
  if batch_size and batch_size < MIN_BATCH:
    raise ValueError(f'config.eval_adapter_batch_size={batch_size}: FedICON\'s contrastive '
                     f'adaptation needs at least {MIN_BATCH} test examples per batch')
  opt = optax.chain(optax.add_decayed_weights(weight_decay), optax.sgd(learning_rate))
  names = tuple(augmentations)
  memory_rows = max(memory_size, 1)

  def is_body(path):
    return path[0] != 'head'

  def init(variables, rng):
    body, _ = common.split_params(variables['params'], is_body, 'fedicon')
    projection = projection_of(variables['params'])
    # z's width: the projection's, or the encoder output's (the head's input)
    dim = projection.dim if projection is not None else models.feature_dim(variables)
    return ContrastiveState(variables, opt.init(body), jnp.zeros((memory_rows, dim)),
                            jnp.zeros((memory_rows,), bool), jnp.int32(0), rng)

  def predict_logits(variables, x):
    return models.apply(module, variables, x, 'eval')[0]

  def step(state, batch):
    rng, step_rng = jax.random.split(state.rng)
    variables, opt_state = state.variables, state.opt_state
    size = batch.x.shape[0]
    logits = predict_logits(variables, batch.x)
    weight = jnp.concatenate([batch.weight, batch.weight])
    anchor_weight = (jnp.concatenate([batch.weight, jnp.zeros_like(batch.weight)])
                     if anchors == 'raw' else None)
    labels = jnp.tile(jnp.arange(size), 2)
    projection = projection_of(variables['params'])
    for index in range(steps):
      body, rest = common.split_params(variables['params'], is_body, 'fedicon')
      views = jnp.concatenate([batch.x, jax.vmap(lambda k, image: augment.view(k, image, names))(
          jax.random.split(jax.random.fold_in(step_rng, index), size), batch.x)])

      def loss_fn(body):
        adapted = {**variables, 'params': common.join_params(body, rest)}
        z, _ = representation(module, projection, adapted, views, 'batch_stats')
        memory = state.memory if memory_size else None
        return supcon_loss(z, labels, weight, temperature, memory, state.memory_valid,
                           anchor_weight), z

      (_, z), grads = jax.value_and_grad(loss_fn, has_aux=True)(body)
      updates, opt_state = opt.update(grads, opt_state, body)
      body = optax.apply_updates(body, updates)
      variables = {**variables, 'params': common.join_params(body, rest)}
      if index == 0:
        first_features = jax.lax.stop_gradient(z[:size])
    memory, valid, next_slot = state.memory, state.memory_valid, state.next_slot
    if memory_size:
      memory, valid, next_slot = write_memory(memory, valid, next_slot, first_features,
                                              batch.weight)
    if batch_norm == 'test' and models.has_batch_norm(variables):
      variables = models.apply(module, variables, batch.x, 'train')[1]
    if predict == 'after':
      logits = predict_logits(variables, batch.x)
    return ContrastiveState(variables, opt_state, memory, valid, next_slot, rng), logits

  return Adapter(init, step, lambda state, batch: predict_logits(state.variables, batch.x),
                 epochs)
