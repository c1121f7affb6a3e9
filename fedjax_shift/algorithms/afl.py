"""AFL: Agnostic Federated Learning. Mohri et al., ICML 2019, Sec. 4 (stochastic
mirror / projected gradient descent-ascent on min_w max_{λ∈Δ} Σ_k λ_k L_k(w)), in the
federated form FedTTA compares against (Ye et al., UPFL 2023 App. B: γ_w, γ_λ).

Every round, with λ on the simplex Δ over the N training clients:

  client k:  L_k = its mean loss under the broadcast w; local SGD from w → w_k
  server:    w ← w + Σ_k λ_k (w_k − w) / Σ_k λ_k             (descent in w, λ-weighted)
             λ ← Π_Δ(λ + γ_λ L)                                (ascent in λ, Euclidean
                                                                 projection on Δ)

λ_k lives on client k as its state: the client sends λ_k with its update and the
ascent proposal μ_k = λ_k + γ_λ L_k; the server finds the projection's threshold τ
(Π_Δ(μ)_k = max(μ_k − τ, 0), Duchi et al. 2008) from the proposals and broadcasts it,
and client k applies λ_k = max(μ_k − τ, 0) at its next round. This is the exact
projection only when every client takes part in every round (FedTTA: "all clients
participate"), so AFL requires ``cohort_size`` = the training split's clients. λ
replaces ``config.weighting`` in the average; γ_w is ``config.client.learning_rate``.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax

from fedjax_shift import models
from fedjax_shift.algorithms import base
from fedjax_shift.core.algorithm import ClientOutput, FederatedAlgorithm
from fedjax_shift.core.local import masked_mean
from fedjax_shift.parts import trees
from fedjax_shift.registry import NONNEGATIVE

PyTree = Any


class AFLState(NamedTuple):
  variables: PyTree     # the global model w
  opt_state: PyTree     # server optimizer state over params
  round: jax.Array      # [] int32
  threshold: jax.Array  # [] τ of the last projection: λ_k = max(μ_k − τ, 0)


class AFLUpdate(NamedTuple):
  model: PyTree         # w_k − w
  weight: jax.Array     # [] λ_k used this round
  proposal: jax.Array   # [] μ_k = λ_k + γ_λ L_k


def simplex_threshold(values: jax.Array) -> jax.Array:
  """τ with Σ_k max(values_k − τ, 0) = 1: the Euclidean projection of values [K] on the
  probability simplex is max(values − τ, 0) (Duchi et al. 2008, Fig. 1). Entries of
  −∞ are left out (they project to 0)."""
  ordered = jnp.sort(values)[::-1]
  finite = jnp.isfinite(ordered)   # −∞ entries (clients without data) stay off the support
  cumulative = jnp.cumsum(jnp.where(finite, ordered, 0.0))
  ranks = jnp.arange(1, values.shape[0] + 1)
  support = jnp.sum(finite & (ordered - (cumulative - 1.0) / ranks > 0))
  return (cumulative[support - 1] - 1.0) / support


@base.ALGORITHMS.register('afl', defaults={
    'lambda_learning_rate': 0.001},   # γ_λ (FedTTA App. table, MNIST; γ_w = 0.3 there)
    ranges={'lambda_learning_rate': NONNEGATIVE})   # 0: λ stays uniform
def afl(hparams: ml_collections.ConfigDict, context: base.BuildContext) -> FederatedAlgorithm:
  module, server_opt = context.module, context.server_optimizer
  if context.num_clients < 1 or context.cohort_fraction < 1.0:
    raise ValueError(
        'config.cohort_size: AFL projects λ over every training client each round, so '
        f'every client must take part (cohort_fraction {context.cohort_fraction:.3f}, '
        f'{context.num_clients} clients); set cohort_size to the training clients')
  num_clients = context.num_clients
  average = base.average_server_update(server_opt)

  def init(rng, example_x):
    state = base.init_server(module, server_opt)(rng, example_x)
    # μ_k = 0 at the start and τ = −1/N give λ_k = 1/N.
    return AFLState(state.variables, state.opt_state, state.round,
                    jnp.float32(-1.0 / num_clients))

  def client_update(server_state, proposal, data, rng):
    weight = jnp.maximum(proposal - server_state.threshold, 0.0)
    logits = models.apply(module, server_state.variables, data.x, 'eval')[0]
    loss = masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, data.y),
                       data.mask.astype(jnp.float32))
    new_variables, metrics = base.train_variables(context, server_state.variables, data, rng)
    # A client without examples (padding) leaves the simplex: μ = −∞ gives it λ = 0.
    new_proposal = jnp.where(data.num_examples > 0,
                             weight + hparams.lambda_learning_rate * loss, -jnp.inf)
    update = AFLUpdate(trees.tree_sub(new_variables, server_state.variables), weight,
                       new_proposal)
    return ClientOutput(update, {**metrics, 'start_loss': loss}), new_proposal

  def server_update(state: AFLState, outputs: ClientOutput, weights) -> AFLState:
    # λ weighs the clients instead of config.weighting; clients without data (weight
    # 0) send no update and take no part.
    lam = jnp.where(weights > 0, outputs.update.weight, 0.0)
    mixture = lam / jnp.maximum(jnp.sum(lam), 1e-12)
    model = average(base.ServerState(state.variables, state.opt_state, state.round),
                    ClientOutput(outputs.update.model, outputs.metrics), mixture)
    return AFLState(*model, simplex_threshold(outputs.update.proposal))

  return FederatedAlgorithm(
      init=init, init_client_state=lambda server_state: jnp.float32(0.0),
      client_update=client_update, server_update=server_update, personalize=None,
      global_model=lambda server_state: server_state.variables)
