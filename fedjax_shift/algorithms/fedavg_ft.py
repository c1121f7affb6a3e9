"""FedAvg-FT: FedAvg, then local fine-tuning for personalisation.

Training is FedAvg (McMahan et al. 2017); at evaluation each client fine-tunes the
global model on its own training split for ``fedavg_ft.epochs`` epochs with the
client optimizer (the "FedAvg-FT" baseline of FedEvolve/FedTHE/Ditto).
"""
from __future__ import annotations

import ml_collections

from fedjax_shift.algorithms import base
from fedjax_shift.algorithms.fedavg import fedavg
from fedjax_shift.core.algorithm import FederatedAlgorithm
from fedjax_shift.registry import POSITIVE_INT


@base.ALGORITHMS.register('fedavg_ft', defaults={'epochs': 1},  # FedEvolve App. D: 1 epoch
                          ranges={'epochs': POSITIVE_INT})
def fedavg_ft(hparams: ml_collections.ConfigDict, context: base.BuildContext
              ) -> FederatedAlgorithm:
  finetune = base.epochs_schedule(context.schedule, hparams.epochs)

  def personalize(server_state, client_state, data, rng):
    del client_state
    variables, _ = base.train_variables(context, server_state.variables, data, rng,
                                        schedule=finetune)
    return variables

  return fedavg(ml_collections.ConfigDict(), context)._replace(personalize=personalize)
