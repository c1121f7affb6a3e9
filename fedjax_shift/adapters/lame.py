"""LAME: Parameter-free Online Test-time Adaptation. Boudiaf et al., CVPR 2022, Eq. 5–7.

The model is frozen (BatchNorm on its running statistics); only its outputs on a test
batch are corrected. With p_i the model's softmax and W the batch's affinity matrix of
the penultimate features, LAME minimises the Laplacian-regularised likelihood

  E(Z) = Σ_i KL(z_i ‖ p_i) − λ Σ_ij w_ij z_iᵀ z_j                          (Eq. 5)

by the bound optimisation's fixed point  z_i ∝ p_i ⊙ exp(λ Σ_j w_ij z_j)  (Eq. 7), from
z_i = p_i, until the energy changes by at most 1e-8 of itself or 100 iterations (the
authors' code: github.com/fiveai/LAME, unary −log(p + 1e-10)). The affinity is theirs,
of the L2-normalised penultimate features: 'rbf' by default (their best configuration,
exp(−‖f_i − f_j‖² / 2σ²), σ the mean distance to the 5th nearest counting the example
itself), 'knn' (w_ij = 1 when j is one of i's k = 5 nearest others) or 'linear'
(f_iᵀ f_j); ½(W + Wᵀ) with ``symmetric`` (their option, off). The prediction is log z.
Wrapped repeats in a batch (weight 0) take no part in the affinity. Episodic by nature: nothing is kept.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_shift import models
from fedjax_shift.core.test_time import Adapter, register_constructor
from fedjax_shift.registry import BOOL, POSITIVE, POSITIVE_INT, one_of

AFFINITIES = ('knn', 'rbf', 'linear')
# The authors' stopping rule: |E_t − E_{t−1}| <= 1e-8 · |E_{t−1}|, tested from step 2 on.
RELATIVE_TOLERANCE = 1e-8


def normalize(features: jax.Array) -> jax.Array:
  return features / jnp.maximum(jnp.linalg.norm(features, axis=-1, keepdims=True), 1e-12)


def affinity(features: jax.Array, valid: jax.Array, kind: str, knn: int) -> jax.Array:
  """W [B, B] of L2-normalised features [B, F] as the authors' code builds it: 'knn' 1 for
  each example's ``knn`` nearest others (not symmetric, diagonal 0); 'rbf'
  exp(−‖f_i − f_j‖² / 2σ²) with σ the mean over examples of the ``knn``-th smallest
  distance counting the example itself (diagonal 1); 'linear' f_iᵀ f_j. Rows and columns
  of examples with ``valid`` [B] False are 0."""
  pair = valid[:, None] & valid[None, :]
  if kind == 'linear':
    return jnp.where(pair, features @ features.T, 0.0)
  squared = jnp.maximum(jnp.sum((features[:, None] - features[None, :]) ** 2, -1), 0.0)
  distance = jnp.where(pair, jnp.sqrt(squared), jnp.inf)
  size = features.shape[0]
  if kind == 'knn':
    others = jnp.where(jnp.eye(size, dtype=bool), jnp.inf, distance)
    k = min(knn, size - 1)
    if k == 0:
      return jnp.zeros_like(squared)
    kth = -jax.lax.top_k(-others, k)[0][:, -1:]
    return (pair & jnp.isfinite(others) & (others <= kth)).astype(jnp.float32)
  kth = -jax.lax.top_k(-distance, min(knn, size))[0][:, -1]
  kth = jnp.where(jnp.isfinite(kth), kth, 0.0)
  sigma = jnp.sum(kth * valid) / jnp.maximum(jnp.sum(valid), 1)
  return jnp.where(pair, jnp.exp(-squared / jnp.maximum(2.0 * sigma ** 2, 1e-12)), 0.0)


class Laplacian(NamedTuple):
  assignments: jax.Array   # [B, C] z
  energy: jax.Array        # [] E(z) of the last step
  previous: jax.Array      # [] E of the step before
  steps: jax.Array         # [] iterations taken


def energy(z: jax.Array, unary: jax.Array, pairwise: jax.Array) -> jax.Array:
  """The authors' entropy energy Σ (u ⊙ z − (λWz) ⊙ z + z log z), u = −log p."""
  return jnp.sum(unary * z - pairwise * z + z * jnp.log(jnp.maximum(z, 1e-20)))


def laplacian_optimization(log_probs: jax.Array, kernel: jax.Array, strength: float,
                           max_steps: int) -> Laplacian:
  """The fixed point z = softmax(log p + λ W z) of Eq. 7 from z = p. log_probs [B, C],
  kernel [B, B]."""
  unary = -log_probs

  def update(state: Laplacian) -> Laplacian:
    pairwise = strength * kernel @ state.assignments
    z = jax.nn.softmax(log_probs + pairwise, axis=-1)
    return Laplacian(z, energy(z, unary, pairwise), state.energy, state.steps + 1)

  def unconverged(state: Laplacian):
    converged = (state.steps > 2) & (jnp.abs(state.energy - state.previous) <=
                                     RELATIVE_TOLERANCE * jnp.abs(state.previous))
    return (state.steps < max_steps) & ~converged

  start = Laplacian(jnp.exp(log_probs), jnp.inf, jnp.inf, jnp.int32(0))
  return jax.lax.while_loop(unconverged, update, start)


@register_constructor('lame', ranges={'affinity_kind': one_of(*AFFINITIES), 'knn': POSITIVE_INT,
                                      'strength': POSITIVE, 'max_steps': POSITIVE_INT,
                                      'symmetric': BOOL}, streams=True)
def lame(module, affinity_kind: str = 'rbf', knn: int = 5, strength: float = 1.0,
         max_steps: int = 100, symmetric: bool = False) -> Adapter:
  """LAME with the authors' benchmark setting: ``affinity_kind`` 'rbf' with σ from the
  ``knn`` = 5 nearest (their best configuration), not symmetrised (``symmetric``: ½(W + Wᵀ)),
  λ = ``strength`` 1, at most ``max_steps`` 100 iterations."""
  if affinity_kind not in AFFINITIES:
    raise ValueError(f'config.adapters.lame.affinity_kind: unknown {affinity_kind!r}; '
                     f'choose from {list(AFFINITIES)}')

  def init(variables, rng):
    del rng
    return variables

  def step(variables, batch):
    penultimate = models.head_hidden(variables, models.features(module, variables, batch.x))
    log_probs = jnp.log(jax.nn.softmax(models.linear_head(variables, penultimate)) + 1e-10)
    kernel = affinity(normalize(penultimate), batch.weight > 0, affinity_kind, knn)
    if symmetric:
      kernel = 0.5 * (kernel + kernel.T)
    z = laplacian_optimization(log_probs, kernel, strength, max_steps).assignments
    return variables, jnp.log(jnp.maximum(z, 1e-20))

  def predict(variables, batch):   # the model's own outputs, uncorrected
    return models.apply(module, variables, batch.x)[0]

  return Adapter(init, step, predict)
