"""ODPFL-HN: a client encoder and a hypernetwork that generate a personalised model
from a client's unlabelled data. Amosy, Eyal and Chechik 2021 ("Inference-time
personalized federated learning"), the UPFL baseline of FedTTA (Ye et al., UPFL 2023 Sec. 2,
App. B: client embedding size 32; rates η_local, η_encoder, η_hn).

Server parameters ω = (ω_E, ω_H): a client encoder E (per-example MLP, mean-pooled)
and a hypernetwork H (MLP trunk, one linear head per weight tensor of the classifier).
Client i, each round (pFedHN's update, Shamsian et al. 2021, Alg. 1):

  e_i = mean_{x ∈ D_i} E(x; ω_E)             (its data's embedding; labels unused)
  θ_i = H(e_i; ω_H)                            (the generated classifier)
  θ̃_i = local SGD of θ_i on D_i (η_local = config.client.learning_rate, τ steps)
  Δω = −(η_encoder, η_hn) ⊙ (∂θ_i/∂ω)ᵀ (θ_i − θ̃_i)

split as the paper's protocol splits it: the client uploads θ_i − θ̃_i and e_i
(199,210 + 32 numbers for the MNIST MLP) and its encoder's part of Δω, the
vector-Jacobian product through e_i, which needs its data (81,732 numbers with the
defaults); the server computes H's part, Σ_i p_i (∂H(e_i)/∂ω_H)ᵀ(θ_i − θ̃_i), as one
vjp over the cohort's embeddings, and config.server's optimizer (SGD lr 1 by default)
applies the mean. The server's sum never holds a client's 20.2M-number gradient of
H's heads: it is one [hidden, C] × [C, 199,210] product. A new client runs E and H on
its own unlabelled batch: the ``odpfl_hn`` adapter (adapters/odpfl_hn.py), which
reads ω from the global model's 'odpfl_hn' collection. The global model's 'params'
are H at the zero embedding (no client): a reference column, not a method's
prediction.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from fedjax_shift.algorithms import base
from fedjax_shift.core.algorithm import ClientOutput, FederatedAlgorithm
from fedjax_shift.core.local import local_train
from fedjax_shift.parts import trees
from fedjax_shift.parts.hypernetwork import (HYPERNETWORK, client_embedding, generate,
                                             init_parameters, target_template)
from fedjax_shift.registry import POSITIVE, POSITIVE_INT

PyTree = Any


@base.ALGORITHMS.register('odpfl_hn', defaults={
    'encoder_learning_rate': 0.5,        # η_encoder (FedTTA App. table, MNIST)
    'hypernetwork_learning_rate': 0.5,   # η_hn (MNIST)
    'embedding_dim': 32,                 # "client embedding size 32 across all datasets"
    'hidden': 100,                       # pFedHN's hypernetwork width (and E's hidden layer)
    'trunk_layers': 3,                   # pFedHN's hypernetwork depth
}, ranges={'encoder_learning_rate': POSITIVE, 'hypernetwork_learning_rate': POSITIVE,
           'embedding_dim': POSITIVE_INT, 'hidden': POSITIVE_INT, 'trunk_layers': POSITIVE_INT},
    batch_norm=False)
def odpfl_hn(hparams: ml_collections.ConfigDict, context: base.BuildContext
             ) -> FederatedAlgorithm:
  module, server_opt = context.module, context.server_optimizer
  if not context.example_shape:
    raise ValueError('odpfl_hn generates the classifier from the input shape: build it with '
                     'the example shape (algorithms.build(..., example_shape=...))')
  template = target_template(module, jnp.zeros((1,) + tuple(context.example_shape)))
  scale = {'encoder': hparams.encoder_learning_rate,
           'hypernetwork': hparams.hypernetwork_learning_rate}

  def init(rng, example_x):
    omega = init_parameters(rng, template, example_x.shape[1:], hparams.embedding_dim,
                            hparams.hidden, hparams.trunk_layers)
    return base.ServerState({'params': omega}, server_opt.init(omega), jnp.int32(0))

  def client_update(server_state, client_state, data, rng):
    omega = server_state.variables['params']
    weight = data.mask.astype(jnp.float32)
    embedding, encoder_vjp = jax.vjp(
        lambda encoder: client_embedding(encoder, data.x, weight), omega['encoder'])
    theta, embedding_vjp = jax.vjp(
        lambda e: generate(omega['hypernetwork'], e, template), embedding)
    trained, _, _, metrics = local_train(base.cross_entropy_loss(module),
                                         context.client_optimizer, theta, {}, data, rng,
                                         context.schedule)
    classifier_delta = trees.tree_sub(theta, trained)              # θ_i − θ̃_i
    (encoder_grad,) = encoder_vjp(*embedding_vjp(classifier_delta))
    upload = {'encoder': jax.tree.map(lambda g: -scale['encoder'] * g, encoder_grad),
              'embedding': embedding, 'classifier_delta': classifier_delta}
    return ClientOutput(upload, metrics), client_state

  def mean_delta(server_state, outputs, weights):
    """Σ_i p_i Δω_i: the uploaded encoder parts averaged; H's part one vjp of
    e [C, E] -> θ [C, ...] at the cotangent p_i (θ_i − θ̃_i)."""
    upload = outputs.update
    _, hypernetwork_vjp = jax.vjp(
        lambda hypernetwork: jax.vmap(lambda e: generate(hypernetwork, e, template))(
            upload['embedding']),
        server_state.variables['params']['hypernetwork'])
    weighted = jax.tree.map(
        lambda delta: delta * weights.reshape((-1,) + (1,) * (delta.ndim - 1)),
        upload['classifier_delta'])
    (hypernetwork_grad,) = hypernetwork_vjp(weighted)
    return {'params': {
        'encoder': trees.weighted_sum(upload['encoder'], weights),
        'hypernetwork': jax.tree.map(lambda g: -scale['hypernetwork'] * g, hypernetwork_grad)}}

  def global_model(server_state):
    omega = server_state.variables['params']
    zero = jnp.zeros((hparams.embedding_dim,))
    return {'params': generate(omega['hypernetwork'], zero, template), HYPERNETWORK: omega}

  return FederatedAlgorithm(
      init=init, init_client_state=lambda server_state: (), client_update=client_update,
      server_update=base.average_server_update(server_opt, mean_delta=mean_delta),
      personalize=None,
      global_model=global_model)
