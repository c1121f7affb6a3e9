"""FedTHE: Test-Time Robust Personalization for Federated Learning (Jiang & Lin, ICLR
2023), training side; its test-time head ensemble is adapters/fedthe.py. The
benchmark FedICON compares on is FedTHE's (FedTHE's official code).

  client k, each round, from the received global model w:
    w_k ← local SGD of w (encoder + global head) on the balanced softmax loss,
          CE(logits + log(n_k + 1), y) with n_k the client's training label counts
          (``global_loss``; 'cross_entropy' for plain CE)
    h_k ← ``head_epochs`` of SGD (lr 0.01, weight decay 5e-4) on CE for the personal
          head on the frozen encoder of w (``personal_on='received'``; 'local': of
          w_k); it never leaves the client
    f_k ← the mean feature of its training data under that encoder
  server: w ← the weighted mean of w_k (FedAvg); f_G ← the uniform mean of the f_k
          (``feature_weighting``; 'num_examples' weights them by data size)

These defaults are the official code's (THE_worker, master.py, create_optimizer.py):
balanced softmax, the personal head and f_k from the received global model, a uniform
f_G, weight decay 5e-4 and a head without bias (``head_bias=False``: the personal
head's bias is zero and never trained; our model's global head keeps its bias).

The personalised model is the final global encoder with the client's personal head,
fine-tuned on it for ``head_epochs``, and carries (in the extra collection 'fedthe')
the global head, the client's mean feature f_k and f_G, which the adapter ensembles
and aligns with. Plain evaluation of it is the personal head; 'global' is FedAvg's
model.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax

from fedjax_shift import models
from fedjax_shift.algorithms import base
from fedjax_shift.algorithms.fedrep import train_part, with_head
from fedjax_shift.core.algorithm import ClientOutput, FederatedAlgorithm
from fedjax_shift.parts import trees
from fedjax_shift.registry import BOOL, NONNEGATIVE, POSITIVE, POSITIVE_INT, one_of

from fedjax_shift.parts.fedthe_extras import EXTRA  # the collection the adapter reads


class ServerState(NamedTuple):
  variables: dict          # global model {'params': {'encoder', 'head'}, ...}
  opt_state: optax.OptState
  round: jax.Array
  global_feature: jax.Array  # [F] f_G


class PersonalState(NamedTuple):
  head: dict               # the personal head {'kernel' [F, C], 'bias' [C]}
  feature: jax.Array       # [F] f_k


def mean_feature(module, variables, data) -> jax.Array:
  """[F]: the mean eval-mode feature over the client's real examples."""
  features = models.features(module, variables, data.x)
  weight = data.mask.astype(features.dtype)
  return jnp.sum(features * weight[:, None], 0) / jnp.maximum(jnp.sum(weight), 1.0)


def initial_head(global_head: dict, bias: bool) -> dict:
  """The personal head's start: the global head's initial values, the bias zeroed when
  the head has none."""
  return global_head if bias else {**global_head, 'bias': jnp.zeros_like(global_head['bias'])}


def personal_model(server_state: ServerState, state: PersonalState, head_variables) -> dict:
  """The personalised variables: ``head_variables`` (the global encoder with the
  personal head) plus the 'fedthe' collection {global_head, local_feature,
  global_feature}."""
  return {**head_variables, EXTRA: {'global_head': server_state.variables['params']['head'],
                                    'local_feature': state.feature,
                                    'global_feature': server_state.global_feature}}


GLOBAL_LOSSES = ('balanced_softmax', 'cross_entropy')
PERSONAL_ON = ('received', 'local')
FEATURE_WEIGHTINGS = ('uniform', 'num_examples')


def balanced_softmax_adjustment(data, num_classes: int) -> jax.Array:
  """[C] log(n_c + 1), n_c the client's count of label c (its real examples): the
  balanced softmax's shift of the logits (the official code's brm_loss)."""
  counts = jnp.sum(jax.nn.one_hot(data.y, num_classes) * data.mask[:, None], 0)
  return jnp.log(counts + 1.0)


def head_optimizer(hparams: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """The personal head's SGD with weight decay (PyTorch's order: g + λθ, then lr); with
  ``head_bias=False`` the bias is frozen (it starts at 0: a bias-free head)."""
  sgd = optax.chain(optax.add_decayed_weights(hparams.head_weight_decay),
                    optax.sgd(hparams.head_learning_rate))
  if hparams.head_bias:
    return sgd
  return optax.multi_transform({'train': sgd, 'frozen': optax.set_to_zero()},
                               lambda head: {name: 'frozen' if name == 'bias' else 'train'
                                             for name in head})


@base.ALGORITHMS.register('fedthe', defaults={
    'head_epochs': 1,                 # authors' code: n_personalized_epochs = 1
    'head_learning_rate': 0.01,       # authors' code: personal_lr = 0.01
    'head_weight_decay': 5e-4,        # authors' code: create_optimizer, weight_decay 5e-4
    'head_bias': False,               # authors' code: nn.Linear(rep_len, C, bias=False)
    'global_loss': 'balanced_softmax',  # authors' code: brm_loss (THE_worker)
    'personal_on': 'received',        # authors' code: head and f_k on the received model
    'feature_weighting': 'uniform',   # authors' code: master.py, f_G the plain mean
}, ranges={'head_epochs': POSITIVE_INT, 'head_learning_rate': POSITIVE,
           'head_weight_decay': NONNEGATIVE, 'head_bias': BOOL,
           'global_loss': one_of(*GLOBAL_LOSSES), 'personal_on': one_of(*PERSONAL_ON),
           'feature_weighting': one_of(*FEATURE_WEIGHTINGS)})
def fedthe(hparams: ml_collections.ConfigDict, context: base.BuildContext) -> FederatedAlgorithm:
  module = context.module
  head_context = context._replace(client_optimizer=head_optimizer(hparams))
  average = base.average_server_update(context.server_optimizer)

  def init(rng, example_x):
    state = base.init_server(module, context.server_optimizer)(rng, example_x)
    width = models.features(module, state.variables, example_x).shape[-1]
    return ServerState(*state, jnp.zeros((width,), jnp.float32))

  def personal_train(variables, head, data, rng):
    """The personal head trained on ``variables``' frozen encoder, and f_k."""
    trained, _ = train_part(head_context, with_head(variables, head), 'head',
                            hparams.head_epochs, data, rng)
    return trained, mean_feature(module, variables, data)

  def client_update(server_state, state: PersonalState, data, rng):
    adjustment = None
    if hparams.global_loss == 'balanced_softmax':
      num_classes = server_state.variables['params']['head']['kernel'].shape[-1]
      adjustment = balanced_softmax_adjustment(data, num_classes)
    variables, metrics = base.train_variables(context, server_state.variables, data,
                                              jax.random.fold_in(rng, 0),
                                              logit_adjustment=adjustment)
    personal_from = server_state.variables if hparams.personal_on == 'received' else variables
    trained, feature = personal_train(personal_from, state.head, data,
                                      jax.random.fold_in(rng, 1))
    update = {'model': trees.tree_sub(variables, server_state.variables), 'feature': feature}
    return (ClientOutput(update, metrics),
            PersonalState(trained['params']['head'], feature))

  def server_update(server_state: ServerState, outputs: ClientOutput, weights) -> ServerState:
    model = average(base.ServerState(*server_state[:3]),
                    outputs._replace(update=outputs.update['model']), weights)
    if hparams.feature_weighting == 'uniform':   # the plain mean over the cohort
      weights = (weights > 0).astype(weights.dtype) / jnp.maximum(jnp.sum(weights > 0), 1)
    feature = trees.weighted_sum(outputs.update['feature'], weights)
    feature = jnp.where(jnp.sum(weights) > 0, feature, server_state.global_feature)
    return ServerState(*model, feature)

  def personalize(server_state: ServerState, state: PersonalState, data, rng):
    trained, feature = personal_train(server_state.variables, state.head, data, rng)
    return personal_model(server_state, PersonalState(trained['params']['head'], feature),
                          trained)

  return FederatedAlgorithm(
      init=init,
      init_client_state=lambda server_state: PersonalState(
          initial_head(server_state.variables['params']['head'], hparams.head_bias),
          server_state.global_feature),
      client_update=client_update, server_update=server_update,
      personalize=personalize, global_model=lambda server_state: server_state.variables)

