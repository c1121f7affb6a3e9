"""GMA: Gradient Masked Averaging for Federated Learning. Tenison et al., 2022,
Algorithm 1.

Clients train as in FedAvg. The server measures, per parameter, the agreement of the
cohort's update signs, A = |Σ_k sign(Δ_k)| / C, and masks the averaged update:
m = 1 where A ≥ τ, m = A elsewhere; w ← ServerOpt(w, −η_g · m ⊙ Σ_k p_k Δ_k). τ = 0.1
(FedEvolve App. D); η_g (``global_learning_rate``) 1 unless a paper sets it (the FedTTA
paper's Table 4: 1.5 on Fashion-MNIST). BatchNorm statistics are averaged unmasked.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax

from fedjax_shift.algorithms import base
from fedjax_shift.algorithms.fedavg import fedavg
from fedjax_shift.core.algorithm import ClientOutput, FederatedAlgorithm
from fedjax_shift.parts import trees
from fedjax_shift.registry import FRACTION, POSITIVE


def agreement_mask(stacked_deltas, weights, threshold: float):
  """Per-parameter mask from the sign agreement of the clients with weight > 0."""
  included = (weights > 0).astype(jnp.float32)
  count = jnp.maximum(jnp.sum(included), 1.0)

  def mask(leaf):
    agreement = jnp.abs(jnp.tensordot(included, jnp.sign(leaf), axes=1)) / count
    return jnp.where(agreement >= threshold, 1.0, agreement)

  return jax.tree.map(mask, stacked_deltas)


@base.ALGORITHMS.register('gma', defaults={'threshold': 0.1,   # τ (FedEvolve App. D: 0.1)
                                           'global_learning_rate': 1.0},   # η_g
                          ranges={'threshold': FRACTION, 'global_learning_rate': POSITIVE})
def gma(hparams: ml_collections.ConfigDict, context: base.BuildContext) -> FederatedAlgorithm:
  threshold = hparams.threshold
  server_opt = context.server_optimizer

  def server_update(state: base.ServerState, outputs: ClientOutput, weights):
    mean_delta = trees.weighted_sum(outputs.update, weights)
    params, rest = base.split_variables(state.variables)
    delta_params, delta_rest = base.split_variables(mean_delta)
    stacked_params, _ = base.split_variables(outputs.update)
    masked = jax.tree.map(lambda d, m: hparams.global_learning_rate * d * m, delta_params,
                          agreement_mask(stacked_params, weights, threshold))
    updates, opt_state = server_opt.update(jax.tree.map(jnp.negative, masked), state.opt_state,
                                           params)
    params = optax.apply_updates(params, updates)
    rest = jax.tree.map(jnp.add, rest, delta_rest)
    return base.ServerState({'params': params, **rest}, opt_state, state.round + 1)

  return fedavg(ml_collections.ConfigDict(), context)._replace(server_update=server_update)
