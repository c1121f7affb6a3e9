"""FedAvg: Communication-Efficient Learning of Deep Networks from Decentralized Data.

McMahan et al., AISTATS 2017, Algorithm 1. With a non-trivial server optimizer this
is FedOpt (Reddi et al., ICLR 2021, Algorithm 2): FedAvgM, FedAdam.

  client k:  w_k ← w − η ∇ℓ(w; b)   for E epochs of batches b of size B
  server:    w ← ServerOpt(w, −Σ_k p_k (w_k − w)),   p_k ∝ n_k
"""
from __future__ import annotations

import ml_collections

from fedjax_shift.algorithms import base
from fedjax_shift.core.algorithm import ClientOutput, FederatedAlgorithm
from fedjax_shift.parts import trees


@base.ALGORITHMS.register('fedavg', pretrains=True)
def fedavg(hparams: ml_collections.ConfigDict, context: base.BuildContext,
           extra_loss_fn=None) -> FederatedAlgorithm:
  """FedAvg (no hyperparameters of its own). ``extra_loss_fn(global_params)`` ->
  (params -> penalty) adds a local regulariser that may depend on the broadcast
  model (FedProx)."""
  del hparams
  module, server_opt = context.module, context.server_optimizer

  def client_update(server_state, client_state, data, rng):
    variables = server_state.variables
    extra = extra_loss_fn(variables['params']) if extra_loss_fn else None
    new_variables, metrics = base.train_variables(context, variables, data, rng, extra)
    return ClientOutput(trees.tree_sub(new_variables, variables), metrics), client_state

  return FederatedAlgorithm(
      init=base.init_server(module, server_opt),
      init_client_state=lambda server_state: (),
      client_update=client_update,
      server_update=base.average_server_update(server_opt),
      personalize=None,
      global_model=lambda server_state: server_state.variables)
