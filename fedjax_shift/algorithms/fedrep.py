"""FedRep: Exploiting Shared Representations for Personalized Federated Learning.
Collins et al., ICML 2021, Algorithm 1.

  client k:  h_k ← ``fedrep.head_epochs`` epochs of SGD on its head, encoder φ frozen
             φ_k ← ``client.local_epochs`` epochs of SGD on the encoder, head h_k frozen
  server:    φ ← mean of φ_k; heads never leave the clients

The head is the final linear layer (FedEvolve App. D). The personalised model is the
global encoder with the client's own head; there is no global model.
"""
from __future__ import annotations

import jax
import ml_collections

from fedjax_shift.algorithms import base
from fedjax_shift.core.algorithm import ClientOutput, FederatedAlgorithm
from fedjax_shift.core.local import local_train


def with_head(variables, head):
  return {**variables, 'params': {**variables['params'], 'head': head}}


def train_part(context: base.BuildContext, variables, part: str, epochs: int, data, rng):
  """Local SGD of ``variables['params'][part]`` ('head' or 'encoder') only."""
  params, model_state = base.split_variables(variables)
  frozen = {k: v for k, v in params.items() if k != part}
  ce = base.cross_entropy_loss(context.module)

  def loss_fn(trained, model_state, x, y, weight, step_rng):
    return ce({**frozen, part: trained}, model_state, x, y, weight, step_rng)

  trained, model_state, _, metrics = local_train(
      loss_fn, context.client_optimizer, params[part], model_state, data, rng,
      base.epochs_schedule(context.schedule, epochs))
  return {'params': {**frozen, part: trained}, **model_state}, metrics


@base.ALGORITHMS.register('fedrep', defaults={'head_epochs': 10})  # head epochs (our default)
def fedrep(hparams: ml_collections.ConfigDict, context: base.BuildContext) -> FederatedAlgorithm:
  head_epochs, body_epochs = hparams.head_epochs, context.schedule.num_epochs
  module, server_opt = context.module, context.server_optimizer

  def client_update(server_state, head, data, rng):
    variables = with_head(server_state.variables, head)
    variables, metrics = train_part(context, variables, 'head',
                                    head_epochs, data, jax.random.fold_in(rng, 0))
    head = variables['params']['head']
    if body_epochs:
      variables, metrics = train_part(context, variables, 'encoder',
                                      body_epochs, data, jax.random.fold_in(rng, 1))
    # Only the representation (and BN statistics) is uploaded; heads stay on the client.
    delta = base.send_only(base.tree_sub(variables, with_head(server_state.variables, head)),
                           lambda path: path[:2] != ('params', 'head'))
    return ClientOutput(delta, metrics), head

  return FederatedAlgorithm(
      init=base.init_server(module, server_opt),
      init_client_state=lambda server_state: server_state.variables['params']['head'],
      client_update=client_update, server_update=base.partial_server_update(server_opt),
      personalize=lambda server_state, head, data, rng: with_head(server_state.variables, head),
      global_model=None)


@base.ALGORITHMS.register('fedper')
def fedper(hparams: ml_collections.ConfigDict, context: base.BuildContext) -> FederatedAlgorithm:
  """FedPer (Arivazhagan et al. 2019): each client trains its whole model (the global
  encoder with its own head) for ``client.local_epochs``; only the encoder is uploaded
  and averaged, the head stays on the client. FedTTA's PFL-Sampled / PFL-Ensemble
  baselines are FedPer's personalised models given to new clients (the federated
  pipeline's 'pfl_sampled' and 'pfl_ensemble' columns)."""
  del hparams
  module, server_opt = context.module, context.server_optimizer

  def client_update(server_state, head, data, rng):
    start = with_head(server_state.variables, head)
    variables, metrics = base.train_variables(context, start, data, rng)
    delta = base.send_only(base.tree_sub(variables, start),
                           lambda path: path[:2] != ('params', 'head'))
    return ClientOutput(delta, metrics), variables['params']['head']

  return FederatedAlgorithm(
      init=base.init_server(module, server_opt),
      init_client_state=lambda server_state: server_state.variables['params']['head'],
      client_update=client_update, server_update=base.partial_server_update(server_opt),
      personalize=lambda server_state, head, data, rng: with_head(server_state.variables, head),
      global_model=None)
