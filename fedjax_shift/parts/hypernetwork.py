"""ODPFL-HN's client encoder and hypernetwork (Amosy, Eyal & Chechik 2021, "Inference-time
personalized federated learning"): ω's initialisation, the client embedding and the
classifier generated from it, shared by the training (algorithms/odpfl_hn.py) and a new
client's adaptation (adapters/odpfl_hn.py).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List

import jax
import jax.numpy as jnp

from fedjax_shift import models

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
