"""ODPFL-HN: a client encoder and a hypernetwork that generate a personalised model
from a client's unlabelled data. Amosy, Eyal and Chechik 2021 ("Inference-time
personalized federated learning"), the UPFL baseline of FedTTA (fedtta_upfl.txt Sec. 2,
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

import math
from typing import Any, Dict, List

import jax
import jax.numpy as jnp
import ml_collections

from fedjax_shift import models
from fedjax_shift.algorithms import base
from fedjax_shift.core.algorithm import ClientOutput, FederatedAlgorithm
from fedjax_shift.core.local import local_train
from fedjax_shift.registry import require

PyTree = Any
HYPERNETWORK = 'odpfl_hn'   # collection of ω in the global model's variables


def dense_init(key: jax.Array, fan_in: int, fan_out: int) -> Dict[str, jax.Array]:
  """PyTorch ``nn.Linear``'s default: kernel and bias U(±1/√fan_in)."""
  bound = 1.0 / math.sqrt(fan_in)
  kernel_key, bias_key = jax.random.split(key)
  return {'kernel': jax.random.uniform(kernel_key, (fan_in, fan_out), jnp.float32, -bound,
                                       bound),
          'bias': jax.random.uniform(bias_key, (fan_out,), jnp.float32, -bound, bound)}


def mlp_init(key: jax.Array, widths: List[int]) -> List[Dict[str, jax.Array]]:
  return [dense_init(jax.random.fold_in(key, i), fan_in, fan_out)
          for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:]))]


def mlp_apply(layers, h: jax.Array, final_relu: bool = False) -> jax.Array:
  for i, layer in enumerate(layers):
    h = h @ layer['kernel'] + layer['bias']
    if i < len(layers) - 1 or final_relu:
      h = jax.nn.relu(h)
  return h


def target_template(module, example_x: jax.Array):
  """The classifier's parameter structure (ShapeDtypeStructs) for inputs like
  example_x [B, ...]; a model with BatchNorm statistics is refused."""
  variables = jax.eval_shape(lambda x: models.init(module, jax.random.key(0), x), example_x)
  if set(variables) != {'params'}:
    raise ValueError('odpfl_hn generates every classifier weight from a hypernetwork: use a '
                     'model without BatchNorm statistics (mlp, evolve_cnn)')
  return variables['params']


def init_parameters(key: jax.Array, template, example_shape, embedding_dim: int,
                    hidden: int, trunk_layers: int) -> Dict[str, Any]:
  """ω = {'encoder': [layers], 'hypernetwork': {'trunk': [layers], 'heads': [one per
  classifier weight, in ``jax.tree.leaves(template)`` order]}}."""
  encoder_key, trunk_key, heads_key = jax.random.split(key, 3)
  pixels = math.prod(example_shape)
  leaves = jax.tree.leaves(template)
  return {
      'encoder': mlp_init(encoder_key, [pixels, hidden, embedding_dim]),
      'hypernetwork': {
          'trunk': mlp_init(trunk_key, [embedding_dim] + [hidden] * trunk_layers),
          'heads': [dense_init(jax.random.fold_in(heads_key, i), hidden, math.prod(leaf.shape))
                    for i, leaf in enumerate(leaves)]}}


def client_embedding(encoder, x: jax.Array, weight: jax.Array) -> jax.Array:
  """e = Σ_n w_n E(x_n) / Σ_n w_n: x [N, ...], weight [N] -> [embedding_dim]."""
  per_example = mlp_apply(encoder, x.reshape(x.shape[0], -1))
  return jnp.sum(weight[:, None] * per_example, 0) / jnp.maximum(jnp.sum(weight), 1e-12)


def generate(hypernetwork, embedding: jax.Array, template) -> PyTree:
  """θ = H(e): the classifier's params (structure of ``template``) from e [E]."""
  h = mlp_apply(hypernetwork['trunk'], embedding, final_relu=True)
  leaves = [(h @ head['kernel'] + head['bias']).reshape(leaf.shape)
            for head, leaf in zip(hypernetwork['heads'], jax.tree.leaves(template))]
  return jax.tree.unflatten(jax.tree.structure(template), leaves)


def personalized_params(omega, module, x: jax.Array, weight: jax.Array) -> PyTree:
  """θ = H(E(D)) for a client's data x [N, ...] with example weights [N]."""
  template = target_template(module, x[:1])
  return generate(omega['hypernetwork'], client_embedding(omega['encoder'], x, weight),
                  template)


def check(hparams: ml_collections.ConfigDict) -> None:
  for field in ('encoder_learning_rate', 'hypernetwork_learning_rate'):
    require(hparams[field] > 0, f'odpfl_hn.{field}', f'must be > 0, got {hparams[field]}')
  for field in ('embedding_dim', 'hidden', 'trunk_layers'):
    require(hparams[field] >= 1, f'odpfl_hn.{field}', f'must be >= 1, got {hparams[field]}')


@base.ALGORITHMS.register('odpfl_hn', defaults={
    'encoder_learning_rate': 0.5,        # η_encoder (FedTTA App. table, MNIST)
    'hypernetwork_learning_rate': 0.5,   # η_hn (MNIST)
    'embedding_dim': 32,                 # "client embedding size 32 across all datasets"
    'hidden': 100,                       # pFedHN's hypernetwork width (and E's hidden layer)
    'trunk_layers': 3,                   # pFedHN's hypernetwork depth
}, check=check)
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
