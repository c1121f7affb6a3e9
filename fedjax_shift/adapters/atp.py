"""ATP: adaptive test-time personalization (Bao, Wei, Wang & He, NeurIPS 2023;
Eqs. 4–5, Algorithm 2).

Each module (parameter tensor or BatchNorm running statistic) has one adaptation rate
α_l (parts/atp_rates.py). From one eval-mode forward on an unlabelled batch X (source statistics everywhere):

  h_l = ∇_{θ_l} H(f(X; θ))             parameters (Eq. 4: mean prediction entropy)
  h_l = μ_l^running − μ_l^batch(X)      BN running mean / variance (Eq. 5, var unbiased)
  θ'_l = θ_l − α_l · h_l                adapted model (running var clamped at 0)

ATP-batch adapts each test batch from θ (episodic mode); ATP-online uses the
cumulative mean of the h's seen so far (Algorithm 2, line 8: online mode). The
rates are learned on labelled source clients by ``fedjax_shift.algorithms.atp``.
"""
from __future__ import annotations

from typing import Dict, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_shift import models
from fedjax_shift.core.test_time import AdaptBatch, Adapter, SourceContext, register_constructor
from fedjax_shift.parts.atp_rates import Alpha, adapted_variables, check_alpha, update_direction


class ATPState(NamedTuple):
  variables: Dict      # θ_G, never changed
  alpha: Alpha
  mean_h: Alpha        # cumulative mean of the h's so far (online); h itself (batch)
  count: jax.Array     # [] batches seen


def learned_alpha(module, context: SourceContext) -> Alpha:
  """α from the source context, where the pipeline put it after α training."""
  del module
  if context.alpha is None:
    raise ValueError('atp: no learned alpha; the pipeline trains it before test time')
  return context.alpha


@register_constructor('atp', from_context={'alpha': learned_alpha},
                      learnable={'alpha': 'alpha'})
def atp(module, alpha: Alpha) -> Adapter:
  """ATP at test time. Episodic mode is ATP-batch, online mode ATP-online; both
  predict with the adapted model on the batch that produced h (Algorithm 2)."""

  def init(variables, rng):
    del rng
    check_alpha(alpha, variables)
    no_direction = jax.tree.map(jnp.zeros_like, {k: variables[k] for k in alpha})
    return ATPState(variables, alpha, no_direction, jnp.float32(0.0))

  def step(state: ATPState, batch: AdaptBatch):
    h, _ = update_direction(module, state.variables, batch.x, batch.weight)
    count = state.count + 1.0
    mean_h = jax.tree.map(lambda m, new: m + (new - m) / count, state.mean_h, h)
    adapted = adapted_variables(state.variables, state.alpha, mean_h)
    logits = models.apply(module, adapted, batch.x, 'eval')[0]
    return ATPState(state.variables, state.alpha, mean_h, count), logits

  return Adapter(init, step)
