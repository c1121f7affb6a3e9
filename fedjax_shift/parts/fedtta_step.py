"""FedTTA's inner step (Ye, Chen, Wang, Li & Gao, "UPFL: Unsupervised Personalized
Federated Learning towards New Clients", arXiv 2023; Eqs. 4, 5 and 11): the training
(algorithms/fedtta.py) differentiates through it, a new client (adapters/fedtta.py)
takes it on its unlabelled data.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_shift import models

ADAPTATION = 'fedtta_adaptation'   # collection of φ in the global model's variables
# g's hidden widths by the paper's model sizes (App., HeteroFedTTA: small / medium / big).
ADAPTATION_SIZES = {'small': (32, 32, 32), 'medium': (64, 64, 64), 'big': (128, 128, 128)}


def personalization_loss(adaptation_module, adaptation_params, logits: jax.Array,
                         weight: jax.Array, norm_epsilon: float) -> jax.Array:
  """ℓ_per = sqrt(Σ_i w_i g(z_i; φ)² + ε): Eq. 4's L2 norm over the examples with
  weight > 0, smoothed at 0 by ε = ``norm_epsilon``. logits [B, C]."""
  scores = adaptation_module.apply({'params': adaptation_params}, logits)[:, 0]
  return jnp.sqrt(jnp.sum(weight * scores ** 2) + norm_epsilon)


class InnerStep(NamedTuple):
  """The settings of Eq. 5 / 11's step ψ − η_inner (∇_ψ ℓ_per + λψ)."""
  learning_rate: float          # η_inner
  norm_epsilon: float           # ε, smoothing ℓ_per at 0
  clip_norm: float = 0.0        # the authors' test-time steps: the gradient clipped at this
                                # global norm (0: none), ...
  weight_decay: float = 0.0     # ... then λ·ψ added (PyTorch's SGD order)


def inner_step(module, adaptation_module, params, adaptation_params, x: jax.Array,
               weight: jax.Array, settings: InnerStep, model_state=None):
  """ψ̃ = ψ − η_inner ∇_ψ ‖g(f(X; ψ); φ)‖₂ (Eqs. 5 and 11) on x [B, ...], weight [B];
  differentiable in ψ, φ. ``model_state``: the model's other collections (eval mode),
  if any."""
  def loss(params):
    logits = models.apply(module, {'params': params, **(model_state or {})}, x)[0]
    return personalization_loss(adaptation_module, adaptation_params, logits, weight,
                                settings.norm_epsilon)

  grads = jax.grad(loss)(params)
  if settings.clip_norm:
    norm = jnp.sqrt(sum(jnp.sum(g ** 2) for g in jax.tree.leaves(grads)))
    grads = jax.tree.map(
        lambda g: g * jnp.minimum(1.0, settings.clip_norm / (norm + 1e-12)), grads)
  return jax.tree.map(
      lambda p, g: p - settings.learning_rate * (g + settings.weight_decay * p), params, grads)
