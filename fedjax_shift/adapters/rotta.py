"""RoTTA: Robust Test-Time Adaptation in Dynamic Scenarios. Yuan et al., CVPR 2023,
Eq. 3–9.

  * Robust BatchNorm (Eq. 3–4): in training passes every BatchNorm normalises with
    μ ← (1 − α)μ + α μ_b, σ² ← (1 − α)σ² + α σ²_b (α = 0.05, μ_b, σ²_b the input's
    biased batch statistics) and keeps them; in prediction it uses the kept μ, σ².
  * A category-balanced memory with uncertainty and time, CSTU (Eq. 5–6): each test
    example enters with the teacher's pseudo-label and entropy; its heuristic score
    H = λ_t / (1 + exp(−age / N)) + λ_u · entropy / ln C; a full class (N / C examples)
    or a full memory (N = 64) swaps out its highest-scored example (the majority
    classes' when the class is not full) if that one scores higher than the newcomer.
  * Every 64 examples (``update_frequency``), the student learns on the memory: the
    teacher's softmax on the memory as it is against the student's on a strong
    augmentation of it, each example weighted by exp(−a) / (1 + exp(−a)) of its age
    a = age / N (Eq. 8), one Adam step (lr 1e-3) on the BatchNorm affine parameters;
    then the teacher θ' ← (1 − ν)θ' + νθ, ν = 0.001 (Eq. 9).
  * The prediction is the teacher's, in prediction mode, before the batch enters.
As the authors' code (github.com/BIT-DA/RoTTA). Ties between equal heuristic scores go to
the highest memory slot (theirs: the last in class order). Wrapped repeats of a batch
(weight 0) do not enter the memory. The strong augmentation is ``augment``'s (one draw
for the memory batch, as a transform of a batch tensor).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_shift import models
from fedjax_shift.adapters import common
from fedjax_shift.core.local import select
from fedjax_shift.adapters.cotta import batch_views, soft_cross_entropy
from fedjax_shift.core.test_time import Adapter, class_count, example_shape, register_constructor
from fedjax_shift.data.augment import MARGINAL_AUGMENTATIONS
from fedjax_shift.registry import NONNEGATIVE, POSITIVE_INT, interval, one_of


def robust_forward(module, variables, x: jax.Array, weight: jax.Array, momentum):
  """Logits [B, C] of a training pass with Robust BatchNorm (Eq. 3–4), and the kept
  statistics (``variables['batch_stats']``'s tree): each layer mixes its statistics with
  the weighted (``weight`` [B]), biased batch statistics of its input."""
  kept = {}

  def robust(next_fun, args, kwargs, context):
    layer = context.module
    if not (isinstance(layer, nn.BatchNorm) and context.method_name == '__call__'):
      return next_fun(*args, **kwargs)
    inputs = args[0]
    axes = tuple(range(inputs.ndim - 1))
    w = jnp.broadcast_to(weight.reshape((-1,) + (1,) * (inputs.ndim - 1)),
                         inputs.shape[:-1] + (1,))
    total = jnp.maximum(jnp.sum(w), 1e-12)
    batch_mean = jnp.sum(inputs * w, axes) / total
    batch_var = jnp.sum((inputs - batch_mean) ** 2 * w, axes) / total
    mean = (1 - momentum) * layer.get_variable('batch_stats', 'mean') + momentum * batch_mean
    var = (1 - momentum) * layer.get_variable('batch_stats', 'var') + momentum * batch_var
    node = kept
    for part in layer.path:
      node = node.setdefault(part, {})
    node.update(mean=jax.lax.stop_gradient(mean), var=jax.lax.stop_gradient(var))
    out = (inputs - mean) * jax.lax.rsqrt(var + layer.epsilon)
    if layer.use_scale:
      out = out * layer.get_variable('params', 'scale')
    if layer.use_bias:
      out = out + layer.get_variable('params', 'bias')
    return out

  with nn.intercept_methods(robust):
    logits = module.apply(variables, x, train=False)
  return logits, kept


class Memory(NamedTuple):
  """CSTU's N slots: x [N, ...], label [N] int, uncertainty [N], age [N], used [N] bool."""
  x: jax.Array
  label: jax.Array
  uncertainty: jax.Array
  age: jax.Array
  used: jax.Array


def empty_memory(capacity: int, example_shape) -> Memory:
  return Memory(jnp.zeros((capacity,) + tuple(example_shape)), jnp.zeros((capacity,), jnp.int32),
                jnp.zeros((capacity,)), jnp.zeros((capacity,)), jnp.zeros((capacity,), bool))


def heuristic_score(age, uncertainty, capacity: int, num_classes: int, lambda_t, lambda_u):
  """Eq. 6: λ_t / (1 + exp(−age / N)) + λ_u · uncertainty / ln C."""
  return (lambda_t / (1 + jnp.exp(-age / capacity)) +
          lambda_u * uncertainty / math.log(num_classes))


def add_instance(memory: Memory, x, label, uncertainty, num_classes: int, lambda_t,
                 lambda_u) -> Memory:
  """CSTU's add_instance for one example, then every stored example ages by one."""
  capacity = memory.used.shape[0]
  per_class = capacity / num_classes
  counts = jnp.zeros((num_classes,)).at[memory.label].add(memory.used.astype(jnp.float32))
  new_score = heuristic_score(0.0, uncertainty, capacity, num_classes, lambda_t, lambda_u)
  has_room = counts[label] < per_class
  free = jnp.sum(memory.used) < capacity
  majority = counts == jnp.max(counts)
  # the classes an example may be swapped out of: the majority ones, or its own class
  candidates = memory.used & jnp.where(has_room, majority[memory.label], memory.label == label)
  scores = jnp.where(candidates, heuristic_score(memory.age, memory.uncertainty, capacity,
                                                 num_classes, lambda_t, lambda_u), -jnp.inf)
  victim = capacity - 1 - jnp.argmax(scores[::-1])    # the highest slot among the best
  swap = jnp.any(candidates) & (scores[victim] > new_score)
  add = (has_room & free) | swap
  slot = jnp.where(has_room & free, jnp.argmin(memory.used), victim)
  put = lambda array, value: jnp.where(add, array.at[slot].set(value), array)
  memory = Memory(put(memory.x, x), put(memory.label, label), put(memory.uncertainty, uncertainty),
                  put(memory.age, 0.0), put(memory.used, True))
  return memory._replace(age=memory.age + memory.used)


class RoTTAState(NamedTuple):
  student: dict
  teacher: dict
  opt_state: optax.OptState
  memory: Memory
  seen: jax.Array        # [] examples that entered the stream so far
  updated: jax.Array     # [] bool: the last batch reached an update
  rng: jax.Array


@register_constructor(
    'rotta', from_context={'num_classes': class_count, 'example_shape': example_shape},
    ranges={**common.OPTIMIZER_RANGES, 'memory_size': POSITIVE_INT,
            'update_frequency': POSITIVE_INT, 'teacher_rate': interval(0, 1),
            'bn_momentum': interval(0, 1), 'lambda_t': NONNEGATIVE, 'lambda_u': NONNEGATIVE,
            'augmentation': one_of(*MARGINAL_AUGMENTATIONS)},
    learnable={'learning_rate': 'log'}, streams=True)
def rotta(module, num_classes: int, example_shape: tuple, learning_rate: float = 1e-3, optimizer: str = 'adam',
          memory_size: int = 64, update_frequency: int = 64, teacher_rate: float = 0.001,
          bn_momentum: float = 0.05, lambda_t: float = 1.0, lambda_u: float = 1.0,
          augmentation: str = 'translate_rotate_jitter') -> Adapter:
  """RoTTA on inputs of ``example_shape`` with the authors' values: ``optimizer`` Adam at ``learning_rate`` 1e-3, a
  memory of ``memory_size`` 64 learnt on every ``update_frequency`` 64 examples, ν =
  ``teacher_rate`` 0.001, α = ``bn_momentum`` 0.05, λ_t = λ_u = 1."""
  common.check_fields('rotta', choices={'optimizer': (optimizer, common.DIRECTIONS),
                                        'augmentation': (augmentation, MARGINAL_AUGMENTATIONS)})
  if memory_size < num_classes:
    raise ValueError(f'config.adapters.rotta.memory_size: {memory_size} holds less than one '
                     f'example of each of the {num_classes} classes')
  opt = common.make_optimizer(optimizer, learning_rate)
  check = common.require_batch_norm('rotta')
  field = 'rotta (BatchNorm affine parameters)'

  def learn(state: RoTTAState, go) -> RoTTAState:
    """One update on the memory (Eq. 7–9); ``go`` False: the state as it was."""
    rng, key = jax.random.split(state.rng)
    memory = state.memory
    weight = memory.used.astype(jnp.float32)
    teacher_logits, teacher_stats = robust_forward(module, state.teacher, memory.x, weight,
                                                   bn_momentum)
    strong = batch_views(key, memory.x, 1, augmentation)[0]
    ages = memory.age / memory_size
    timeliness = jnp.exp(-ages) / (1 + jnp.exp(-ages))
    selected, rest = common.split_params(state.student['params'], models.is_batch_norm_path,
                                         field)

    def loss(selected):
      variables = {**state.student, 'params': common.join_params(selected, rest)}
      logits, stats = robust_forward(module, variables, strong, weight, bn_momentum)
      per_example = soft_cross_entropy(logits, jax.lax.stop_gradient(teacher_logits))
      return jnp.sum(per_example * timeliness * weight) / jnp.maximum(jnp.sum(weight), 1), stats

    (_, student_stats), grads = jax.value_and_grad(loss, has_aux=True)(selected)
    updates, opt_state = opt.update(grads, state.opt_state, selected)
    stepped = optax.apply_updates(selected, updates)
    student = {**state.student, 'batch_stats': student_stats,
               'params': common.join_params(stepped, rest)}
    # Eq. 9 on the parameters that move; the others are the source's in both models
    teacher_selected, teacher_rest = common.split_params(
        state.teacher['params'], models.is_batch_norm_path, field)
    teacher = {**state.teacher, 'batch_stats': teacher_stats,
               'params': common.join_params(jax.tree.map(
                   lambda t, s: (1 - teacher_rate) * t + teacher_rate * s, teacher_selected,
                   stepped), teacher_rest)}
    learned = state._replace(student=student, teacher=teacher, opt_state=opt_state)
    return select(go, learned, state)._replace(rng=rng)

  def enter(state: RoTTAState, batch, labels, entropies, start, stop) -> RoTTAState:
    add = lambda memory, x, label, uncertainty, weight: add_instance(
        memory, x, label, uncertainty, num_classes, lambda_t, lambda_u)
    return state._replace(memory=common.scan_entering(
        add, state.memory, (batch.x, labels, entropies, batch.weight), start, stop))

  def init(variables, rng):
    check(variables)
    selected, _ = common.split_params(variables['params'], models.is_batch_norm_path, field)
    return RoTTAState(variables, variables, opt.init(selected),
                      empty_memory(memory_size, example_shape), jnp.int32(0), jnp.bool_(False),
                      rng)

  def step(state: RoTTAState, batch):
    logits = models.apply(module, state.teacher, batch.x)[0]
    probs = jax.nn.softmax(logits)
    labels = jnp.argmax(probs, -1)
    entropies = -jnp.sum(probs * jnp.log(probs + 1e-6), -1)
    count = jnp.sum(batch.weight > 0).astype(jnp.int32)
    state = common.learn_every(
        state, state.seen, count, batch.x.shape[0], update_frequency,
        lambda state, start, stop: enter(state, batch, labels, entropies, start, stop), learn)
    state = state._replace(seen=state.seen + count,
                           updated=common.reaches_update(state.seen, count, update_frequency))
    return state, logits

  return Adapter(init, step, lambda state, batch: models.apply(module, state.teacher, batch.x)[0],
                 took_step=lambda state: state.updated,
                 stream_floor=(('config.adapters.rotta.update_frequency', update_frequency),))
