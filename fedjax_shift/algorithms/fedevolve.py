"""FedEvolve: Federated Learning under Evolving Distribution Shifts (FedEvolve paper,
Sec. 4.1 and Algorithm 1).

Two representation functions: f_φ estimates, from domain S_m, the representation
of the next domain; f_ψ represents S_{m+1}. Client k, for τ local iterations, for
m = 1 … M−1:

  A ~ D_m^k, B ~ D_{m+1}^k                             random batches
  C_{m,y} = mean_{x ∈ A_y} f_φ(x)                      (Eq. 3)
  ℓ = −mean_{(x,y) ∈ B} log softmax_y(−d(f_ψ(x), C_m))  (Eq. 4, d Euclidean)
  (φ, ψ) ← (φ, ψ) − η ∇ℓ

Server: φ, ψ ← mean over the cohort (uniform weights in the paper). Prediction on
the target domain S_{M+1}: nearest prototype of f_φ(S_M) to f_ψ(x). "Client"
(personalised) uses the client's own S_M prototypes under the global φ; "server"
(global) uses prototypes averaged over the last cohort's uploads (sum of features
and counts per class of S_M, a C×F message). Both are expressed as a linear head on
f_ψ (prototypes.prototype_head), so evaluation is a classifier forward.
τ counts iterations (each = one batch of every one of the M−1 domain pairs; default)
or, with ``tau_unit='epochs'``, epochs as App. D says (⌈client's largest source
domain / B⌉ iterations each; the batches are drawn at random as in an iteration).
A straggler's budget caps τ in the same unit.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax

from fedjax_shift import models
from fedjax_shift.algorithms import base
from fedjax_shift.algorithms.domains import (TAU_UNITS, domain_batch, domain_block,
                                             iteration_budget, layout_from_info,
                                             local_iterations)
from fedjax_shift.algorithms.prototypes import (DISTANCES, class_prototypes, prototype_head,
                                                prototype_loss)
from fedjax_shift.core.algorithm import ClientOutput, FederatedAlgorithm
from fedjax_shift.core.local import run_steps
from fedjax_shift.parts import trees
from fedjax_shift.registry import one_of


class FedEvolveState(NamedTuple):
  params: Any          # {'phi': encoder params, 'psi': encoder params}
  opt_state: Any
  prototypes: Any      # [C, F] server prototypes of S_M (averaged uploads)
  present: Any         # [C] bool
  round: jax.Array
  batch_stats: Any = None  # {'phi': stats, 'psi': stats}: each encoder's BatchNorm
                           # running statistics ({} without BatchNorm)


def encoder_variables(encoder_params, encoder_stats=None):
  """The classifier variables of one encoder (and its BatchNorm statistics, if any)."""
  variables = {'params': {'encoder': encoder_params}}
  if encoder_stats:
    variables['batch_stats'] = {'encoder': encoder_stats}
  return variables


def encoder_features(module, encoder_params, x, encoder_stats=None):
  """f(x) [B, F] in eval mode (BatchNorm with the running statistics)."""
  return models.features(module, encoder_variables(encoder_params, encoder_stats), x)


def train_encoder_features(module, encoder_params, encoder_stats, x):
  """(f(x) [B, F] in train mode, the encoder's updated running statistics): BatchNorm
  normalises with the batch's statistics, as a PyTorch encoder in train() mode. Without
  BatchNorm the eval forward (the same function) and the statistics unchanged."""
  if not encoder_stats:
    return encoder_features(module, encoder_params, x), encoder_stats
  features, variables = models.train_features(
      module, encoder_variables(encoder_params, encoder_stats), x)
  return features, variables['batch_stats']['encoder']


def check_feature_dims(phi_features: jax.Array, psi_features: jax.Array) -> int:
  """F, the shared feature width: f_ψ(x) is compared with prototypes of f_φ, so both
  must give [B, F] features of one F (a mismatch would broadcast into a wrong
  distance, not fail)."""
  if phi_features.shape[-1] != psi_features.shape[-1]:
    raise ValueError(f'FedEvolve compares f_psi features with f_phi prototypes: their widths '
                     f'differ ({phi_features.shape[-1]} vs {psi_features.shape[-1]})')
  return phi_features.shape[-1]


def server_update(server_opt: optax.GradientTransformation, state: FedEvolveState,
                  outputs: ClientOutput, weights) -> FedEvolveState:
  """Both encoders by ``server_opt`` on the clients' weighted mean update, the class
  prototypes from the included clients' last-domain sums, the running statistics as the
  clients' weighted mean."""
  mean_delta = trees.weighted_sum(outputs.update['params'], weights)
  updates, opt_state = server_opt.update(jax.tree.map(jnp.negative, mean_delta),
                                         state.opt_state, state.params)
  included = (weights > 0).astype(jnp.float32)
  sums = jnp.tensordot(included, outputs.update['proto_sums'], axes=1)
  counts = jnp.tensordot(included, outputs.update['proto_counts'], axes=1)
  prototypes = sums / jnp.maximum(counts, 1e-12)[:, None]
  # Running statistics are not trained: the weighted mean of the clients' directly.
  stats = jax.tree.map(jnp.add, state.batch_stats,
                       trees.weighted_sum(outputs.update['batch_stats'], weights))
  return FedEvolveState(optax.apply_updates(state.params, updates), opt_state, prototypes,
                        counts > 0, state.round + 1, stats)


# d of Eq. 4: 'euclidean' (Sec. 4.1: "we employ Euclidean distance") or
# 'squared_euclidean' (Snell et al. 2017).
@base.ALGORITHMS.register('fedevolve', defaults={
    'distance': 'euclidean',
    'tau_unit': 'iterations',   # τ = client.local_epochs counts: 'iterations' | 'epochs'
}, ranges={'distance': one_of(*DISTANCES), 'tau_unit': one_of(*TAU_UNITS)},
    layout='domains')  # domain-major client data
def fedevolve(hparams: ml_collections.ConfigDict, context: base.BuildContext
              ) -> FederatedAlgorithm:
  """τ = the schedule's epochs, read as ``hparams.tau_unit`` says; batches of its batch
  size, from domain-major data laid out as ``context.info`` says."""
  module = context.module
  layout = layout_from_info(context.info, context.schedule.max_examples, 'fedevolve')
  if layout.num_domains < 2:
    raise ValueError('FedEvolve aligns consecutive source domains: config.data.num_domains '
                     'must be >= 3 (two sources and the target)')
  num_classes = module.num_classes
  tau, batch_size = context.schedule.num_epochs, context.schedule.batch_size
  iterations = local_iterations(layout, tau, hparams.tau_unit, batch_size)
  client_opt, server_opt = context.client_optimizer, context.server_optimizer

  def init(rng, example_x):
    phi_key, psi_key = jax.random.split(rng)
    variables = [models.init(module, key, example_x) for key in (phi_key, psi_key)]
    names = ('phi', 'psi')
    params = {n: v['params']['encoder'] for n, v in zip(names, variables)}
    stats = {n: v.get('batch_stats', {}).pop('encoder', {}) for n, v in zip(names, variables)}
    outside = sorted(set(variables[0].get('batch_stats', {})))
    if outside:
      raise ValueError(f'FedEvolve keeps BatchNorm statistics of its two encoders only; this '
                       f'model has statistics outside its encoder: {outside}')
    dim = check_feature_dims(encoder_features(module, params['phi'], example_x, stats['phi']),
                             encoder_features(module, params['psi'], example_x, stats['psi']))
    return FedEvolveState(params, server_opt.init(params), jnp.zeros((num_classes, dim)),
                          jnp.zeros((num_classes,), bool), jnp.int32(0), stats)

  def pair_loss(params, stats, x_a, y_a, w_a, x_b, y_b, w_b):
    """Eq. 4's loss on one domain pair, and each encoder's updated statistics."""
    phi_features, phi_stats = train_encoder_features(module, params['phi'], stats['phi'], x_a)
    protos, counts = class_prototypes(phi_features, y_a, w_a, num_classes)
    psi_features, psi_stats = train_encoder_features(module, params['psi'], stats['psi'], x_b)
    loss = prototype_loss(psi_features, y_b, w_b, protos, counts > 0, hparams.distance)
    return loss, {'phi': phi_stats, 'psi': psi_stats}

  grad_fn = jax.value_and_grad(pair_loss, has_aux=True)

  def last_domain_sums(phi, phi_stats, data):
    x, y, mask = domain_block(data, layout, layout.num_domains - 1)
    onehot = jax.nn.one_hot(y, num_classes) * mask[:, None]
    return onehot.T @ encoder_features(module, phi, x, phi_stats), onehot.sum(0)

  def client_update(server_state: FedEvolveState, client_state, data, rng):
    budget = iteration_budget(data, layout, tau, hparams.tau_unit, batch_size)

    def iteration(carry, it):   # one pass over the pairs; run_steps masks it past budget
      def pair(carry, m):
        params, stats, opt_state, loss_sum = carry
        key = jax.random.fold_in(jax.random.fold_in(rng, it), m)
        x_a, y_a, w_a = domain_batch(data, layout, m, jax.random.fold_in(key, 0), batch_size)
        x_b, y_b, w_b = domain_batch(data, layout, m + 1, jax.random.fold_in(key, 1),
                                     batch_size)
        (loss, new_stats), grads = grad_fn(params, stats, x_a, y_a, w_a, x_b, y_b, w_b)
        updates, new_opt = client_opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), new_stats, new_opt,
                loss_sum + loss.astype(loss_sum.dtype)), None

      carry, _ = jax.lax.scan(pair, carry, jnp.arange(layout.num_domains - 1),
                              unroll=context.schedule.unroll)
      return carry

    params, stats = server_state.params, server_state.batch_stats
    init_carry = (params, stats, client_opt.init(params), jnp.float32(0.0))
    params, stats, _, loss_sum = run_steps(iteration, init_carry, budget, iterations,
                                           context.schedule.unroll)
    sums, counts = last_domain_sums(params['phi'], stats['phi'], data)
    steps = budget * (layout.num_domains - 1)
    metrics = {'loss': loss_sum / jnp.maximum(steps, 1), 'num_steps': steps.astype(jnp.float32)}
    update = {'params': trees.tree_sub(params, server_state.params),
              'batch_stats': trees.tree_sub(stats, server_state.batch_stats),
              'proto_sums': sums, 'proto_counts': counts}
    return ClientOutput(update, metrics), client_state

  def classifier(state, prototypes, present):
    """f_ψ (with its statistics) and the prototype head: the predicting model."""
    variables = encoder_variables(state.params['psi'], state.batch_stats['psi'])
    variables['params']['head'] = prototype_head(prototypes, present)
    return variables

  def personalize(state: FedEvolveState, client_state, data, rng):
    del client_state, rng
    sums, counts = last_domain_sums(state.params['phi'], state.batch_stats['phi'], data)
    return classifier(state, sums / jnp.maximum(counts, 1e-12)[:, None], counts > 0)

  return FederatedAlgorithm(
      init=init, init_client_state=lambda state: (), client_update=client_update,
      server_update=functools.partial(server_update, server_opt), personalize=personalize,
      global_model=lambda state: classifier(state, state.prototypes, state.present))
