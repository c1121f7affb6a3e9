"""APFL: Adaptive Personalized Federated Learning. Deng et al., 2020, Algorithm 1
(fixed mixing weight).

Each local step on a batch:
  w ← w − η ∇F_k(w)                                  (the global model, FedAvg)
  v ← v − η ∇_v F_k(α·v + (1 − α)·w)                 (the personal model)
The personalised model is v̄ = α·v_k + (1 − α)·w; v_k persists in the client
state. α = ``apfl.alpha``; α = 0 is FedAvg (v̄ = w). Mixing covers the parameters;
BatchNorm statistics come from the global branch.
"""
from __future__ import annotations

import jax
import ml_collections
import optax

from fedjax_shift import models
from fedjax_shift.algorithms import base
from fedjax_shift.core.algorithm import ClientOutput, FederatedAlgorithm
from fedjax_shift.core.local import local_train, masked_mean
from fedjax_shift.parts import trees
from fedjax_shift.registry import FRACTION


def mix(alpha: float, personal, global_params):
  return jax.tree.map(lambda v, w: alpha * v + (1.0 - alpha) * w, personal, global_params)


@base.ALGORITHMS.register('apfl', defaults={'alpha': 0.5},  # fixed mixing α (our default)
                          ranges={'alpha': FRACTION})
def apfl(hparams: ml_collections.ConfigDict, context: base.BuildContext) -> FederatedAlgorithm:
  alpha = hparams.alpha
  module = context.module
  server_opt, client_opt, schedule = (context.server_optimizer, context.client_optimizer,
                                      context.schedule)

  def loss_fn(both, model_state, x, y, weight, rng):
    del rng
    ce = lambda logits: masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, y),
                                    weight)
    logits, variables = models.apply(module, {'params': both['w'], **model_state}, x, 'train')
    mixed = mix(alpha, both['v'], jax.lax.stop_gradient(both['w']))
    mixed_logits, _ = models.apply(module, {'params': mixed, **model_state}, x, 'train')
    new_state = {k: v for k, v in variables.items() if k != 'params'}
    return ce(logits) + ce(mixed_logits), new_state

  def client_update(server_state, personal, data, rng):
    params, model_state = base.split_variables(server_state.variables)
    both, model_state, _, metrics = local_train(loss_fn, client_opt,
                                                {'w': params, 'v': personal}, model_state,
                                                data, rng, schedule)
    delta = trees.tree_sub({'params': both['w'], **model_state}, server_state.variables)
    return ClientOutput(delta, metrics), both['v']

  def personalize(server_state, personal, data, rng):
    params, model_state = base.split_variables(server_state.variables)
    return {'params': mix(alpha, personal, params), **model_state}

  return FederatedAlgorithm(
      init=base.init_server(module, server_opt),
      init_client_state=lambda server_state: server_state.variables['params'],
      client_update=client_update, server_update=base.average_server_update(server_opt),
      personalize=personalize, global_model=lambda server_state: server_state.variables)
