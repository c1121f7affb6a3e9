"""Local: every client trains its own model, nothing is communicated.

The standard lower baseline of personalised FL (e.g. Ditto, FedRep). Each client
keeps its model and optimizer state across rounds; a round trains the sampled
clients for their local epochs. There is no global model.
"""
from __future__ import annotations

import ml_collections

from fedjax_shift.algorithms import base
from fedjax_shift.core.algorithm import ClientOutput, FederatedAlgorithm
from fedjax_shift.core.local import local_train


@base.ALGORITHMS.register('local')
def local(hparams: ml_collections.ConfigDict, context: base.BuildContext) -> FederatedAlgorithm:
  module = context.module
  server_opt, client_opt = context.server_optimizer, context.client_optimizer
  loss_fn = base.cross_entropy_loss(module)

  def init_client_state(server_state):
    params = server_state.variables['params']
    return (server_state.variables, client_opt.init(params))

  def client_update(server_state, client_state, data, rng):
    variables, opt_state = client_state
    params, model_state = base.split_variables(variables)
    params, model_state, opt_state, metrics = local_train(
        loss_fn, client_opt, params, model_state, data, rng,
        context.schedule, opt_state)
    return ClientOutput((), metrics), ({'params': params, **model_state}, opt_state)

  def server_update(server_state, outputs, weights):
    del outputs, weights
    return server_state._replace(round=server_state.round + 1)

  return FederatedAlgorithm(
      init=base.init_server(module, server_opt),
      init_client_state=init_client_state,
      client_update=client_update,
      server_update=server_update,
      personalize=lambda server_state, client_state, data, rng: client_state[0],
      global_model=None)
