"""FedBN: Federated Learning on Non-IID Features via Local Batch Normalization.

Li et al., ICLR 2021, Algorithm 1: FedAvg in which every BatchNorm layer (affine
scale/bias and running statistics) stays local to its client; only the other
parameters are averaged. Each client evaluates with its own BN layers, so FedBN
reports personalised results only.
"""
from __future__ import annotations

import ml_collections
from flax import traverse_util

from fedjax_shift.algorithms import base
from fedjax_shift.models import is_batch_norm_path
from fedjax_shift.core.algorithm import ClientOutput, FederatedAlgorithm


def is_local(path) -> bool:
  """BN scale/bias and every batch statistic stay on the client."""
  return path[0] == 'batch_stats' or is_batch_norm_path(path)


def local_part(variables):
  """The client-local part: BN params and all batch statistics (a flat dict)."""
  flat = traverse_util.flatten_dict(variables)
  return {path: leaf for path, leaf in flat.items()
          if is_local(path)}


def merge_local(variables, local):
  flat = traverse_util.flatten_dict(variables)
  flat.update(local)
  return traverse_util.unflatten_dict(flat)


@base.ALGORITHMS.register('fedbn')
def fedbn(hparams: ml_collections.ConfigDict, context: base.BuildContext) -> FederatedAlgorithm:
  module, server_opt = context.module, context.server_optimizer

  def client_update(server_state, client_local, data, rng):
    start = merge_local(server_state.variables, client_local)
    new_variables, metrics = base.train_variables(context, start, data, rng)
    # Only the shared (non-BN) part is uploaded and averaged.
    delta = base.send_only(base.tree_sub(new_variables, start), lambda p: not is_local(p))
    return ClientOutput(delta, metrics), local_part(new_variables)

  def personalize(server_state, client_local, data, rng):
    del data, rng
    return merge_local(server_state.variables, client_local)

  return FederatedAlgorithm(
      init=base.init_server(module, server_opt),
      init_client_state=lambda server_state: local_part(server_state.variables),
      client_update=client_update,
      server_update=base.partial_server_update(server_opt),
      personalize=personalize,
      global_model=None)
