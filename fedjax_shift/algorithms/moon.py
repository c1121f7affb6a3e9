"""MOON: Model-Contrastive Federated Learning.

Li, He and Song, CVPR 2021, Algorithm 1 (a FedIns Table 1 baseline). Client i keeps its
previous local model w_i^{t−1}; each step adds a model-contrastive term to the CE:

  z = R_w(x), z_glob = R_{w^t}(x), z_prev = R_{w_i^{t−1}}(x)                     (Eq. 2)
  ℓ_con = −log( e^{cos(z, z_glob)/τ} / (e^{cos(z, z_glob)/τ} + e^{cos(z, z_prev)/τ}) )
  ℓ = ℓ_sup + μ ℓ_con                                                             (Eq. 3)

and the server averages the local models (FedAvg). R is the encoder's output (the
library's encoder / head split: for the papers' CNNs the representation before the
head; MOON's extra projection head is not added), the global and previous models run
frozen with running statistics. μ = 1 (FedIns Sec. 4.2), τ = 0.5 (MOON Sec. 4.1). The
previous model starts as the initial global model (MOON's code) and is the client's
state: [K, model] memory, as in the method.
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
from fedjax_shift.registry import NONNEGATIVE, POSITIVE


def cosine(a: jax.Array, b: jax.Array) -> jax.Array:
  """Row-wise cosine similarity of [B, F] and [B, F] -> [B]."""
  norm = lambda v: jnp.maximum(jnp.linalg.norm(v, axis=-1), 1e-8)
  return jnp.sum(a * b, axis=-1) / (norm(a) * norm(b))


def contrastive_loss(z, z_glob, z_prev, temperature: float) -> jax.Array:
  """ℓ_con per example [B]: the global model's representation is the positive."""
  logits = jnp.stack([cosine(z, z_glob), cosine(z, z_prev)], axis=-1) / temperature
  return -jax.nn.log_softmax(logits, axis=-1)[:, 0]


@base.ALGORITHMS.register('moon', defaults={'mu': 1.0, 'temperature': 0.5},
                          ranges={'mu': NONNEGATIVE, 'temperature': POSITIVE})
def moon(hparams: ml_collections.ConfigDict, context: base.BuildContext) -> FederatedAlgorithm:
  module, server_opt = context.module, context.server_optimizer
  mu, temperature = hparams.mu, hparams.temperature

  def client_update(server_state, previous, data, rng):
    global_variables = server_state.variables

    def loss_fn(params, model_state, x, y, weight, rng):
      del rng
      z, variables = models.train_features(module, {'params': params, **model_state}, x)
      logits = models.head(variables, z)
      z_glob = jax.lax.stop_gradient(models.features(module, global_variables, x))
      z_prev = jax.lax.stop_gradient(models.features(module, previous, x))
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
      loss = masked_mean(ce + mu * contrastive_loss(z, z_glob, z_prev, temperature), weight)
      return loss, {k: v for k, v in variables.items() if k != 'params'}

    params, model_state = base.split_variables(global_variables)
    params, model_state, _, metrics = local_train(loss_fn, context.client_optimizer, params,
                                                  model_state, data, rng, context.schedule)
    new_variables = {'params': params, **model_state}
    # A client that ran no step keeps its previous model.
    ran = metrics['num_steps'] > 0
    kept = jax.tree.map(lambda new, old: jnp.where(ran, new, old), new_variables, previous)
    return ClientOutput(trees.tree_sub(new_variables, global_variables), metrics), kept

  return FederatedAlgorithm(
      init=base.init_server(module, server_opt),
      init_client_state=lambda server_state: server_state.variables,
      client_update=client_update,
      server_update=base.average_server_update(server_opt),
      personalize=None,
      global_model=lambda server_state: server_state.variables)
