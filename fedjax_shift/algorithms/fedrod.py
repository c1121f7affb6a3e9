"""FedRoD: On Bridging Generic and Personalized Federated Learning for Image
Classification. Chen & Chao, ICLR 2022, Sec. 4 (linear personalised head).

  generic:   encoder φ and generic head g trained with the balanced-softmax loss
             BSM = CE(g(z) + log π_k, y), π_k the client's label distribution
  personal:  head p_k trained with CE(g(z) + p_k(z), y), z and g detached
  server:    (φ, g) ← FedAvg average; p_k stays on the client

The personalised prediction g(z) + p_k(z) is one linear head with kernel and bias
summed; the global model is (φ, g).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax

from fedjax_shift import models
from fedjax_shift.algorithms import base
from fedjax_shift.core.algorithm import ClientOutput, FederatedAlgorithm
from fedjax_shift.core.local import local_train, masked_mean
from fedjax_shift.parts import trees


def label_log_prior(data, num_classes: int) -> jax.Array:
  counts = jnp.sum(jax.nn.one_hot(data.y, num_classes) * data.mask[:, None], 0)
  return jnp.log((counts + 1e-3) / jnp.maximum(jnp.sum(counts), 1e-12))


@base.ALGORITHMS.register('fedrod')
def fedrod(hparams: ml_collections.ConfigDict, context: base.BuildContext) -> FederatedAlgorithm:
  module = context.module
  server_opt, client_opt, schedule = (context.server_optimizer, context.client_optimizer,
                                      context.schedule)
  num_classes = module.num_classes

  def client_update(server_state, personal_head, data, rng):
    log_prior = label_log_prior(data, num_classes)
    params, model_state = base.split_variables(server_state.variables)

    def loss_fn(both, model_state, x, y, weight, step_rng):
      del step_rng
      ce = lambda logits: masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, y),
                                      weight)
      features, variables = models.train_features(
          module, {'params': both['generic'], **model_state}, x)
      new_state = {k: v for k, v in variables.items() if k != 'params'}
      generic = models.head({'params': both['generic']}, features)
      personal = jax.lax.stop_gradient(generic) + models.head(
          {'params': {'head': both['personal']}}, jax.lax.stop_gradient(features))
      return ce(generic + log_prior) + ce(personal), new_state

    both, model_state, _, metrics = local_train(
        loss_fn, client_opt, {'generic': params, 'personal': personal_head}, model_state,
        data, rng, schedule)
    delta = trees.tree_sub({'params': both['generic'], **model_state}, server_state.variables)
    return ClientOutput(delta, metrics), both['personal']

  def personalize(server_state, personal_head, data, rng):
    head = server_state.variables['params']['head']
    summed = jax.tree.map(jnp.add, head, personal_head)
    return {**server_state.variables,
            'params': {**server_state.variables['params'], 'head': summed}}

  def init_client_state(server_state):
    return jax.tree.map(jnp.zeros_like, server_state.variables['params']['head'])

  return FederatedAlgorithm(
      init=base.init_server(module, server_opt), init_client_state=init_client_state,
      client_update=client_update, server_update=base.average_server_update(server_opt),
      personalize=personalize, global_model=lambda server_state: server_state.variables)
