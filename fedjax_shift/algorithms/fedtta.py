"""FedTTA and FedTTA-Prox: unsupervised personalisation of new clients (UPFL).
Ye et al., UPFL 2023, Sec. 3.2 (Eqs. 3–9, Algorithm 1) and Sec. 3.3 (Eq. 13).

A base prediction model f(·; ψ) (the classifier) and an adaptation model g(·; φ), an
MLP on each example's logits (C → 32 → 32 → 32 → 1, Sec. 4.1). Client i, for each
local step on a batch (X, Y):

  Z = f(X; ψ)                                                    (Eq. 3)
  ℓ_per = ‖g(Z; φ)‖₂, the L2 norm over the batch                 (Eq. 4)
  ψ̃ = ψ − η_inner ∇_ψ ℓ_per                                       (Eq. 5)
  L = CE(f(X; ψ̃), Y)                                             (Eqs. 6, 7)
      + μ · KL(softmax f(X; ψ_s) ‖ softmax f(X; ψ))  (FedTTA-Prox, Eq. 13; ψ_s = server)
  ψ ← ψ − η_outer ∇_ψ L,   φ ← φ − η_adapt ∇_φ L                   (Eqs. 8, 9)

∇L reaches ψ and φ through the inner step (``jax.grad`` of ``jax.grad``). Server: the
weighted mean of (ψ, φ). A new client adapts ψ on its unlabelled data with the same
inner step (Eq. 11; FedTTA++ runs up to E of them with entropy early stopping):
``adapters/fedtta.py``, which reads φ from the global model's 'fedtta_adaptation'
collection. η_outer is ``config.client.learning_rate``.
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
from fedjax_shift.parts.fedtta_step import ADAPTATION, ADAPTATION_SIZES, InnerStep, inner_step
from fedjax_shift.parts.trees import clipped_and_decayed
from fedjax_shift.registry import NONNEGATIVE, interval, one_of



CLIP_GROUPS = ('separate', 'joint')   # meta_optimizer's clip: per group (ψ, φ) or both at once


def meta_loss(module, adaptation_module, params, x: jax.Array, y: jax.Array,
              weight: jax.Array, hparams: ml_collections.ConfigDict) -> jax.Array:
  """CE(f(X; ψ̃), Y) with ψ̃ the inner step of ψ = params['base'] under
  φ = params['adaptation'] (Eqs. 5–7); x [B, ...], y [B], weight [B]."""
  adapted = inner_step(module, adaptation_module, params['base'], params['adaptation'], x,
                       weight, InnerStep(hparams.inner_learning_rate, hparams.norm_epsilon))
  logits = models.apply(module, {'params': adapted}, x)[0]
  return masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, y), weight)


def meta_optimizer(base_optimizer: optax.GradientTransformation,
                   hparams: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """Eqs. 8, 9 as the authors' code steps them (their ``meta_opt``): ψ ('base') with
  ``base_optimizer`` (η_outer), φ ('adaptation') with SGD η_adapt and momentum
  ``adapt_momentum``; the gradient clipped at global norm ``clip_norm`` (0: none), each
  group at its own (``clip_groups='separate'``, the authors') or both at one
  (``'joint'``), then ``weight_decay``·θ added (PyTorch's SGD order).
  adapt_momentum = weight_decay = 0 is the paper's text (plain SGD on φ)."""
  separate_clip = hparams.clip_norm if hparams.clip_groups == 'separate' else 0.0
  group = lambda optimizer: clipped_and_decayed(optimizer, separate_clip,
                                                hparams.weight_decay)
  adaptation = optax.sgd(hparams.adapt_learning_rate, momentum=hparams.adapt_momentum or None)
  groups = optax.multi_transform({'base': group(base_optimizer), 'adaptation': group(adaptation)},
                                 {'base': 'base', 'adaptation': 'adaptation'})
  if hparams.clip_groups == 'joint' and hparams.clip_norm:
    return optax.chain(optax.clip_by_global_norm(hparams.clip_norm), groups)
  return groups


# ``meta_optimizer``'s fields (also HeteroFedTTA's).
META_OPTIMIZER_RANGES = {
    'adapt_learning_rate': NONNEGATIVE,             # 0: φ is not trained
    'adapt_momentum': interval(0, 1, high_open=True),
    'clip_norm': NONNEGATIVE,                       # 0: no clip
    'clip_groups': one_of(*CLIP_GROUPS),
    'weight_decay': NONNEGATIVE,
}
# η_inner and ε of Eq. 5 (also HeteroFedTTA's): η_inner = 0 takes no personalisation
# step; ε = 0 is Eq. 4's plain norm.
INNER_STEP_RANGES = {'inner_learning_rate': NONNEGATIVE, 'norm_epsilon': NONNEGATIVE}
RANGES = {**META_OPTIMIZER_RANGES, **INNER_STEP_RANGES,
          'mu': NONNEGATIVE,   # 0: FedTTA (no proximal term)
          'adaptation_size': one_of(*ADAPTATION_SIZES)}


def adaptation_model(size: str) -> models.AdaptationMLP:
  return models.AdaptationMLP(ADAPTATION_SIZES[size])


def build(hparams: ml_collections.ConfigDict, context: base.BuildContext) -> FederatedAlgorithm:
  module, server_opt = context.module, context.server_optimizer
  adaptation_module = adaptation_model(hparams.adaptation_size)
  client_opt = meta_optimizer(context.client_optimizer, hparams)

  def init(rng, example_x):
    base_key, adaptation_key = jax.random.split(rng)
    variables = models.init(module, base_key, example_x)
    if set(variables) != {'params'}:
      raise ValueError('FedTTA differentiates through a step on unlabelled data: use a model '
                       'without BatchNorm statistics (mlp, evolve_cnn)')
    logits = models.apply(module, variables, example_x)[0]
    params = {'base': variables['params'],
              'adaptation': adaptation_module.init(adaptation_key, logits)['params']}
    return base.ServerState({'params': params}, server_opt.init(params), jnp.int32(0))

  def client_update(server_state, client_state, data, rng):
    params = server_state.variables['params']
    server_base = params['base']

    def loss_fn(params, model_state, x, y, weight, step_rng):
      del step_rng
      loss = meta_loss(module, adaptation_module, params, x, y, weight, hparams)
      if hparams.mu:   # FedTTA-Prox: the base model's outputs stay near the server's
        base_logits = models.apply(module, {'params': params['base']}, x)[0]
        server_probs = jax.nn.softmax(models.apply(module, {'params': server_base}, x)[0])
        kl = jnp.sum(server_probs * (jnp.log(server_probs + 1e-12) -
                                     jax.nn.log_softmax(base_logits)), -1)
        loss = loss + hparams.mu * masked_mean(kl, weight)
      return loss, model_state

    new_params, _, _, metrics = local_train(loss_fn, client_opt, params, {}, data, rng,
                                            context.schedule)
    delta = trees.tree_sub({'params': new_params}, server_state.variables)
    return ClientOutput(delta, metrics), client_state

  def global_model(server_state):
    params = server_state.variables['params']
    return {'params': params['base'], ADAPTATION: params['adaptation']}

  return FederatedAlgorithm(
      init=init, init_client_state=lambda server_state: (), client_update=client_update,
      server_update=base.average_server_update(server_opt), personalize=None,
      global_model=global_model)


FEDTTA_DEFAULTS = {
    'inner_learning_rate': 0.5,   # η_inner (App. table, MNIST)
    'adapt_learning_rate': 0.01,  # η_adapt (App. table, MNIST FedTTA)
    'mu': 0.0,                    # no proximal term
    'adaptation_size': 'small',   # g: C → 32 → 32 → 32 → 1 (Sec. 4.1)
    # ε of ℓ_per = sqrt(Σ g² + ε) (not in the paper). The norm's curvature grows like
    # 1/‖g‖ near 0 and the outer gradient goes through ∇ψ‖g‖: at ε = 1e-12 the MNIST
    # protocol hit ‖g‖ ≈ 0.07 within 4 steps, a 25× gradient spike, NaN in round 1.
    'norm_epsilon': 0.1,
    # Global-norm clip of each group's outer gradient, ∇ψL and ∇φL, per local step (0:
    # none; not in the paper, 10 in the authors' code). MNIST protocol, η_inner 0.5, 50
    # rounds, one joint clip over (ψ, φ): unclipped, 3 of 5 FedTTA / FedTTA-Prox runs gave
    # NaN (rounds 14–22); clipped at 10, none of 6 did; clipped at 1 it trained too slowly.
    'clip_norm': 10.0,
    'clip_groups': 'separate',    # the authors' meta_opt clips ψ's and φ's groups apart;
                                  # 'joint': one clip over (ψ, φ) together
    'adapt_momentum': 0.9,        # the authors' meta_opt: momentum 0.9 on φ's group only
    'weight_decay': 1e-4,         # the authors' meta_opt: weight decay 1e-4 on ψ and φ
}


@base.ALGORITHMS.register('fedtta', defaults=FEDTTA_DEFAULTS, ranges=RANGES,
                          batch_norm=False)
def fedtta(hparams: ml_collections.ConfigDict, context: base.BuildContext
           ) -> FederatedAlgorithm:
  return build(hparams, context)


@base.ALGORITHMS.register('fedtta_prox', variant_of='fedtta', defaults={
    'adapt_learning_rate': 0.001,  # η_adapt (App. table, MNIST FedTTA-Prox)
    'mu': 0.01},                   # μ (App. table, MNIST FedTTA-Prox)
    batch_norm=False)
def fedtta_prox(hparams: ml_collections.ConfigDict, context: base.BuildContext
                ) -> FederatedAlgorithm:
  return build(hparams, context)

