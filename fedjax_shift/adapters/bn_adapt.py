"""BN-Adapt: Improving robustness against common corruptions by covariate shift
adaptation. Schneider et al., NeurIPS 2020, Eq. 2.

Each BatchNorm layer normalises with a mix of its source (running) statistics and the
test batch's statistics,  μ = p·μ_s + (1 − p)·μ_t,  σ² = p·σ²_s + (1 − p)·σ²_t,  with
prior p = N/(N + B) (N = 16 in the ATP authors' code). p = 1 is no
adaptation, p = 0 is pure test-batch statistics. Episodic by nature: nothing is kept.

``mixing``: 'batch' takes every layer's test statistics from one forward pass in which
each layer normalises with pure batch statistics (biased variance); 'layerwise' is the
ATP authors' baseline (their ModifiedBatchNorm2d): each layer's statistics are those of
its input as the mixed layers before it produce it, with the unbiased variance. The two
agree on the first BatchNorm up to the variance's B/(B − 1).
"""
from __future__ import annotations

import jax

from fedjax_shift import models
from fedjax_shift.adapters import common
from fedjax_shift.core.test_time import Adapter, register_constructor, test_batch_size
from fedjax_shift.registry import NONNEGATIVE, one_of


def prior_weight(prior_strength, batch_size: int):
  """p = N / (N + B); N = inf gives 1. N may be traced (a learned prior strength)."""
  if isinstance(prior_strength, (int, float)) and prior_strength == float('inf'):
    return 1.0
  return prior_strength / (prior_strength + batch_size)


MIXING = ('batch', 'layerwise')


@register_constructor('bn_adapt', from_context={'batch_size': test_batch_size},
                      ranges={'prior_strength': NONNEGATIVE,   # 0: the test batch alone
                              'mixing': one_of(*MIXING)},
                      learnable={'prior_strength': 'log'})
def bn_adapt(module, batch_size: int, prior_strength: float = 16.0,
             mixing: str = 'batch') -> Adapter:
  """Prior p = N / (N + B) of ``prior_strength`` N (the ATP authors' code: N = 16) at
  test batch ``batch_size`` B; N may be inf (p = 1, no adaptation) or traced (a learned
  prior strength); ``mixing``: 'batch' or 'layerwise' (module docstring)."""
  if isinstance(prior_strength, (int, float)) and not prior_strength >= 0.0:
    raise ValueError(f'bn_adapt prior_strength must be >= 0, got {prior_strength}')
  if mixing not in MIXING:
    raise ValueError(f'bn_adapt mixing: unknown {mixing!r}; choose from {list(MIXING)}')
  prior = prior_weight(prior_strength, batch_size)
  check = common.require_batch_norm('bn_adapt')

  def init(variables, rng):
    del rng
    check(variables)
    return variables

  def step(variables, batch):
    if mixing == 'layerwise':
      return variables, models.eval_with_mixed_statistics(module, variables, batch.x, prior)
    batch_stats = models.batch_statistics(module, variables, batch.x)
    mixed = jax.tree.map(lambda source, target: prior * source + (1.0 - prior) * target,
                         variables['batch_stats'], batch_stats)
    logits, _ = models.apply(module, {**variables, 'batch_stats': mixed}, batch.x)
    return variables, logits

  return Adapter(init, step)
