"""ODPFL-HN at test time: a new client's classifier generated from its own unlabelled
batch, θ = H(mean_x E(x)) (algorithms/odpfl_hn.py; Amosy et al. 2021), then its
predictions. No gradient step; the batch's labels are never read. Episodic: one
embedding per batch (the client's whole data when the batch holds it); online: the
embedding is the running mean over the batches seen so far.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_shift import models
from fedjax_shift.parts.hypernetwork import (HYPERNETWORK, client_embedding, generate,
                                              target_template)
from fedjax_shift.core.test_time import Adapter, register_constructor


class GeneratorState(NamedTuple):
  omega: dict               # {'encoder', 'hypernetwork'}
  embedding_sum: jax.Array  # [E] Σ_n E(x_n) over the batches seen (online)
  count: jax.Array          # [] Σ_n w_n


@register_constructor('odpfl_hn', trained_by=('odpfl_hn',))
def odpfl_hn_adapter(module) -> Adapter:
  def init(variables, rng):
    del rng
    if HYPERNETWORK not in variables:
      raise ValueError('the odpfl_hn adapter generates classifiers with a hypernetwork '
                       'trained by odpfl_hn (missing from the variables): list only odpfl_hn '
                       'in config.eval_adapter_algorithms')
    omega = variables[HYPERNETWORK]
    dim = omega['hypernetwork']['trunk'][0]['kernel'].shape[0]
    return GeneratorState(omega, jnp.zeros((dim,)), jnp.float32(0.0))

  def step(state, batch):
    weight_sum = jnp.sum(batch.weight)
    batch_embedding = client_embedding(state.omega['encoder'], batch.x, batch.weight)
    total = state.embedding_sum + batch_embedding * weight_sum
    count = state.count + weight_sum
    embedding = total / jnp.maximum(count, 1e-12)
    params = generate(state.omega['hypernetwork'], embedding,
                      target_template(module, batch.x[:1]))
    logits = models.apply(module, {'params': params}, batch.x)[0]
    return GeneratorState(state.omega, total, count), logits

  return Adapter(init, step)
