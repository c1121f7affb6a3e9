"""FedTHE: Test-Time Robust Personalization for Federated Learning (Jiang & Lin, ICLR
2023), training side; its test-time head ensemble is adapters/fedthe.py. The
benchmark FedICON compares on is FedTHE's (FedTHE's official code).

  client k, each round:
    w_k ← local SGD of the global model (encoder + global head) on CE, as FedAvg
    h_k ← ``head_epochs`` of SGD (lr 0.01) on CE for the personal head on the frozen
          local encoder; it never leaves the client
    f_k ← the mean feature of its training data under that encoder
  server: w ← the weighted mean of w_k (FedAvg); f_G ← the weighted mean of f_k

The personalised model is the final global encoder with the client's personal head,
fine-tuned on it for ``head_epochs``, and carries (in the extra collection 'fedthe')
the global head, the client's mean feature f_k and f_G, which the adapter ensembles
and aligns with. Plain evaluation of it is the personal head; 'global' is FedAvg's
model. The authors' code trains the global model with a balanced loss (brm_loss);
we use plain CE. Its personal head has no bias; ours has one.
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
from fedjax_shift.registry import require

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


def personal_model(server_state: ServerState, state: PersonalState, head_variables) -> dict:
  """The personalised variables: ``head_variables`` (the global encoder with the
  personal head) plus the 'fedthe' collection {global_head, local_feature,
  global_feature}."""
  return {**head_variables, EXTRA: {'global_head': server_state.variables['params']['head'],
                                    'local_feature': state.feature,
                                    'global_feature': server_state.global_feature}}


def check(hparams: ml_collections.ConfigDict) -> None:
  require(hparams.head_epochs >= 1, 'fedthe.head_epochs',
          f'must be >= 1, got {hparams.head_epochs}')
  require(hparams.head_learning_rate > 0, 'fedthe.head_learning_rate',
          f'must be > 0, got {hparams.head_learning_rate}')


@base.ALGORITHMS.register('fedthe', defaults={
    'head_epochs': 1,                 # authors' code: n_personalized_epochs = 1
    'head_learning_rate': 0.01,       # authors' code: personal_lr = 0.01
}, check=check)
def fedthe(hparams: ml_collections.ConfigDict, context: base.BuildContext) -> FederatedAlgorithm:
  module = context.module
  head_context = context._replace(client_optimizer=optax.sgd(hparams.head_learning_rate))
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
    variables, metrics = base.train_variables(context, server_state.variables, data,
                                              jax.random.fold_in(rng, 0))
    trained, feature = personal_train(variables, state.head, data, jax.random.fold_in(rng, 1))
    update = {'model': base.tree_sub(variables, server_state.variables), 'feature': feature}
    return (ClientOutput(update, metrics),
            PersonalState(trained['params']['head'], feature))

  def server_update(server_state: ServerState, outputs: ClientOutput, weights) -> ServerState:
    model = average(base.ServerState(*server_state[:3]),
                    outputs._replace(update=outputs.update['model']), weights)
    feature = base.weighted_sum(outputs.update['feature'], weights)
    feature = jnp.where(jnp.sum(weights) > 0, feature, server_state.global_feature)
    return ServerState(*model, feature)

  def personalize(server_state: ServerState, state: PersonalState, data, rng):
    trained, feature = personal_train(server_state.variables, state.head, data, rng)
    return personal_model(server_state, PersonalState(trained['params']['head'], feature),
                          trained)

  return FederatedAlgorithm(
      init=init,
      init_client_state=lambda server_state: PersonalState(
          server_state.variables['params']['head'], server_state.global_feature),
      client_update=client_update, server_update=server_update,
      personalize=personalize, global_model=lambda server_state: server_state.variables)

