"""MEMO: Test Time Robustness via Adaptation and Augmentation. Zhang et al.,
NeurIPS 2022, Algorithm 1.

For each test example x separately: draw A = 32 augmentations, take one SGD step
(lr 0.005) on all parameters to minimise the entropy of the marginal prediction
p̄ = (1/A) Σ_a p(y | aug_a(x)), then predict x with the adapted parameters; the
model is reset for the next example (episodic per example, so the engine's mode
does not matter). Examples of a batch adapt independently (vmap over examples).
The augmentations are ``fedjax_shift.data.augment`` (JAX, vmappable):
'translate_rotate_jitter' (the default, the cheap part of MEMO's AugMix) or 'crop_flip'
(the ATP authors' baseline: 16 views of a padded random crop and a horizontal flip,
SGD at their lr 0.1, set by configs/atp.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_shift import models
from fedjax_shift.core.test_time import Adapter, register_constructor
from fedjax_shift.data.augment import MARGINAL_AUGMENTATIONS, augment_many
from fedjax_shift.registry import POSITIVE, POSITIVE_INT, one_of


def marginal_entropy(logits: jax.Array) -> jax.Array:
  """H((1/A) Σ_a softmax(logits_a)) for logits [A, C], computed in log space."""
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  log_mean = jax.scipy.special.logsumexp(log_probs, axis=0) - jnp.log(logits.shape[0])
  return -jnp.sum(jnp.exp(log_mean) * log_mean)


@register_constructor('memo', ranges={
    'num_augmentations': POSITIVE_INT, 'learning_rate': POSITIVE, 'num_steps': POSITIVE_INT,
    'augmentation': one_of(*MARGINAL_AUGMENTATIONS)}, learnable={'learning_rate': 'log'})
def memo(module, num_augmentations: int = 32, learning_rate: float = 0.005,
         num_steps: int = 1, augmentation: str = 'translate_rotate_jitter', *,
         mode: str = 'eval') -> Adapter:
  """MEMO's A = 32 augmentations and SGD lr 0.005, one step per test point;
  ``num_steps``: SGD steps per example, each on fresh augmentations (FedEvolve: 3);
  ``augmentation``: a name of ``augment.MARGINAL_AUGMENTATIONS``; ``mode``: the
  BatchNorm mode of the forward passes ('eval': running statistics)."""
  if augmentation not in MARGINAL_AUGMENTATIONS:
    raise ValueError(f'memo augmentation: unknown {augmentation!r}; choose from '
                     f'{sorted(MARGINAL_AUGMENTATIONS)}')
  if num_augmentations < 1:
    raise ValueError(f'memo num_augmentations must be >= 1, got {num_augmentations}')
  if num_steps < 1:
    raise ValueError(f'memo num_steps must be >= 1, got {num_steps}')

  def adapt_one(variables, x, key):
    params, rest = variables['params'], {k: v for k, v in variables.items() if k != 'params'}
    for step in range(num_steps):
      step_key = key if step == 0 else jax.random.fold_in(key, step)
      views = augment_many(step_key, x, num_augmentations, augmentation)
      loss = lambda p: marginal_entropy(models.apply(module, {'params': p, **rest}, views,
                                                     mode)[0])
      grads = jax.grad(loss)(params)
      params = jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)
    return models.apply(module, {'params': params, **rest}, x[None], 'eval')[0][0]

  def init(variables, rng):
    return variables, rng

  def step(state, batch):
    variables, rng = state
    rng, batch_key = jax.random.split(rng)
    keys = jax.random.split(batch_key, batch.x.shape[0])
    logits = jax.vmap(adapt_one, (None, 0, 0))(variables, batch.x, keys)
    return (variables, rng), logits

  return Adapter(init, step)

