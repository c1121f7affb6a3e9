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

computed on the client as a vector-Jacobian product (it holds ω), averaged by the
server (config.server's optimizer on the mean, SGD lr 1 by default). The update is
pFedHN's; in the paper's protocol the server computes H's part from the uploaded
θ_i − θ̃_i and e_i (199,210 + 32 numbers for the MNIST MLP), here each client uploads
the vjp itself, so ``uploaded_parameters`` counts ω (20.2M with the defaults). A new client
runs E and H on its own unlabelled batch: the ``odpfl_hn`` adapter
(adapters/odpfl_hn.py), which reads ω from the global model's 'odpfl_hn' collection.
The global model's 'params' are H at the zero embedding (no client): a reference
column, not a method's prediction.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from fedjax_shift.algorithms import base
from fedjax_shift.core.algorithm import ClientOutput, FederatedAlgorithm
from fedjax_shift.core.local import local_train
from fedjax_shift.registry import POSITIVE, POSITIVE_INT

PyTree = Any
from fedjax_shift.parts.hypernetwork import (  # noqa: F401
    HYPERNETWORK, client_embedding, dense_init, generate, init_parameters, mlp_apply,
    mlp_init, personalized_params, target_template)


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
    theta, vjp = jax.vjp(lambda w: personalized_params(w, module, data.x, weight), omega)
    trained, _, _, metrics = local_train(base.cross_entropy_loss(module),
                                         context.client_optimizer, theta, {}, data, rng,
                                         context.schedule)
    (grads,) = vjp(base.tree_sub(theta, trained))
    delta = {part: jax.tree.map(lambda g, s=scale[part]: -s * g, grads[part])
             for part in grads}
    return ClientOutput({'params': delta}, metrics), client_state

  def global_model(server_state):
    omega = server_state.variables['params']
    zero = jnp.zeros((hparams.embedding_dim,))
    return {'params': generate(omega['hypernetwork'], zero, template), HYPERNETWORK: omega}

  return FederatedAlgorithm(
      init=init, init_client_state=lambda server_state: (), client_update=client_update,
      server_update=base.average_server_update(server_opt), personalize=None,
      global_model=global_model)
