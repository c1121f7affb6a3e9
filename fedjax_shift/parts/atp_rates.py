"""ATP's per-module adaptation rates α (Bao, Wei, Wang & He, "Adaptive Test-Time
Personalization for Federated Learning", NeurIPS 2023; Eqs. 4–5): the unsupervised
update direction h, the adapted model θ' = θ − α ⊙ h and the CE of θ' that α is
trained on. Used by the α training (algorithms/atp.py), the ATP adapter
(adapters/atp.py) and the learned-rates rows (adapters/learned_rates.py).

A *module* is one parameter tensor or one BatchNorm running statistic (mean and
variance separately; BN scale/bias are parameter tensors), and each has one rate α_l
(23 modules for the ATP CNN, 102 for ResNet-18).
"""
from __future__ import annotations

from typing import Any, List, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util

from fedjax_shift import models
from fedjax_shift.core.local import masked_mean
from fedjax_shift.parts.losses import weighted_entropy

Alpha = Any          # {'params': tree of [] scalars, ['batch_stats': tree of [] scalars]}
SCALINGS = ('sqrt', 'none', 'numel')


def init_alpha(variables) -> Alpha:
  """α = 0 for every module of ``variables`` (ATP starts from no adaptation)."""
  modules = {'params': variables['params']}
  if models.has_batch_norm(variables):
    modules['batch_stats'] = variables['batch_stats']
  return jax.tree.map(lambda leaf: jnp.zeros((), jnp.float32), modules)


def module_names(alpha: Alpha) -> List[str]:
  """'params/encoder/Conv_0/kernel', 'batch_stats/encoder/BatchNorm_0/mean', … in
  the order of ``jax.tree.leaves(alpha)``."""
  paths = jax.tree_util.tree_flatten_with_path(alpha)[0]
  return ['/'.join(str(getattr(k, 'key', k)) for k in path) for path, _ in paths]


def check_alpha(alpha: Alpha, variables) -> None:
  """Raises ValueError when α's modules are not this model's modules."""
  expected = module_names(init_alpha(variables))
  got = module_names(alpha)
  if expected != got or any(np.ndim(a) for a in jax.tree.leaves(alpha)):
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    raise ValueError(f'atp alpha: its {len(got)} modules do not match the model\'s '
                     f'{len(expected)} (one scalar each); missing {missing[:5]}, '
                     f'unexpected {extra[:5]}')


def gradient_scale(variables, scaling: str) -> Alpha:
  """Per-module factor on ∂CE/∂α (the authors' code): 1/sqrt(numel) ('sqrt', the
  authors' default), 1/numel ('numel') or 1 ('none')."""
  if scaling not in SCALINGS:
    raise ValueError(f'atp.scaling must be one of {SCALINGS}, got {scaling!r}')
  power = {'sqrt': 0.5, 'numel': 1.0, 'none': 0.0}[scaling]
  modules = init_alpha(variables)
  sizes = {'params': variables['params'], **({'batch_stats': variables['batch_stats']}
                                             if 'batch_stats' in modules else {})}
  return jax.tree.map(lambda a, leaf: jnp.float32(1.0 / leaf.size ** power), modules, sizes)


def update_direction(module, variables, x: jax.Array, weight: jax.Array
                     ) -> Tuple[Alpha, jax.Array]:
  """(h, logits [B, C]) of one unlabelled batch x [B, ...] (Eq. 4–5), from one
  eval-mode forward. ``weight`` [B] masks repeated examples out of the entropy."""
  params, rest = variables['params'], {k: v for k, v in variables.items() if k != 'params'}

  def mean_entropy(params):
    logits, stats = models.eval_with_batch_statistics(module, {'params': params, **rest}, x)
    return weighted_entropy(logits, weight), (logits, stats)

  (_, (logits, stats)), grads = jax.value_and_grad(mean_entropy, has_aux=True)(params)
  h = {'params': grads}
  if models.has_batch_norm(variables):
    h['batch_stats'] = jax.tree.map(jnp.subtract, variables['batch_stats'], stats)
  return jax.lax.stop_gradient(h), logits


# How α's gradient passes the clamp of adapted running variances at 0 (the forward value
# is max(v, 0) either way):
#   'straight_through'  the authors' code: it clamps in place and dots ∂CE/∂θ' with the
#                       unclamped h, i.e. the clamp has derivative 1 (the default).
#   'zero'              the clamp's own derivative: clamped entries contribute 0.
# They differ when α_var > r / (r − b) for a channel (r running, b batch variance).
VARIANCE_CLAMPS = ('straight_through', 'zero')


def clamp_variance(v: jax.Array, clamp: str) -> jax.Array:
  if clamp == 'straight_through':
    return v + jax.lax.stop_gradient(jnp.maximum(v, 0.0) - v)
  if clamp == 'zero':
    return jnp.maximum(v, 0.0)
  raise ValueError(f'config.atp.variance_clamp: unknown {clamp!r}; choose from '
                   f'{list(VARIANCE_CLAMPS)}')


def adapted_variables(variables, alpha: Alpha, h: Alpha, clamp: str = 'straight_through'):
  """θ' = θ − α ⊙ h per module; adapted running variances clamped at ≥ 0 (``clamp``
  says how α's gradient passes the clamp: VARIANCE_CLAMPS)."""
  params = jax.tree.map(lambda w, a, d: w - a * d, variables['params'], alpha['params'],
                        h['params'])
  out = {**variables, 'params': params}
  if 'batch_stats' in alpha:
    stats = jax.tree.map(lambda s, a, d: s - a * d, variables['batch_stats'],
                         alpha['batch_stats'], h['batch_stats'])
    flat = traverse_util.flatten_dict(stats)
    flat = {p: clamp_variance(v, clamp) if p[-1] == 'var' else v for p, v in flat.items()}
    out['batch_stats'] = traverse_util.unflatten_dict(flat)
  return out


def alpha_loss(module, variables, alpha: Alpha, h: Alpha, x: jax.Array, y: jax.Array,
               weight: jax.Array, clamp: str = 'straight_through') -> jax.Array:
  """Masked mean CE of the adapted model θ − α⊙h (eval mode: the adapted running
  statistics normalise, so the CE gradient reaches the BN-statistic rates)."""
  logits = models.apply(module, adapted_variables(variables, alpha, h, clamp), x, 'eval')[0]
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
  return masked_mean(losses, weight)
