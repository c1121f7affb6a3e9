"""FedAvg-FT: FedAvg, then local fine-tuning for personalisation.

Training is FedAvg (McMahan et al. 2017); at evaluation each client fine-tunes the
global model on its own training split for ``finetune.epochs`` epochs with the
client optimizer (the "FedAvg-FT" baseline of FedEvolve/FedTHE/Ditto).
"""
from __future__ import annotations

import ml_collections

from fedjax_shift.algorithms import base
from fedjax_shift.algorithms.fedavg import fedavg
from fedjax_shift.core.algorithm import FederatedAlgorithm


def fedavg_ft(config: ml_collections.ConfigDict, module, max_examples: int) -> FederatedAlgorithm:
  finetune_config = config.copy_and_resolve_references()
  finetune_config.client.local_epochs = config.finetune.epochs
  finetune_config.client.local_steps = 0

  def personalize(server_state, client_state, data, rng):
    del client_state
    variables, _ = base.train_variables(module, finetune_config, max_examples,
                                        server_state.variables, data, rng)
    return variables

  return fedavg(config, module, max_examples)._replace(personalize=personalize)
