"""NOTE: Robust Continual Test-time Adaptation Against Temporal Correlation. Gong et al.,
NeurIPS 2022, Eq. 1–3 and Algorithm 1.

  * Instance-aware BatchNorm, IABN (Eq. 1–2): each example's own statistics over the
    spatial positions (μ_i, σ²_i over L = H·W values) correct the layer's statistics
    (μ, σ²) only where they differ by more than k = 4 standard errors,
      μ̃ = μ + ψ(μ_i − μ; k s_μ),  σ̃² = σ² + ψ(σ²_i − σ²; k s_σ²),
      s_μ = √((σ² + ε) / L),  s_σ² = (σ² + ε)·√(2 / (L − 1)),
    ψ the soft shrinkage; with L ≤ 1 (a dense layer) it is BatchNorm.
  * Prediction-balanced reservoir sampling, PBRS (Algorithm 1): a memory of N = 64 test
    examples with their predicted labels; a newcomer of a majority class replaces a
    random example of its class with probability m_c / n_c (stored / seen of that class),
    one of another class replaces a random example of a random majority class.
  * Every 64 examples the model learns on the memory: entropy minimisation of the
    BatchNorm affine parameters, one Adam step (lr 1e-4), BatchNorm normalising with the
    memory's statistics and moving its running statistics with momentum 0.01.
  * Predictions use the running statistics (IABN in prediction mode).
As the authors' code (github.com/TaesikGong/NOTE), but for two points: this library's
models are trained with BatchNorm, so IABN replaces it at test time only (theirs is in the
model from source training on), and a batch is predicted with the model as it was when
the batch arrived (theirs predicts example by example).
"""
from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_shift import models
from fedjax_shift.adapters import common
from fedjax_shift.core.local import select
from fedjax_shift.core.test_time import Adapter, class_count, example_shape, register_constructor
from fedjax_shift.parts import losses
from fedjax_shift.registry import NONNEGATIVE, POSITIVE_INT, interval


def soft_shrink(x, threshold):
  return jnp.sign(x) * jnp.maximum(jnp.abs(x) - threshold, 0.0)


def iabn_forward(module, variables, x: jax.Array, weight: jax.Array, k: float,
                 momentum: float, train: bool):
  """(logits [B, C], the running statistics after the pass) with IABN in every BatchNorm
  layer: in training its layer statistics are the input's (weighted by ``weight`` [B],
  unbiased) and the running ones move by ``momentum``; in prediction they are the running
  ones and stay."""
  updated = {}

  def iabn(next_fun, args, kwargs, context):
    layer = context.module
    if not (isinstance(layer, nn.BatchNorm) and context.method_name == '__call__'):
      return next_fun(*args, **kwargs)
    inputs = args[0]
    running_mean = layer.get_variable('batch_stats', 'mean')
    running_var = layer.get_variable('batch_stats', 'var')
    spatial = tuple(range(1, inputs.ndim - 1))
    length = int(np.prod([inputs.shape[a] for a in spatial])) if spatial else 1
    if train:
      w = weight.reshape((-1,) + (1,) * (inputs.ndim - 1))
      count = jnp.maximum(jnp.sum(weight) * length, 2.0)
      axes = tuple(range(inputs.ndim - 1))
      mean = jnp.sum(inputs * w, axes) / (count / 1.0)
      var = jnp.sum((inputs - mean) ** 2 * w, axes) / (count - 1)
      new_mean = (1 - momentum) * running_mean + momentum * jax.lax.stop_gradient(mean)
      new_var = (1 - momentum) * running_var + momentum * jax.lax.stop_gradient(var)
    else:
      mean, var, new_mean, new_var = running_mean, running_var, running_mean, running_var
    node = updated
    for part in layer.path:
      node = node.setdefault(part, {})
    node.update(mean=new_mean, var=new_var)
    if length > 1:    # the authors' skip threshold: 1
      instance_mean = jnp.mean(inputs, spatial, keepdims=True)
      instance_var = jnp.var(inputs, spatial, keepdims=True) * length / (length - 1)
      s_mean = jnp.sqrt((var + layer.epsilon) / length)
      s_var = (var + layer.epsilon) * np.sqrt(2.0 / (length - 1))
      mean = mean + soft_shrink(instance_mean - mean, k * s_mean)
      var = jax.nn.relu(var + soft_shrink(instance_var - var, k * s_var))
    out = (inputs - mean) * jax.lax.rsqrt(var + layer.epsilon)
    if layer.use_scale:
      out = out * layer.get_variable('params', 'scale')
    if layer.use_bias:
      out = out + layer.get_variable('params', 'bias')
    return out

  with nn.intercept_methods(iabn):
    logits = module.apply(variables, x, train=False)
  return logits, updated


class Reservoir(NamedTuple):
  """PBRS's N slots: x [N, ...], label [N], used [N]; seen [C] examples per class."""
  x: jax.Array
  label: jax.Array
  used: jax.Array
  seen: jax.Array


def empty_reservoir(capacity: int, shape, num_classes: int) -> Reservoir:
  return Reservoir(jnp.zeros((capacity,) + tuple(shape)), jnp.zeros((capacity,), jnp.int32),
                   jnp.zeros((capacity,), bool), jnp.zeros((num_classes,)))


def random_slot(key, mask):
  """A uniformly random index where ``mask`` [N] holds (mask has at least one)."""
  return jnp.argmax(jnp.where(mask, jax.random.uniform(key, mask.shape), -1.0))


def add_instance(reservoir: Reservoir, x, label, key, num_classes: int) -> Reservoir:
  """PBRS's add_instance for one example with predicted ``label``."""
  capacity = reservoir.used.shape[0]
  seen = reservoir.seen.at[label].add(1.0)
  counts = jnp.zeros((num_classes,)).at[reservoir.label].add(reservoir.used.astype(jnp.float32))
  largest = counts == jnp.max(counts)
  class_key, slot_key, coin_key = jax.random.split(key, 3)
  # not of a largest class: a random slot of a random largest class makes room
  other = random_slot(class_key, largest)
  in_other = reservoir.used & (reservoir.label == other)
  in_own = reservoir.used & (reservoir.label == label)
  victim = jnp.where(largest[label], random_slot(slot_key, in_own), random_slot(slot_key, in_other))
  replace = ~largest[label] | (jax.random.uniform(coin_key) <= counts[label] / seen[label])
  full = jnp.sum(reservoir.used) >= capacity
  add = ~full | replace
  slot = jnp.where(full, victim, jnp.argmin(reservoir.used))
  put = lambda array, value: jnp.where(add, array.at[slot].set(value), array)
  return Reservoir(put(reservoir.x, x), put(reservoir.label, label), put(reservoir.used, True),
                   seen)


class NOTEState(NamedTuple):
  variables: dict
  opt_state: optax.OptState
  reservoir: Reservoir
  seen: jax.Array     # [] examples of the stream so far
  updated: jax.Array  # [] bool: the last batch reached an update
  rng: jax.Array


@register_constructor(
    'note', from_context={'num_classes': class_count, 'example_shape': example_shape},
    ranges={**common.OPTIMIZER_RANGES, 'memory_size': POSITIVE_INT,
            'update_frequency': POSITIVE_INT, 'bn_momentum': interval(0, 1),
            'iabn_k': NONNEGATIVE},
    learnable={'learning_rate': 'log'}, streams=True)
def note(module, num_classes: int, example_shape: tuple, learning_rate: float = 1e-4,
         optimizer: str = 'adam', memory_size: int = 64, update_frequency: int = 64,
         bn_momentum: float = 0.01, iabn_k: float = 4.0) -> Adapter:
  """NOTE on inputs of ``example_shape`` with the authors' values: ``optimizer`` Adam at
  ``learning_rate`` 1e-4, a PBRS memory of ``memory_size`` 64 learnt on every
  ``update_frequency`` 64 examples, BatchNorm ``bn_momentum`` 0.01, IABN's k =
  ``iabn_k`` 4."""
  common.check_fields('note', choices={'optimizer': (optimizer, common.DIRECTIONS)})
  opt = common.make_optimizer(optimizer, learning_rate)
  check = common.require_batch_norm('note')
  field = 'note (BatchNorm affine parameters)'

  def learn(state: NOTEState, go) -> NOTEState:
    weight = state.reservoir.used.astype(jnp.float32)
    selected, rest = common.split_params(state.variables['params'], models.is_batch_norm_path,
                                         field)

    def loss(selected):
      variables = {**state.variables, 'params': common.join_params(selected, rest)}
      logits, stats = iabn_forward(module, variables, state.reservoir.x, weight, iabn_k,
                                   bn_momentum, True)
      return losses.weighted_entropy(logits, weight), stats

    (_, stats), grads = jax.value_and_grad(loss, has_aux=True)(selected)
    updates, opt_state = opt.update(grads, state.opt_state, selected)
    variables = {**state.variables, 'batch_stats': stats,
                 'params': common.join_params(optax.apply_updates(selected, updates), rest)}
    learned = state._replace(variables=variables, opt_state=opt_state)
    return select(go, learned, state)

  def enter(state: NOTEState, batch, labels, start, stop) -> NOTEState:
    rng, key = jax.random.split(state.rng)
    items = (batch.x, labels, jax.random.split(key, batch.x.shape[0]), batch.weight)
    add = lambda reservoir, x, label, k, weight: add_instance(reservoir, x, label, k, num_classes)
    return state._replace(reservoir=common.scan_entering(add, state.reservoir, items, start,
                                                         stop), rng=rng)

  def init(variables, rng):
    check(variables)
    selected, _ = common.split_params(variables['params'], models.is_batch_norm_path, field)
    return NOTEState(variables, opt.init(selected),
                     empty_reservoir(memory_size, example_shape, num_classes), jnp.int32(0),
                     jnp.bool_(False), rng)

  def step(state: NOTEState, batch):
    logits, _ = iabn_forward(module, state.variables, batch.x, batch.weight, iabn_k,
                             bn_momentum, False)
    labels = jnp.argmax(logits, -1)
    count = jnp.sum(batch.weight > 0).astype(jnp.int32)
    state = common.learn_every(state, state.seen, count, batch.x.shape[0], update_frequency,
                               lambda state, start, stop: enter(state, batch, labels, start, stop),
                               learn)
    return state._replace(seen=state.seen + count,
                          updated=common.reaches_update(state.seen, count, update_frequency)), logits

  def predict(state: NOTEState, batch):
    return iabn_forward(module, state.variables, batch.x, batch.weight, iabn_k, bn_momentum,
                        False)[0]

  return Adapter(init, step, predict, took_step=lambda state: state.updated,
                 stream_floor=(('config.adapters.note.memory_size', memory_size),
                               ('config.adapters.note.update_frequency', update_frequency)))
