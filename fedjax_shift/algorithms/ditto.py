"""Ditto: Fair and Robust Federated Learning Through Personalization. Li et al.,
ICML 2021, Algorithm 1.

  global:    w is trained by FedAvg (the client's local SGD, averaged by the server)
  personal:  v_k ← v_k − η ∇[ F_k(v_k) + (λ/2)·‖v_k − w^t‖² ]   for the local epochs

v_k (and its optimizer state) persists in the client state; the personalised model
is v_k. λ = 0.1 (FedEvolve App. D); λ = 0 is local training.
"""
from __future__ import annotations

import jax
import ml_collections

from fedjax_shift.algorithms import base
from fedjax_shift.algorithms.fedavg import fedavg
from fedjax_shift.algorithms.fedprox import proximal_term
from fedjax_shift.core.algorithm import FederatedAlgorithm
from fedjax_shift.core.local import local_train
from fedjax_shift.registry import NONNEGATIVE


@base.ALGORITHMS.register('ditto', defaults={'lam': 0.1},  # λ (FedEvolve App. D: 0.1)
                          ranges={'lam': NONNEGATIVE})   # 0: local training
def ditto(hparams: ml_collections.ConfigDict, context: base.BuildContext) -> FederatedAlgorithm:
  lam = hparams.lam
  module = context.module
  global_part = fedavg(ml_collections.ConfigDict(), context)
  client_opt, schedule = context.client_optimizer, context.schedule

  def init_client_state(server_state):
    return server_state.variables, client_opt.init(server_state.variables['params'])

  def personal_update(server_state, client_state, data, rng):
    """One round of the personal objective; also Local's update when λ = 0."""
    variables, opt_state = client_state
    params, model_state = base.split_variables(variables)
    loss_fn = base.cross_entropy_loss(
        module, proximal_term(lam)(server_state.variables['params']) if base.present(lam)
        else None)
    params, model_state, opt_state, _ = local_train(loss_fn, client_opt, params, model_state,
                                                    data, rng, schedule, opt_state)
    return {'params': params, **model_state}, opt_state

  def client_update(server_state, client_state, data, rng):
    output, _ = global_part.client_update(server_state, (), data, jax.random.fold_in(rng, 0))
    return output, personal_update(server_state, client_state, data, jax.random.fold_in(rng, 1))

  return global_part._replace(
      init_client_state=init_client_state, client_update=client_update,
      personalize=lambda server_state, client_state, data, rng: client_state[0])
