"""SCAFFOLD: Stochastic Controlled Averaging for Federated Learning.

Karimireddy et al., ICML 2020, Algorithm 1 (control variates, option II). The server
holds the model x and a control variate c; client i holds c_i (per-client state,
0 at the start). A sampled client starts from y = x and runs K local steps

  y ← y − η_l (g_i(y) − c_i + c)                                   (Alg. 1, line 10)
  c_i⁺ = c_i − c + (x − y) / (K η_l)                               (line 12, option II)

and sends (Δy, Δc) = (y − x, c_i⁺ − c_i). The server applies

  x ← x + η_g Σ_i w_i Δy_i,    c ← c + (|S|/N) Σ_i w_i Δc_i        (lines 16, 17)

with the round's weights w (config.weighting; uniform weights give the paper's
(1/|S|)Σ), |S| the cohort and N the training split's clients. The correction
(c − c_i) is added to each minibatch gradient before the client optimizer (SGD in the
paper), which so steps along g − c_i + c; the logged loss is the plain CE. K is the number of steps
the client ran (its epochs, straggler budget); η_l is ``config.client.learning_rate``;
η_g (``scaffold.global_learning_rate``) scales the mean Δy before ``config.server``'s
optimizer (SGD lr 1 by default). A client uploads Δy and Δc: twice FedAvg's numbers.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax

from fedjax_shift.algorithms import base
from fedjax_shift.core.algorithm import ClientOutput, FederatedAlgorithm
from fedjax_shift.parts import trees
from fedjax_shift.registry import POSITIVE

PyTree = Any


class ScaffoldState(NamedTuple):
  variables: PyTree   # the global model x {'params', ...}
  opt_state: PyTree   # server optimizer state over params
  round: jax.Array    # [] int32
  control: PyTree     # c, shaped like params


class ScaffoldUpdate(NamedTuple):
  model: PyTree       # Δy = y − x (all collections)
  control: PyTree     # Δc = c_i⁺ − c_i


def add_to_gradient(correction: PyTree) -> optax.GradientTransformation:
  """g ↦ g + correction (SCAFFOLD's c − c_i, fixed for the client's round)."""
  return optax.GradientTransformation(
      init=lambda params: optax.EmptyState(),
      update=lambda grads, state, params=None: (jax.tree.map(jnp.add, grads, correction), state))


@base.ALGORITHMS.register('scaffold', defaults={
    'global_learning_rate': 1.5},   # η_g (FedTTA App. table: η_l 0.1, η_g 1.5, every dataset)
    ranges={'global_learning_rate': POSITIVE})
def scaffold(hparams: ml_collections.ConfigDict, context: base.BuildContext
             ) -> FederatedAlgorithm:
  module, server_opt = context.module, context.server_optimizer
  local_learning_rate = context.client_learning_rate

  def init(rng, example_x):
    state = base.init_server(module, server_opt)(rng, example_x)
    control = jax.tree.map(jnp.zeros_like, state.variables['params'])
    return ScaffoldState(state.variables, state.opt_state, state.round, control)

  def client_update(server_state, client_control, data, rng):
    correction = jax.tree.map(jnp.subtract, server_state.control, client_control)  # c − c_i
    corrected = optax.chain(add_to_gradient(correction), context.client_optimizer)
    new_variables, metrics = base.train_variables(context._replace(client_optimizer=corrected),
                                                  server_state.variables, data, rng)
    delta = trees.tree_sub(new_variables, server_state.variables)
    steps = jnp.maximum(metrics['num_steps'], 1.0)
    # Option II; a client that ran no step keeps its c_i (Δc = 0).
    ran = metrics['num_steps'] > 0
    # K·η_l in the parameters' dtype: the step count comes as a float32 metric, and a
    # float64 run must not divide by its float32 rounding.
    new_control = jax.tree.map(
        lambda ci, c, d: jnp.where(ran, ci - c - d / (steps.astype(d.dtype) *
                                                      local_learning_rate), ci),
        client_control, server_state.control, delta['params'])
    update = ScaffoldUpdate(delta, trees.tree_sub(new_control, client_control))
    return ClientOutput(update, metrics), new_control

  average = base.average_server_update(server_opt, hparams.global_learning_rate)

  def server_update(state: ScaffoldState, outputs: ClientOutput, weights) -> ScaffoldState:
    model = average(base.ServerState(state.variables, state.opt_state, state.round),
                    ClientOutput(outputs.update.model, outputs.metrics), weights)
    control_delta = trees.weighted_sum(outputs.update.control, weights)
    control = jax.tree.map(lambda c, d: c + context.cohort_fraction * d, state.control,
                           control_delta)
    return ScaffoldState(*model, control)

  return FederatedAlgorithm(
      init=init,
      init_client_state=lambda server_state: jax.tree.map(jnp.zeros_like, server_state.control),
      client_update=client_update, server_update=server_update, personalize=None,
      global_model=lambda server_state: server_state.variables)
