"""FedICON: Taming Inter-Client Heterogeneity for Test-Time Shift in Federated Learning
(Tan et al., NeurIPS 2023, Sec. 4; its Algorithm 1 is in an appendix our copy lacks).

  client i, each round (Sec. 4.1.1):
    head_i ← ``head_epochs`` of SGD on CE (lr 0.01), encoder frozen: from the
             server's head, and averaged with the encoder (``head_sharing=
             'federated_then_personal'``, Sec. 4.1.2: "we conduct multiple federated
             training steps at first and then personalize the classifier"), or from
             the client's own head, which never leaves it ('local', the other reading)
    two random views of every example (data/augment.py ``two_views``)
    z = normalise(h(x; θ_i)), the encoder's output (Eq. 3; ``projection_dim`` = 0), or
        normalise(g(h(x; θ_i))) with SimCLR's projection g to ``projection_dim`` numbers
    θ_i, g_i ← E = ``client.local_epochs`` of SGD (``learning_rate`` 0.005) on L_sup
             (Eq. 4, SupCon, τ = 0.1) over the 2B views of each batch of
             ``client.batch_size`` (the config.client optimizer is not used: the paper
             gives the contrastive loss its own rate)
  server (Eq. 6): θ ← Σ_i |D_i|/N θ_i, and g (and the federated head) likewise
  personalised model: the global encoder with a head personalised on it ("then
    personalize the classifier for each client", Sec. 4.1.2): 'federated_then_personal'
    trains the server's head ``personal_epochs`` on the frozen final encoder's
    eval-mode features (the linear stage of SupCon, "a linear classifier on top of the
    fixed feature encoder"; its BatchNorm statistics are those the prediction uses);
    'local' fine-tunes the client's own head for ``head_epochs``
  test time (Eq. 7): adapters/fedicon.py

FedICON-us (Table 4): the same with every example its own class in Eq. 4, so a view's
only positive is the other view of the same example (SimCLR's NT-Xent); labels are then
used only by the head.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import ml_collections
import optax

from fedjax_shift import models
from fedjax_shift.algorithms import base
from fedjax_shift.algorithms.fedrep import body_only, train_part, with_head
from fedjax_shift.core.algorithm import ClientOutput, FederatedAlgorithm
from fedjax_shift.core.local import local_train, masked_mean
from fedjax_shift.data import augment
from fedjax_shift.registry import (NONNEGATIVE, NONNEGATIVE_INT, POSITIVE, POSITIVE_INT, one_of,
                                   registered, sequence_of)

from fedjax_shift.parts import trees
from fedjax_shift.parts.contrastive import MIN_BATCH, Projection, representation, supcon_loss


def contrastive_loss(module, projection: Optional[Projection], head, names, temperature: float,
                     supervised: bool):
  """core.local's LossFn: Eq. 4 over two views of a batch (encoder + projection)."""

  def loss_fn(params, model_state, x, y, weight, rng):
    views = augment.two_views(rng, x, names)
    variables = {'params': {**params, 'head': head}, **model_state}
    z, variables = representation(module, projection, variables, views, 'train')
    batch = x.shape[0]
    labels = y if supervised else jnp.arange(batch)
    loss = supcon_loss(z, jnp.concatenate([labels, labels]), jnp.concatenate([weight, weight]),
                       temperature)
    return loss, {k: v for k, v in variables.items() if k != 'params'}

  return loss_fn


HEAD_SHARING = ('federated_then_personal', 'local')


DEFAULTS = {
    'temperature': 0.1,               # Sec. 5.1: τ = 0.1 (Digit-5, Office-10, CIFAR-10)
    # 0: z is the encoder's output (Eq. 3, "the output of the feature encoder"; the ATP
    # CNN's is 64 wide, Sec. 5.1's "representation size 64"); > 0: a projection to it
    'projection_dim': 0,
    'learning_rate': 0.005,           # Sec. 5.1: SGD lr 0.005 for the contrastive loss
    'head_learning_rate': 0.01,       # Sec. 5.1: lr 0.01 for the CE (head) loss
    'weight_decay': 5e-4,             # Sec. 5.1: SGD weight decay 5e-4 (both)
    'head_epochs': 1,                 # epochs of head training per round ('local': and
                                      # to personalise)
    'head_sharing': 'federated_then_personal',   # HEAD_SHARING (Sec. 4.1.2)
    # The linear stage's epochs on the final encoder (not in the paper; SupCon trains
    # its linear classifier to convergence): 10 epochs of batch 32 are ~50 SGD steps on
    # a label-skew client's ~150 training digits.
    'personal_epochs': 10,
    # SimCLR's chain without the flip (digits): data/augment.py VIEW_AUGMENTATIONS.
    'augmentations': ('random_resized_crop', 'colour_jitter', 'grayscale', 'gaussian_blur'),
}
RANGES = {
    'temperature': POSITIVE,
    'projection_dim': NONNEGATIVE_INT,   # 0: no projection
    'learning_rate': POSITIVE,
    'head_learning_rate': POSITIVE,
    'weight_decay': NONNEGATIVE,
    'head_epochs': POSITIVE_INT,
    'head_sharing': one_of(*HEAD_SHARING),
    'personal_epochs': POSITIVE_INT,
    'augmentations': sequence_of(registered(augment.VIEW_AUGMENTATIONS)),   # (): two raw views
}


OBJECTIVES = ('supcon', 'simclr', 'ce')


def linear_head(module, optimizer: optax.GradientTransformation, schedule, variables, data,
                rng):
  """``variables`` with the head trained (``schedule``'s epochs) on the frozen encoder's
  eval-mode features."""
  params, model_state = base.split_variables(variables)
  frozen = {k: v for k, v in params.items() if k != 'head'}

  def loss_fn(head, state, x, y, weight, step_rng):
    del step_rng
    logits = models.apply(module, {'params': {**frozen, 'head': head}, **state}, x, 'eval')[0]
    return masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, y),
                       weight), state

  head, _, _, _ = local_train(loss_fn, optimizer, params['head'], model_state, data, rng,
                              schedule)
  return with_head(variables, head)


def fedicon_algorithm(hparams: ml_collections.ConfigDict, context: base.BuildContext,
                      objective: str = 'supcon', share: bool = True) -> FederatedAlgorithm:
  """FedICON (``objective='supcon'``), FedICON-us ('simclr': instance labels) and the
  Table 5 ablations: 'ce' trains the encoder by cross-entropy through the client's head
  instead of Eq. 4 (no local invariance extraction); ``share=False`` keeps every
  client's encoder and projection on the client, nothing is averaged (no global
  invariance sharing; the client state is then (head, own variables))."""
  if objective not in OBJECTIVES:
    raise ValueError(f'FedICON objective must be one of {OBJECTIVES}, got {objective!r}')
  if context.schedule.batch_size < MIN_BATCH:
    raise ValueError(f'config.client.batch_size={context.schedule.batch_size}: FedICON\'s '
                     f'contrastive loss needs at least {MIN_BATCH} examples per batch')
  module = context.module
  projection = Projection(hparams.projection_dim) if hparams.projection_dim else None
  names, temperature = tuple(hparams.augmentations), hparams.temperature
  sgd = lambda rate: optax.chain(optax.add_decayed_weights(hparams.weight_decay),
                                 optax.sgd(rate))
  head_context = context._replace(client_optimizer=sgd(hparams.head_learning_rate))
  body_optimizer = sgd(hparams.learning_rate if objective != 'ce'
                       else hparams.head_learning_rate)

  def init(rng, example_x):
    model_key, projection_key = jax.random.split(rng)
    variables = models.init(module, model_key, example_x)
    params = variables['params']
    if projection is not None:
      features = models.features(module, variables, example_x)
      params = {**params, 'projection': projection.init(projection_key, features)['params']}
    variables = {**variables, 'params': params}
    return base.ServerState(variables, context.server_optimizer.init(params), jnp.int32(0))

  def train_head(variables, data, rng):
    return train_part(head_context, variables, 'head', hparams.head_epochs, data, rng)

  def body_loss(head):
    if objective != 'ce':
      return contrastive_loss(module, projection, head, names, temperature,
                              supervised=objective == 'supcon')
    cross_entropy = base.cross_entropy_loss(module)
    return lambda body, *rest: cross_entropy({**body, 'head': head}, *rest)

  def train(start, data, rng):
    """Head epochs, then E epochs of the body (encoder + projection) on ``start``."""
    variables, _ = train_head(start, data, jax.random.fold_in(rng, 0))
    head = variables['params']['head']
    params, model_state = base.split_variables(variables)
    body = {k: v for k, v in params.items() if k != 'head'}
    body, model_state, _, metrics = local_train(body_loss(head), body_optimizer, body,
                                                model_state, data, jax.random.fold_in(rng, 1),
                                                context.schedule)
    return {'params': {**body, 'head': head}, **model_state}, metrics

  def shared_update(server_state, head, data, rng):
    variables, metrics = train(with_head(server_state.variables, head), data, rng)
    head = variables['params']['head']
    delta = trees.tree_sub(variables, with_head(server_state.variables, head))
    return ClientOutput(body_only(delta), metrics), head

  def shared_personalize(server_state, head, data, rng):
    return train_head(with_head(server_state.variables, head), data, rng)[0]

  def federated_update(server_state, client_state, data, rng):
    variables, metrics = train(server_state.variables, data, rng)
    delta = trees.tree_sub(variables, server_state.variables)
    return ClientOutput(base.send_only(delta, lambda path: True), metrics), client_state

  def federated_personalize(server_state, client_state, data, rng):
    del client_state
    return linear_head(module, head_context.client_optimizer,
                       base.epochs_schedule(context.schedule, hparams.personal_epochs),
                       server_state.variables, data, rng)

  def own_update(server_state, own_variables, data, rng):
    del server_state   # Table 5 without global invariance sharing: nothing is sent
    variables, metrics = train(own_variables, data, rng)
    return ClientOutput({}, metrics), variables

  def own_personalize(server_state, own_variables, data, rng):
    return train_head(own_variables, data, rng)[0]

  federated_head = share and hparams.head_sharing == 'federated_then_personal'
  if federated_head:
    client_update, personalize = federated_update, federated_personalize
    init_client_state = lambda server_state: ()
  elif share:
    client_update, personalize = shared_update, shared_personalize
    init_client_state = lambda server_state: server_state.variables['params']['head']
  else:
    client_update, personalize = own_update, own_personalize
    init_client_state = lambda server_state: server_state.variables
  return FederatedAlgorithm(
      init=init,
      init_client_state=init_client_state,
      client_update=client_update,
      server_update=base.partial_server_update(context.server_optimizer),
      personalize=personalize, global_model=None)


# name -> (objective, share): FedICON, FedICON-us (Table 4) and Table 5's variants
# without a component (the third, test-time adaptation, is the 'personalized' column next
# to 'personalized+fedicon' of every variant). The variants are registered as variants of
# 'fedicon': their sections are empty and follow config.fedicon.
VARIANTS = {
    'fedicon': ('supcon', True),
    'fedicon_us': ('simclr', True),              # Table 4: the encoder learns without labels
    'fedicon_no_sharing': ('supcon', False),     # no global invariance sharing
    'fedicon_ce': ('ce', True),                  # no local invariance extraction
    'fedicon_ce_no_sharing': ('ce', False),      # neither (Local with a personal head)
}


def _register(name: str, objective: str, share: bool) -> None:
  def builder(hparams: ml_collections.ConfigDict, context: base.BuildContext
              ) -> FederatedAlgorithm:
    return fedicon_algorithm(hparams, context, objective, share)
  builder.__name__ = builder.__qualname__ = name
  builder.__doc__ = f'FedICON variant {name!r}: objective {objective!r}, shared encoder {share}.'
  own = dict(defaults=DEFAULTS, ranges=RANGES) if name == 'fedicon' else dict(variant_of='fedicon')
  base.ALGORITHMS.register(name, **own)(builder)


for _name, (_objective, _share) in VARIANTS.items():
  _register(_name, _objective, _share)
