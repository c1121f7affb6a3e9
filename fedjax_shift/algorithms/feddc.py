"""FedDC: Federated Learning with Non-IID Data via Local Drift Decoupling and Correction.

Gao et al., CVPR 2022, Algorithm 1 (a FedIns Table 1 baseline). Client i keeps a local
drift h_i and a gradient-correction state c_i (both 0 at the start); the server keeps
the broadcast model w, the mean correction c and the mean drift h̄ over all N clients.
A sampled client starts from θ = w and minimises

  F_i(θ) + (α/2)‖θ + h_i − w‖² + ⟨θ, c − c_i⟩                                 (Eq. 9)

for K steps (η the local learning rate), then with Δ = θ − w

  h_i ← h_i + Δ                                                            (Eq. 10)
  c_i⁺ = c_i − c − Δ / (K η)            (the authors' code: SCAFFOLD's option II)

and uploads θ, Δ and Δc = c_i⁺ − c_i. The server (round weights p, cohort S):

  w ← Σ p_i θ_i + h̄,   h̄ ← h̄ + (|S|/N) Σ p_i Δ_i,   c ← c + (|S|/N) Σ p_i Δc_i

(the drift-corrected aggregate as the authors' code computes it: the mean drift of every
client, which the server keeps as h̄ from the clients' drift increments, added to the
average of the returned models). α = 0.01 (FedIns Sec. 4.2). Where we differ: the code
scales α, c and Δc per client by n_i / mean(n); here every client counts the same in
them (the aggregation itself uses the round weights p). Only the parameters carry
drift; running statistics are averaged as in FedAvg.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax

from fedjax_shift.algorithms import base
from fedjax_shift.algorithms.fedprox import proximal_term
from fedjax_shift.algorithms.scaffold import add_to_gradient
from fedjax_shift.core.algorithm import ClientOutput, FederatedAlgorithm
from fedjax_shift.parts import trees
from fedjax_shift.registry import NONNEGATIVE

PyTree = Any


class FedDCState(NamedTuple):
  variables: PyTree   # w, the broadcast model {'params', ...}
  opt_state: PyTree   # server optimizer state over params
  round: jax.Array    # [] int32
  correction: PyTree  # c, shaped like params
  mean_drift: PyTree  # h̄, shaped like params


class FedDCClient(NamedTuple):
  drift: PyTree       # h_i
  correction: PyTree  # c_i


class FedDCUpdate(NamedTuple):
  model: PyTree       # Δ = θ − w (all collections)
  correction: PyTree  # Δc = c_i⁺ − c_i


@base.ALGORITHMS.register('feddc', defaults={'alpha': 0.01}, ranges={'alpha': NONNEGATIVE})
def feddc(hparams: ml_collections.ConfigDict, context: base.BuildContext) -> FederatedAlgorithm:
  module, server_opt = context.module, context.server_optimizer
  alpha, local_learning_rate = hparams.alpha, context.client_learning_rate

  def init(rng, example_x):
    state = base.init_server(module, server_opt)(rng, example_x)
    zeros = jax.tree.map(jnp.zeros_like, state.variables['params'])
    return FedDCState(state.variables, state.opt_state, state.round, zeros, zeros)

  def client_update(server_state, client, data, rng):
    w = server_state.variables['params']
    # ⟨θ, c − c_i⟩ enters as a constant added to every gradient (SCAFFOLD's correction).
    corrected = optax.chain(add_to_gradient(jax.tree.map(jnp.subtract, server_state.correction,
                                                         client.correction)),
                            context.client_optimizer)
    # (α/2)‖θ − (w − h_i)‖²: FedProx's proximal term around w − h_i.
    penalty = proximal_term(alpha)(jax.tree.map(jnp.subtract, w, client.drift))
    new_variables, metrics = base.train_variables(context._replace(client_optimizer=corrected),
                                                  server_state.variables, data, rng, penalty)
    delta = trees.tree_sub(new_variables, server_state.variables)
    ran = metrics['num_steps'] > 0
    steps = jnp.maximum(metrics['num_steps'], 1.0)
    drift = jax.tree.map(jnp.add, client.drift, delta['params'])
    correction = jax.tree.map(
        lambda ci, c, d: jnp.where(ran, ci - c - d / (steps * local_learning_rate), ci),
        client.correction, server_state.correction, delta['params'])
    update = FedDCUpdate(delta, trees.tree_sub(correction, client.correction))
    return ClientOutput(update, metrics), FedDCClient(drift, correction)

  average = base.average_server_update(server_opt)

  def server_update(state: FedDCState, outputs: ClientOutput, weights) -> FedDCState:
    fraction = context.cohort_fraction
    model = average(base.ServerState(state.variables, state.opt_state, state.round),
                    ClientOutput(outputs.update.model, outputs.metrics), weights)
    mean_drift = jax.tree.map(lambda h, d: h + fraction * d, state.mean_drift,
                              trees.weighted_sum(outputs.update.model['params'], weights))
    correction = jax.tree.map(lambda c, d: c + fraction * d, state.correction,
                              trees.weighted_sum(outputs.update.correction, weights))
    # The broadcast model: the aggregate Σ p θ_i plus the new h̄ (the authors' code adds
    # the mean drift every round, on top of a w that already held last round's).
    params = jax.tree.map(jnp.add, model.variables['params'], mean_drift)
    return FedDCState({**model.variables, 'params': params}, model.opt_state, model.round,
                      correction, mean_drift)

  return FederatedAlgorithm(
      init=init,
      init_client_state=lambda state: FedDCClient(
          jax.tree.map(jnp.zeros_like, state.correction),
          jax.tree.map(jnp.zeros_like, state.correction)),
      client_update=client_update, server_update=server_update, personalize=None,
      global_model=lambda state: state.variables)
