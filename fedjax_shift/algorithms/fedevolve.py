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
from fedjax_shift.core.local import select
from fedjax_shift.registry import require


class FedEvolveState(NamedTuple):
  params: Any          # {'phi': encoder params, 'psi': encoder params}
  opt_state: Any
  prototypes: Any      # [C, F] server prototypes of S_M (averaged uploads)
  present: Any         # [C] bool
  round: jax.Array


def encoder_features(module, encoder_params, x):
  return models.features(module, {'params': {'encoder': encoder_params}}, x)


def check_feature_dims(phi_features: jax.Array, psi_features: jax.Array) -> int:
  """F, the shared feature width: f_ψ(x) is compared with prototypes of f_φ, so both
  must give [B, F] features of one F (a mismatch would broadcast into a wrong
  distance, not fail)."""
  if phi_features.shape[-1] != psi_features.shape[-1]:
    raise ValueError(f'FedEvolve compares f_psi features with f_phi prototypes: their widths '
                     f'differ ({phi_features.shape[-1]} vs {psi_features.shape[-1]})')
  return phi_features.shape[-1]


def check(hparams: ml_collections.ConfigDict) -> None:
  require(hparams.distance in DISTANCES, 'fedevolve.distance',
          f'choose from {list(DISTANCES)}, got {hparams.distance!r}')
  require(hparams.tau_unit in TAU_UNITS, 'fedevolve.tau_unit',
          f'choose from {list(TAU_UNITS)}, got {hparams.tau_unit!r}')


# d of Eq. 4: 'euclidean' (Sec. 4.1: "we employ Euclidean distance") or
# 'squared_euclidean' (Snell et al. 2017).
@base.ALGORITHMS.register('fedevolve', defaults={
    'distance': 'euclidean',
    'tau_unit': 'iterations',   # τ = client.local_epochs counts: 'iterations' | 'epochs'
}, check=check, layout='domains', batch_norm=False)  # domain-major client data
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
    if any(set(v) != {'params'} for v in variables):
      raise ValueError('FedEvolve needs a model without BatchNorm statistics (evolve_cnn, mlp)')
    params = {'phi': variables[0]['params']['encoder'], 'psi': variables[1]['params']['encoder']}
    dim = check_feature_dims(encoder_features(module, params['phi'], example_x),
                             encoder_features(module, params['psi'], example_x))
    return FedEvolveState(params, server_opt.init(params), jnp.zeros((num_classes, dim)),
                          jnp.zeros((num_classes,), bool), jnp.int32(0))

  def pair_loss(params, x_a, y_a, w_a, x_b, y_b, w_b):
    protos, counts = class_prototypes(encoder_features(module, params['phi'], x_a), y_a, w_a,
                                      num_classes)
    return prototype_loss(encoder_features(module, params['psi'], x_b), y_b, w_b, protos,
                          counts > 0, hparams.distance)

  grad_fn = jax.value_and_grad(pair_loss)

  def last_domain_sums(phi, data):
    x, y, mask = domain_block(data, layout, layout.num_domains - 1)
    onehot = jax.nn.one_hot(y, num_classes) * mask[:, None]
    return onehot.T @ encoder_features(module, phi, x), onehot.sum(0)

  def client_update(server_state: FedEvolveState, client_state, data, rng):
    budget = iteration_budget(data, layout, tau, hparams.tau_unit, batch_size)

    def iteration(carry, it):
      def pair(carry, m):
        params, opt_state, loss_sum = carry
        key = jax.random.fold_in(jax.random.fold_in(rng, it), m)
        x_a, y_a, w_a = domain_batch(data, layout, m, jax.random.fold_in(key, 0), batch_size)
        x_b, y_b, w_b = domain_batch(data, layout, m + 1, jax.random.fold_in(key, 1),
                                     batch_size)
        loss, grads = grad_fn(params, x_a, y_a, w_a, x_b, y_b, w_b)
        updates, new_opt = client_opt.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        active = it < budget
        return (select(active, new_params, params), select(active, new_opt, opt_state),
                loss_sum + jnp.where(active, loss, 0.0).astype(loss_sum.dtype)), None

      carry, _ = jax.lax.scan(pair, carry, jnp.arange(layout.num_domains - 1),
                              unroll=context.schedule.unroll)
      return carry, None

    params = server_state.params
    init_carry = (params, client_opt.init(params), jnp.float32(0.0))
    (params, _, loss_sum), _ = jax.lax.scan(iteration, init_carry, jnp.arange(iterations),
                                            unroll=context.schedule.unroll)
    sums, counts = last_domain_sums(params['phi'], data)
    steps = budget * (layout.num_domains - 1)
    metrics = {'loss': loss_sum / jnp.maximum(steps, 1), 'num_steps': steps.astype(jnp.float32)}
    update = {'params': base.tree_sub(params, server_state.params), 'proto_sums': sums,
              'proto_counts': counts}
    return ClientOutput(update, metrics), client_state

  def server_update(state: FedEvolveState, outputs: ClientOutput, weights) -> FedEvolveState:
    mean_delta = base.weighted_sum(outputs.update['params'], weights)
    updates, opt_state = server_opt.update(jax.tree.map(jnp.negative, mean_delta),
                                           state.opt_state, state.params)
    included = (weights > 0).astype(jnp.float32)
    sums = jnp.tensordot(included, outputs.update['proto_sums'], axes=1)
    counts = jnp.tensordot(included, outputs.update['proto_counts'], axes=1)
    prototypes = sums / jnp.maximum(counts, 1e-12)[:, None]
    return FedEvolveState(optax.apply_updates(state.params, updates), opt_state, prototypes,
                          counts > 0, state.round + 1)

  def classifier(psi, prototypes, present):
    return {'params': {'encoder': psi, 'head': prototype_head(prototypes, present)}}

  def personalize(state: FedEvolveState, client_state, data, rng):
    del client_state, rng
    sums, counts = last_domain_sums(state.params['phi'], data)
    return classifier(state.params['psi'], sums / jnp.maximum(counts, 1e-12)[:, None],
                      counts > 0)

  return FederatedAlgorithm(
      init=init, init_client_state=lambda state: (), client_update=client_update,
      server_update=server_update, personalize=personalize,
      global_model=lambda state: classifier(state.params['psi'], state.prototypes,
                                            state.present))
