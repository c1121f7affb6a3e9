"""Supervised contrastive learning pieces that FedICON's training (algorithms/fedicon.py)
and its test-time adaptation (adapters/fedicon.py) share: the projection head g, the
normalised representation z = g(h(x)) and the SupCon loss (Khosla et al., NeurIPS 2020;
FedICON: Tan et al., NeurIPS 2023, Eqs. 3, 4 and 7).
"""
from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_shift import models
from fedjax_shift.core.local import masked_mean

# Contrastive pairs need a batch of at least two examples: with one, A(x) holds only
# the positive and Eq. 4 is identically 0.
MIN_BATCH = 2


class Projection(nn.Module):
  """g: features [B, F] -> [B, dim], Dense(F) – ReLU – Dense(dim) (SimCLR's head)."""
  dim: int = 64

  @nn.compact
  def __call__(self, features):
    hidden = nn.relu(nn.Dense(features.shape[-1])(features))
    return nn.Dense(self.dim)(hidden)


def projection_of(params) -> Optional[Projection]:
  """The Projection whose parameters ``params['projection']`` are (its output size read
  off them); None for a model without one (z is the encoder's output, Eq. 3)."""
  if 'projection' not in params:
    return None
  return Projection(params['projection']['Dense_1']['bias'].shape[0])


def supcon_loss(z: jax.Array, labels: jax.Array, weight: jax.Array, temperature: float,
                memory: jax.Array | None = None, memory_valid: jax.Array | None = None,
                anchor_weight: jax.Array | None = None) -> jax.Array:
  """Eq. 4 (and Eq. 7 with instance labels), averaged over anchors.

  For anchor a: A(a) = every other real view (and every valid ``memory`` row, a
  negative), P(a) = the views in A(a) with a's label; the anchor's loss is
  −(1/|P(a)|) Σ_{p∈P(a)} log softmax_{A(a)}(z_a·z_p / τ).

  Args:
    z: [V, D] L2-normalised representations.
    labels: [V] int (the same label = positives).
    weight: [V]; views with weight 0 (padding) are neither anchors nor in any A(a).
    memory: [M, D] normalised features used only as negatives (FedICON online), with
      ``memory_valid`` [M] bool.
    anchor_weight: [V] which real views are anchors (default: all of them, ``weight``);
      Eq. 7 as written anchors only the raw samples, their views joining A(x).
  Returns the mean over real anchors that have a positive; 0 (not NaN) when none has.
  """
  num_views = z.shape[0]
  real = weight > 0
  logits = z @ z.T / temperature
  contrast = real[None, :] & ~jnp.eye(num_views, dtype=bool)
  positives = contrast & (labels[:, None] == labels[None, :])
  if memory is not None:
    logits = jnp.concatenate([logits, z @ memory.T / temperature], axis=1)
    contrast = jnp.concatenate(
        [contrast, jnp.broadcast_to(memory_valid[None, :], (num_views, memory.shape[0]))], 1)
    positives = jnp.concatenate([positives, jnp.zeros((num_views, memory.shape[0]), bool)], 1)
  # A large finite negative, not −inf: rows without contrast stay finite (and so do
  # their gradients, which the anchor weight then zeroes).
  logits = jnp.where(contrast, logits, -1e9)
  log_prob = logits - jax.scipy.special.logsumexp(logits, axis=1, keepdims=True)
  num_positives = jnp.sum(positives, axis=1)
  per_anchor = -jnp.sum(jnp.where(positives, log_prob, 0.0), axis=1) / jnp.maximum(
      num_positives, 1)
  anchors = real if anchor_weight is None else real & (anchor_weight > 0)
  return masked_mean(per_anchor, (anchors & (num_positives > 0)).astype(z.dtype))


def representation(module, projection: Optional[Projection], variables, x, mode: str):
  """z [B, dim] of x, normalised: g(h(x)), or h(x) itself without a projection (Eq. 3's
  "output of the feature encoder"); and the variables (new BN statistics in 'train')."""
  if mode == 'train':
    features, variables = models.train_features(module, variables, x)
  else:
    features = models.features(module, variables, x, mode)
  z = features if projection is None else projection.apply(
      {'params': variables['params']['projection']}, features)
  return z / jnp.maximum(jnp.linalg.norm(z, axis=-1, keepdims=True), 1e-12), variables
