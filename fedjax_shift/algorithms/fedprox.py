"""FedProx: Federated Optimization in Heterogeneous Networks.

Li et al., MLSys 2020, Algorithm 2: FedAvg whose local objective adds the proximal
term  (μ/2)·‖w − w^t‖²  towards the broadcast model w^t. μ = 0 is FedAvg.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections

from fedjax_shift.algorithms import base
from fedjax_shift.algorithms.fedavg import fedavg
from fedjax_shift.core.algorithm import FederatedAlgorithm
from fedjax_shift.registry import NONNEGATIVE


def proximal_term(mu: float):
  """global params -> (params -> (μ/2)·‖params − global‖²)."""

  def bind(global_params):
    def penalty(params):
      sq = jax.tree.map(lambda p, g: jnp.sum((p - g) ** 2), params, global_params)
      return 0.5 * mu * sum(jax.tree_util.tree_leaves(sq))
    return penalty

  return bind


@base.ALGORITHMS.register('fedprox', defaults={'mu': 0.01},  # μ (ATP Table 7: 0.01)
                          ranges={'mu': NONNEGATIVE}, pretrains=True)   # 0: FedAvg
def fedprox(hparams: ml_collections.ConfigDict, context: base.BuildContext
            ) -> FederatedAlgorithm:
  return fedavg(hparams, context, extra_loss_fn=proximal_term(hparams.mu))
