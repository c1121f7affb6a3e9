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
from fedjax_shift.parts import trees
from fedjax_shift.registry import POSITIVE_INT


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


@base.ALGORITHMS.register('fedrep', defaults={'head_epochs': 10},  # head epochs (our default)
                          ranges={'head_epochs': POSITIVE_INT})
def fedrep(hparams: ml_collections.ConfigDict, context: base.BuildContext) -> FederatedAlgorithm:
  head_epochs, body_epochs = hparams.head_epochs, context.schedule.num_epochs

  def client_update(server_state, head, data, rng):
    variables = with_head(server_state.variables, head)
    variables, metrics = train_part(context, variables, 'head',
                                    head_epochs, data, jax.random.fold_in(rng, 0))
    head = variables['params']['head']
    if body_epochs:
      variables, metrics = train_part(context, variables, 'encoder',
                                      body_epochs, data, jax.random.fold_in(rng, 1))
    delta = trees.tree_sub(variables, with_head(server_state.variables, head))
    return ClientOutput(body_only(delta), metrics), head

  return personal_head_algorithm(context, client_update)


def body_only(delta):
  """The upload of a personal-head method: the representation (and BN statistics);
  the head stays on the client."""
  return base.send_only(delta, lambda path: path[:2] != ('params', 'head'))


def personal_head_algorithm(context: base.BuildContext, client_update) -> FederatedAlgorithm:
  """A method whose client state is its head and whose personalised model is the
  global body with that head (FedRep, FedPer); no global model."""
  return FederatedAlgorithm(
      init=base.init_server(context.module, context.server_optimizer),
      init_client_state=lambda server_state: server_state.variables['params']['head'],
      client_update=client_update,
      server_update=base.partial_server_update(context.server_optimizer),
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

  def client_update(server_state, head, data, rng):
    start = with_head(server_state.variables, head)
    variables, metrics = base.train_variables(context, start, data, rng)
    return (ClientOutput(body_only(trees.tree_sub(variables, start)), metrics),
            variables['params']['head'])

  return personal_head_algorithm(context, client_update)
