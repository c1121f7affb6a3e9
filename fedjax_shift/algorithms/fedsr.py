"""FedSR: A Simple and Effective Domain Generalization Method for Federated Learning.
Nguyen et al., NeurIPS 2022, Sec. 3 (Eq. 3–6).

A probabilistic representation z ~ N(μ(x), diag σ(x)²): μ is the encoder output, and
σ(x) = softplus(μ(x) W_σ + b_σ) a linear map on it. The head classifies a sample of z.
Two regularisers, with the paper's weights (FedEvolve App. D):

  L2R:  α_L2R · E‖z‖²                                   α_L2R = 0.01
  CMI:  α_CMI · KL(N(μ(x), σ(x)²) ‖ N(r_μ[y], r_σ[y]²))    α_CMI = 0.001

with a learnable per-class reference r (r_σ = softplus(r_ρ)). Everything (the model,
W_σ, b_σ, r) is averaged by FedAvg. The global model predicts with z = μ(x).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax

from fedjax_shift import models
from fedjax_shift.algorithms import base
from fedjax_shift.core.algorithm import FederatedAlgorithm
from fedjax_shift.core.local import masked_mean
from fedjax_shift.registry import NONNEGATIVE


def gaussian_kl(mean_q, std_q, mean_p, std_p) -> jax.Array:
  """KL(N(mean_q, std_q²) ‖ N(mean_p, std_p²)) summed over the last axis."""
  return jnp.sum(jnp.log(std_p / std_q) + (std_q ** 2 + (mean_q - mean_p) ** 2) /
                 (2 * std_p ** 2) - 0.5, -1)


@base.ALGORITHMS.register('fedsr', defaults={'l2r': 0.01, 'cmi': 0.001},  # FedEvolve App. D
                          ranges={'l2r': NONNEGATIVE, 'cmi': NONNEGATIVE},  # 0: term off
                          batch_norm=False)  # its probabilistic head
def fedsr(hparams: ml_collections.ConfigDict, context: base.BuildContext) -> FederatedAlgorithm:
  l2r, cmi = hparams.l2r, hparams.cmi
  module = context.module
  server_opt, client_opt = context.server_optimizer, context.client_optimizer
  num_classes = module.num_classes

  def init(rng, example_x):
    model_key, sr_key = jax.random.split(rng)
    variables = models.init(module, model_key, example_x)
    if set(variables) != {'params'}:
      raise ValueError('FedSR here needs a model without BatchNorm statistics (mlp, evolve_cnn)')
    dim = models.features(module, variables, example_x).shape[-1]
    params = {**variables['params'], 'fedsr': {
        'sigma_kernel': 0.01 * jax.random.normal(sr_key, (dim, dim)),
        'sigma_bias': jnp.zeros((dim,)),
        'ref_mean': jnp.zeros((num_classes, dim)),
        'ref_rho': jnp.zeros((num_classes, dim))}}
    return base.ServerState({'params': params}, server_opt.init(params), jnp.int32(0))

  def model_params(params):
    return {k: v for k, v in params.items() if k != 'fedsr'}

  def loss_fn(params, model_state, x, y, weight, rng):
    sr = params['fedsr']
    mean = models.features(module, {'params': model_params(params)}, x)
    std = jax.nn.softplus(mean @ sr['sigma_kernel'] + sr['sigma_bias']) + 1e-4
    z = mean + std * jax.random.normal(rng, mean.shape)
    logits = models.head({'params': params}, z)
    ce = masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, y), weight)
    reg_l2r = masked_mean(jnp.sum(z ** 2, -1), weight)
    ref_std = jax.nn.softplus(sr['ref_rho'][y]) + 1e-4
    reg_cmi = masked_mean(gaussian_kl(mean, std, sr['ref_mean'][y], ref_std), weight)
    return ce + l2r * reg_l2r + cmi * reg_cmi, model_state

  return base.params_averaging(
      init, loss_fn, client_opt, context,
      global_model=lambda state: {'params': model_params(state.variables['params'])})
