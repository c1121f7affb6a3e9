"""CoTTA: Continual Test-Time Domain Adaptation. Wang et al., CVPR 2022, Eq. 1–6.

A student θ learns from a weight-averaged teacher θ', and every weight drifts back to
the source θ_0 at random:
  * the teacher's pseudo-label: its logits on the batch, or, when the source model's
    mean confidence on the batch is under p_th, the mean of its logits on N = 32
    augmented copies of the batch                                       (Eq. 2–3)
  * the student's loss: the cross-entropy −Σ_c softmax(teacher)_c log softmax(student)_c,
    averaged over the batch; one Adam step (lr 1e-3) on every parameter    (Eq. 4)
  * the teacher: θ' ← α θ' + (1 − α) θ, α = 0.999                          (Eq. 1)
  * stochastic restore: each weight element returns to its source value with
    probability p = 0.01                                                   (Eq. 5–6)
The prediction is the teacher's pseudo-label. As the authors' code
(github.com/qinenergy/cotta, CIFAR-10-C): BatchNorm on the batch's statistics in every
model, p_th = 0.92, one augmentation draw applied to the whole batch per copy. The
augmentations are ``fedjax_shift.data.augment``'s (``augmentation``: 'translate_rotate_jitter',
the geometric and photometric part of theirs, or 'crop_flip').
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_shift import models
from fedjax_shift.adapters import common
from fedjax_shift.core.local import masked_mean
from fedjax_shift.core.test_time import Adapter, register_constructor
from fedjax_shift.data.augment import MARGINAL_AUGMENTATIONS, SHARED_AUGMENTATIONS
from fedjax_shift.registry import FRACTION, POSITIVE_INT, interval, one_of


class CoTTAState(NamedTuple):
  student: dict             # θ, the model variables that take the steps
  teacher: dict             # θ' (its params a moving average of θ's)
  opt_state: optax.OptState
  source: dict              # θ_0
  rng: jax.Array


def batch_views(key: jax.Array, x: jax.Array, count: int, kind: str) -> jax.Array:
  """[count, B, ...] augmented copies of the batch x [B, ...], one random draw per copy
  shared by its examples (a torchvision transform applied to a batch tensor): copy i
  is ``SHARED_AUGMENTATIONS[kind]`` of ``split(key, count)[i]``."""
  return jax.vmap(lambda k: SHARED_AUGMENTATIONS[kind](k, x))(jax.random.split(key, count))


def soft_cross_entropy(logits: jax.Array, teacher_logits: jax.Array) -> jax.Array:
  """Per-example −Σ_c softmax(teacher)_c log softmax(logits)_c. [B, C] -> [B]."""
  return -jnp.sum(jax.nn.softmax(teacher_logits) * jax.nn.log_softmax(logits), -1)


# Where ``stochastic_restore`` draws the restored elements by their gaps, the
# probability it leaves some of them undrawn: exp(−RESTORE_TAIL) ≈ 4e-31.
RESTORE_TAIL = 70.0


def restore_gaps(size: int, probability) -> tuple:
  """(draws, cap) for ``stochastic_restore`` on a tensor of ``size``, or None where one
  Bernoulli draw per element is as cheap. ``draws``: n·p + t gaps, t from the Chernoff
  bound exp(−t² / 2(n·p + t/3)) = exp(−RESTORE_TAIL) on Binomial(n, p) > n·p + t;
  ``cap``: the largest gap kept, so that their int32 sum cannot overflow, and one beyond
  the tensor or with a tail (1 − p)^cap under exp(−RESTORE_TAIL)."""
  if not isinstance(probability, (int, float)) or not 0 < probability < 1:
    return None
  mean, third = size * probability, RESTORE_TAIL / 3
  draws = math.ceil(mean + third + math.sqrt(third ** 2 + 2 * RESTORE_TAIL * mean))
  cap = min(size + 1, (2 ** 31 - 1) // draws)
  if draws * 8 > size or (cap <= size and -cap * math.log1p(-probability) < RESTORE_TAIL):
    return None
  return draws, cap


def stochastic_restore(key: jax.Array, weights: jax.Array, source: jax.Array,
                       probability) -> jax.Array:
  """Eq. 5–6: each element of ``weights`` independently back to ``source``'s value with
  ``probability`` p (Bernoulli). [...] -> [...].

  Where n·p is small against the tensor's n elements, the restored ones are drawn as a
  Bernoulli process is, by its gaps: i.i.d. Geometric(p), 1 + ⌊log U / log(1 − p)⌋ with
  U from 32 random bits, their cumulative sums the positions (``restore_gaps``: about
  n·p of them, covering the tensor but with probability under 1e-30). That is about n·p
  random numbers instead of n, and a scatter of those elements instead of a select over
  all. Otherwise one Bernoulli draw per element."""
  if isinstance(probability, (int, float)) and probability == 0:
    return weights
  gaps = restore_gaps(weights.size, probability)
  if gaps is None:
    return jnp.where(jax.random.bernoulli(key, probability, weights.shape), source, weights)
  draws, cap = gaps
  bits = jax.random.bits(key, (draws,), jnp.uint32)
  uniform = (bits.astype(jnp.float32) + 0.5) * 2.0 ** -32           # in (0, 1]
  steps = jnp.minimum(1 + jnp.floor(jnp.log(uniform) / math.log1p(-probability)), cap)
  positions = jnp.cumsum(steps.astype(jnp.int32)) - 1              # increasing, >= 0
  taken = jnp.take(source.reshape(-1), positions, mode='fill', fill_value=0)
  return weights.reshape(-1).at[positions].set(taken, mode='drop').reshape(weights.shape)


def moving_average(teacher: dict, student: dict, rate) -> dict:
  """The teacher's params θ' ← rate·θ' + (1 − rate)·θ (other collections unchanged)."""
  params = jax.tree.map(lambda t, s: rate * t + (1 - rate) * s, teacher['params'],
                        student['params'])
  return {**teacher, 'params': params}


@register_constructor(
    'cotta', ranges={**common.OPTIMIZER_RANGES, 'teacher_rate': interval(0, 1),
                     'restore_probability': FRACTION, 'confidence_threshold': FRACTION,
                     'num_augmentations': POSITIVE_INT,
                     'augmentation': one_of(*MARGINAL_AUGMENTATIONS)},
    learnable={'learning_rate': 'log'}, streams=True)
def cotta(module, learning_rate: float = 1e-3, optimizer: str = 'adam',
          teacher_rate: float = 0.999, restore_probability: float = 0.01,
          confidence_threshold: float = 0.92, num_augmentations: int = 32,
          augmentation: str = 'translate_rotate_jitter') -> Adapter:
  """CoTTA with the authors' CIFAR-10-C values: ``optimizer`` Adam at ``learning_rate``
  1e-3 on every parameter, α = ``teacher_rate`` 0.999, restore p = ``restore_probability``
  0.01, p_th = ``confidence_threshold`` 0.92, N = ``num_augmentations`` 32 copies of
  ``augmentation``."""
  common.check_fields('cotta', choices={'optimizer': (optimizer, common.DIRECTIONS),
                                        'augmentation': (augmentation, MARGINAL_AUGMENTATIONS)})
  for field, value in (('restore_probability', restore_probability),
                       ('confidence_threshold', confidence_threshold),
                       ('teacher_rate', teacher_rate)):
    if isinstance(value, (int, float)) and not 0.0 <= value <= 1.0:
      raise ValueError(f'config.adapters.cotta.{field}: must be in [0, 1], got {value}')
  opt = common.make_optimizer(optimizer, learning_rate)

  def forward(variables, x):
    return models.apply(module, variables, x, 'batch_stats')[0]

  def init(variables, rng):
    return CoTTAState(variables, variables, opt.init(variables['params']), variables, rng)

  def step(state: CoTTAState, batch):
    rng, view_key, restore_key = jax.random.split(state.rng, 3)
    weight = batch.weight
    confidence = jnp.max(jax.nn.softmax(forward(state.source, batch.x)), -1)
    teacher_logits = forward(state.teacher, batch.x)
    views = batch_views(view_key, batch.x, num_augmentations, augmentation)
    averaged = jnp.mean(jax.vmap(lambda v: forward(state.teacher, v))(views), 0)
    pseudo = jnp.where(masked_mean(confidence, weight) < confidence_threshold, averaged,
                       teacher_logits)

    def loss(params):
      logits = forward({**state.student, 'params': params}, batch.x)
      return masked_mean(soft_cross_entropy(logits, jax.lax.stop_gradient(pseudo)), weight)

    params = state.student['params']
    grads = jax.grad(loss)(params)
    updates, opt_state = opt.update(grads, state.opt_state, params)
    student = {**state.student, 'params': optax.apply_updates(params, updates)}
    teacher = moving_average(state.teacher, student, teacher_rate)
    leaves, tree = jax.tree.flatten(student['params'])
    keys = jax.random.split(restore_key, len(leaves))
    source_leaves = jax.tree.leaves(state.source['params'])
    restored = [stochastic_restore(k, leaf, s, restore_probability)
                for k, leaf, s in zip(keys, leaves, source_leaves)]
    student = {**student, 'params': jax.tree.unflatten(tree, restored)}
    return CoTTAState(student, teacher, opt_state, state.source, rng), pseudo

  def predict(state: CoTTAState, batch):   # the teacher on the batch, no augmentation
    return forward(state.teacher, batch.x)

  return Adapter(init, step, predict)
