"""Local training of one client: masked mini-batches as index gathers, a step loop.

No Python iteration over batches: the client's examples are put in a random order
(real examples first, drawn from the client's key), step ``s`` reads positions
``s·B … s·B+B-1`` of that order modulo the client's example count. All shapes are
static, so one compilation serves every client and every round.

The step loop (``run_steps``) runs as many steps as the client has, not as many as
its padded size allows: a ``lax.while_loop`` on the client's own step count. Under
``vmap`` the loop runs until the last client of the batch is done, and a client that
is done passes through unchanged (its steps past its schedule are masked), so a
vmapped batch costs its largest client's steps — the engine groups clients of similar
size (``core/round.py``). Only ``unroll=True`` (every step unrolled, for XLA:CPU
convolutions) scans the static bound ``ceil(E·N/B)`` of the padded size N.

A batch only ever gathers real examples (positions wrap inside the client's own
data), so BatchNorm batch statistics never see padding; examples beyond the
epoch's end in the last batch carry loss weight 0.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, NamedTuple, Tuple

import jax
import jax.numpy as jnp
import optax

from fedjax_shift.core.algorithm import ClientData
from fedjax_shift.data import augment

PyTree = Any
# (params, model_state, x [B, ...], y [B], example_weight [B], rng) -> (loss, model_state)
LossFn = Callable[..., Tuple[jax.Array, PyTree]]


class LocalSchedule(NamedTuple):
  """Static local-training schedule.

  Attributes:
    batch_size: B.
    num_epochs: E; a client with n examples runs ceil(E·n / B) steps.
    num_steps: if > 0, every client runs exactly this many steps instead (data
      cycled), e.g. ATP's fixed α steps per round.
    max_examples: N, the padded client size (bounds the static step count).
    unroll: steps per loop iteration: an int U runs blocks of U steps (the last block
      masked past the client's steps); True unrolls every step of the static bound
      ``ceil(E·N/B)`` (of the data's padded size, which the loop backend rounds to the
      client's own size). XLA:CPU runs convolutions in rolled loops ~11x slower
      (BENCHMARKS.md); rolled loops compile faster on GPU/TPU.
    augmentation: names of ``data.augment.VIEW_AUGMENTATIONS`` applied in order to
      every training image of every batch (a fresh draw per example and step); () none.
  """
  batch_size: int
  num_epochs: int
  num_steps: int
  max_examples: int
  unroll: Any = 1
  augmentation: Tuple[str, ...] = ()

  @property
  def max_steps(self) -> int:
    return self.steps_bound(self.max_examples)

  def steps_bound(self, padded_examples: int) -> int:
    """Static step bound of a client padded to ``padded_examples``."""
    if self.num_steps > 0:
      return self.num_steps
    return max(1, math.ceil(self.num_epochs * padded_examples / self.batch_size))


def example_order(rng: jax.Array, mask: jax.Array) -> jax.Array:
  """A random order of the client's examples with real ones first. mask: [N] -> [N].

  Each example's sort key comes from ``fold_in(rng, index)``, so the order of a
  client's real examples does not depend on how far it is padded.
  """
  keys = jax.vmap(jax.random.fold_in, (None, 0))(rng, jnp.arange(mask.shape[0]))
  u = jax.vmap(jax.random.uniform)(keys)
  return jnp.argsort(jnp.where(mask, u, 2.0 + jnp.arange(mask.shape[0])))


def client_num_steps(schedule: LocalSchedule, data: ClientData) -> jax.Array:
  """Steps this client runs: its epoch schedule, capped by its straggler budget."""
  if schedule.num_steps > 0:
    steps = jnp.int32(schedule.num_steps)
  else:
    steps = -(-schedule.num_epochs * data.num_examples // schedule.batch_size)
  steps = jnp.minimum(steps, data.step_budget)
  return jnp.where(data.num_examples > 0, steps, 0)


def batch_at(schedule: LocalSchedule, data: ClientData, order: jax.Array,
             step: jax.Array) -> Tuple[jax.Array, jax.Array, jax.Array]:
  """Batch ``step``: (x [B, ...], y [B], example_weight [B])."""
  positions = step * schedule.batch_size + jnp.arange(schedule.batch_size)
  count = jnp.maximum(data.num_examples, 1)
  idx = order[positions % count]
  if schedule.num_steps > 0:
    weight = jnp.ones(schedule.batch_size)
  else:
    weight = (positions < schedule.num_epochs * data.num_examples).astype(jnp.float32)
  weight = weight * (data.num_examples > 0)
  return data.x[idx], data.y[idx], weight


def masked_mean(values: jax.Array, weight: jax.Array) -> jax.Array:
  """Σ w·v / max(Σ w, 1e-12): a mean that is 0, not NaN, when every weight is 0."""
  return jnp.sum(values * weight) / jnp.maximum(jnp.sum(weight), 1e-12)


def select(pred: jax.Array, on_true: PyTree, on_false: PyTree) -> PyTree:
  return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def run_steps(step_fn: Callable[[PyTree, jax.Array], PyTree], carry: PyTree,
              num_steps: jax.Array, bound: int, unroll: Any = 1) -> PyTree:
  """``carry = step_fn(carry, step)`` for step = 0 … num_steps − 1.

  A ``lax.while_loop`` on ``num_steps`` (traced; under vmap the loop runs to the batch's
  largest count and a lane whose count is reached keeps its carry). ``unroll``: an int
  U runs U steps per iteration, the ones past ``num_steps`` masked; True scans the
  static ``bound`` steps, every one unrolled and masked past ``num_steps`` — the form
  to use for reverse-mode differentiation through the whole loop (a while loop
  differentiates in forward mode only).
  """
  def masked(carry, step):
    return select(step < num_steps, step_fn(carry, step), carry), None

  if unroll is True:
    return jax.lax.scan(masked, carry, jnp.arange(bound), unroll=True)[0]
  block = max(1, int(unroll))

  def body(state):
    start, carry = state
    carry, _ = jax.lax.scan(masked, carry, start + jnp.arange(block), unroll=block)
    return start + block, carry

  return jax.lax.while_loop(lambda state: state[0] < num_steps, body,
                            (jnp.int32(0), carry))[1]


def local_train(loss_fn: LossFn, optimizer: optax.GradientTransformation, params: PyTree,
                model_state: PyTree, data: ClientData, rng: jax.Array,
                schedule: LocalSchedule, opt_state: PyTree = None
                ) -> Tuple[PyTree, PyTree, PyTree, Dict[str, jax.Array]]:
  """Runs the client's local steps.

  Returns (params, model_state, opt_state, metrics) with metrics
  {'loss': mean loss over the steps run, 'num_steps': steps run}.
  """
  order = example_order(jax.random.fold_in(rng, 0), data.mask)
  num_steps = client_num_steps(schedule, data)
  if opt_state is None:
    opt_state = optimizer.init(params)
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def step_fn(carry, step):
    params, model_state, opt_state, loss_sum = carry
    x, y, weight = batch_at(schedule, data, order, step)
    x = augment.augment_batch(jax.random.fold_in(jax.random.fold_in(rng, 2), step), x,
                              schedule.augmentation)
    step_rng = jax.random.fold_in(jax.random.fold_in(rng, 1), step)
    (loss, model_state), grads = grad_fn(params, model_state, x, y, weight, step_rng)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), model_state, opt_state,
            loss_sum + loss.astype(loss_sum.dtype))

  init = (params, model_state, opt_state, jnp.float32(0.0))
  params, model_state, opt_state, loss_sum = run_steps(
      step_fn, init, num_steps, schedule.steps_bound(data.mask.shape[0]), schedule.unroll)
  metrics = {'loss': loss_sum / jnp.maximum(num_steps, 1),
             'num_steps': num_steps.astype(jnp.float32)}
  return params, model_state, opt_state, metrics
