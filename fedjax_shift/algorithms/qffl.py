"""q-FFL: Fair Resource Allocation in Federated Learning. Li et al., ICLR 2020,
Algorithm 2 (q-FedAvg), the fair pretraining of ATP Table 7 (q = 1).

  client k:  F_k = loss of w^t on its data;  w̄_k ← local SGD from w^t
             Δw_k = L·(w^t − w̄_k),  L = 1/η (the local step's Lipschitz estimate)
             Δ_k  = F_k^q · Δw_k
             h_k  = q·F_k^(q−1)·‖Δw_k‖² + L·F_k^q
  server:    w^{t+1} = w^t − Σ_k Δ_k / Σ_k h_k

q = 0 is FedAvg with uniform weights and server step L·η = 1. BatchNorm running
statistics are averaged like FedAvg's. The sums run over the round's weights
(uniform sampling, empty clients weight 0).
"""
from __future__ import annotations

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


def client_loss(module, variables, data) -> jax.Array:
  """F_k(w^t): masked mean CE of the broadcast model over the client's examples."""
  logits, _ = models.apply(module, variables, data.x, 'eval')
  return masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, data.y),
                     data.mask.astype(jnp.float32))


@base.ALGORITHMS.register('qffl', defaults={'q': 1.0},  # q (ATP Table 7: q = 1)
                          ranges={'q': NONNEGATIVE}, pretrains=True)   # 0: FedAvg
def qffl(hparams: ml_collections.ConfigDict, context: base.BuildContext) -> FederatedAlgorithm:
  q = float(hparams.q)
  lipschitz = 1.0 / context.client_learning_rate
  module, server_opt = context.module, context.server_optimizer

  def client_update(server_state, client_state, data, rng):
    variables = server_state.variables
    loss = client_loss(module, variables, data) + 1e-10
    new_variables, metrics = base.train_variables(context, variables, data, rng)
    params, rest = base.split_variables(variables)
    new_params, new_rest = base.split_variables(new_variables)
    delta_w = jax.tree.map(lambda w, w_k: lipschitz * (w - w_k), params, new_params)
    sq_norm = sum(jnp.sum(d ** 2) for d in jax.tree.leaves(delta_w))
    update = {'delta': jax.tree.map(lambda d: loss ** q * d, delta_w),
              'h': q * loss ** (q - 1) * sq_norm + lipschitz * loss ** q,
              'rest': trees.tree_sub(new_rest, rest)}
    return ClientOutput(update, metrics), client_state

  def server_update(state: base.ServerState, outputs: ClientOutput, weights):
    sums = trees.weighted_sum(outputs.update, weights)
    params, rest = base.split_variables(state.variables)
    step = jax.tree.map(lambda d: d / jnp.maximum(sums['h'], 1e-12), sums['delta'])
    updates, opt_state = server_opt.update(step, state.opt_state, params)
    params = optax.apply_updates(params, updates)
    rest = jax.tree.map(jnp.add, rest, sums['rest'])
    return base.ServerState({'params': params, **rest}, opt_state, state.round + 1)

  return FederatedAlgorithm(
      init=base.init_server(module, server_opt),
      init_client_state=lambda server_state: (),
      client_update=client_update, server_update=server_update,
      personalize=None, global_model=lambda server_state: server_state.variables)
