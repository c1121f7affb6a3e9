"""FedBN: Federated Learning on Non-IID Features via Local Batch Normalization.

Li et al., ICLR 2021, Algorithm 1: FedAvg in which every BatchNorm layer (affine
scale/bias and running statistics) stays local to its client; only the other
parameters are averaged. Each client evaluates with its own BN layers, so FedBN
reports personalised results only. ``local_norms='all'`` keeps every normalisation
layer local, LayerNorms included: FedBN on a ViT, which has no BatchNorm (FedIns
Table 1: FedBN sends 85.76 M of ViT-B/16's 85.80 M, all but its LayerNorms).
"""
from __future__ import annotations

import ml_collections
from flax import traverse_util

from fedjax_shift.algorithms import base
from fedjax_shift.models import is_batch_norm_path
from fedjax_shift.core.algorithm import ClientOutput, FederatedAlgorithm
from fedjax_shift.parts import trees
from fedjax_shift.registry import one_of

LOCAL_NORMS = ('batch_norm', 'all')


def is_layer_norm_path(path) -> bool:
  """A flattened path inside a LayerNorm (flax LayerNorm_<i>, the ViT's encoder_norm)."""
  return any('LayerNorm' in str(part) or str(part) == 'encoder_norm' for part in path)


def is_local(path, local_norms: str = 'batch_norm') -> bool:
  """BN scale/bias and every batch statistic stay on the client (and, with
  ``local_norms='all'``, LayerNorm scale/bias)."""
  return (path[0] == 'batch_stats' or is_batch_norm_path(path) or
          (local_norms == 'all' and is_layer_norm_path(path)))


def local_part(variables, local_norms: str = 'batch_norm'):
  """The client-local part: BN params and all batch statistics (a flat dict)."""
  flat = traverse_util.flatten_dict(variables)
  return {path: leaf for path, leaf in flat.items()
          if is_local(path, local_norms)}


def merge_local(variables, local):
  flat = traverse_util.flatten_dict(variables)
  flat.update(local)
  return traverse_util.unflatten_dict(flat)


@base.ALGORITHMS.register('fedbn', defaults={'local_norms': 'batch_norm'},
                          ranges={'local_norms': one_of(*LOCAL_NORMS)})
def fedbn(hparams: ml_collections.ConfigDict, context: base.BuildContext) -> FederatedAlgorithm:
  module, server_opt = context.module, context.server_optimizer
  norms = hparams.local_norms

  def client_update(server_state, client_local, data, rng):
    start = merge_local(server_state.variables, client_local)
    new_variables, metrics = base.train_variables(context, start, data, rng)
    # Only the shared (non-BN) part is uploaded and averaged.
    delta = base.send_only(trees.tree_sub(new_variables, start),
                           lambda p: not is_local(p, norms))
    return ClientOutput(delta, metrics), local_part(new_variables, norms)

  def personalize(server_state, client_local, data, rng):
    del data, rng
    return merge_local(server_state.variables, client_local)

  init_server = base.init_server(module, server_opt)

  def init(rng, example_x):
    server_state = init_server(rng, example_x)
    if not local_part(server_state.variables, norms):   # FedBN would be FedAvg
      kind = 'BatchNorm' if norms == 'batch_norm' else 'normalisation'
      raise ValueError(
          f"config.algorithms: fedbn keeps each client's {kind} layers local, and the model "
          f"({type(module.encoder).__name__ if hasattr(module, 'encoder') else type(module).__name__}"
          f") has none, so FedBN would train exactly as FedAvg: pick a model with "
          f"BatchNorm (config.model.name='bn_mlp', 'atp_cnn', 'resnet18', …)" +
          (" or fedbn.local_norms='all' for its LayerNorms" if norms == 'batch_norm' else ''))
    return server_state

  return FederatedAlgorithm(
      init=init,
      init_client_state=lambda server_state: local_part(server_state.variables, norms),
      client_update=client_update,
      server_update=base.partial_server_update(server_opt),
      personalize=personalize,
      global_model=None)
