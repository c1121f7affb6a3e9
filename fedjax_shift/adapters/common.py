"""Pieces shared by the test-time adapters: entropies, parameter subsets, checks,
and the one-optimizer-step-per-batch adapter."""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from fedjax_shift import models
from fedjax_shift.core.local import select
from fedjax_shift.core.test_time import Adapter
from fedjax_shift.registry import POSITIVE, one_of

PREDICT = ('before', 'after')
# Adam inside a differentiated test-time step (learned rates) takes √(v + ε_root): with
# ε_root = 0 a coordinate whose gradient is exactly 0 but depends on the parameters (the
# weights of a zero input: g = x·δ with x = 0) gives d√v/dv · dv/dg = ∞ · 0 = NaN in the
# meta-gradient (optax documents eps_root for gradients through Adam). 1e-30 changes no
# step: v + 1e-30 == v in float32 for every v above 1e-23.
ADAM_EPS_ROOT = 1e-30
# An adapter's ``optimizer`` field: the step direction, scaled by the learning rate.
DIRECTIONS = {'adam': functools.partial(optax.scale_by_adam, eps_root=ADAM_EPS_ROOT),
              'sgd': optax.identity}
# The ranges of an adapter's ``optimizer``, ``learning_rate`` and ``predict`` fields.
OPTIMIZER_RANGES = {'optimizer': one_of(*DIRECTIONS), 'learning_rate': POSITIVE}
PREDICT_RANGE = one_of(*PREDICT)


def split_params(params, is_selected: Callable[[Tuple[str, ...]], bool], field: str):
  """(selected, rest) flat dicts of ``params`` by path predicate; raises naming
  ``field`` when nothing is selected (a module list that does not match the model)."""
  flat = traverse_util.flatten_dict(params)
  selected = {p: v for p, v in flat.items() if is_selected(p)}
  if not selected:
    raise ValueError(f'{field}: selects no parameter of this model; its parameters are '
                     f'{sorted("/".join(p) for p in flat)}')
  rest = {p: v for p, v in flat.items() if not is_selected(p)}
  return selected, rest


def join_params(selected, rest):
  return traverse_util.unflatten_dict({**rest, **selected})


def layer_of(path) -> str:
  """The layer a flat parameter path belongs to ('encoder/BatchNorm_0')."""
  return '/'.join(str(part) for part in path[:-1])


def per_layer_rates(direction: optax.GradientTransformation, rates: Dict[str, jax.Array]
                    ) -> optax.GradientTransformation:
  """``direction`` (e.g. ``optax.scale_by_adam()``) scaled by −rate of each parameter's
  layer: ``rates`` {layer: []}; updates are the flat {path: leaf} dicts of
  ``gradient_adapter``. With every rate η it is the optimizer of rate η."""
  def scale(updates, params=None):
    del params
    return {path: -rates[layer_of(path)].astype(u.dtype) * u for path, u in updates.items()}
  return optax.chain(direction, optax.stateless(scale))


def make_optimizer(name: str, learning_rate) -> optax.GradientTransformation:
  """``name`` ('adam' | 'sgd') at ``learning_rate``: a float, or per-layer rates
  {layer: rate} (``per_layer_rates``, the form ``learned_rates`` trains); a traced rate
  (a learned one) takes Adam's ε_root (``ADAM_EPS_ROOT``)."""
  if isinstance(learning_rate, dict):
    return per_layer_rates(DIRECTIONS[name](), learning_rate)
  if name == 'adam' and not isinstance(learning_rate, (int, float)):   # a learned rate
    return optax.adam(learning_rate, eps_root=ADAM_EPS_ROOT)
  return optax.adam(learning_rate) if name == 'adam' else optax.sgd(learning_rate)


def check_predict(name: str, predict: str) -> None:
  if predict not in PREDICT:
    raise ValueError(f'{name} predict must be one of {PREDICT}, got {predict!r}')


def check_fields(name: str, choices: Optional[Dict[str, tuple]] = None,
                 at_least: Optional[Dict[str, tuple]] = None
                 ) -> None:
  """Errors naming ``config.adapters.<name>.<field>``: ``choices`` {field: (value,
  allowed)} must hold an allowed value, ``at_least`` {field: (value, minimum)} a value
  >= the minimum."""
  for field, (value, allowed) in (choices or {}).items():
    if value not in allowed:
      raise ValueError(f'config.adapters.{name}.{field}: unknown {value!r}; choose from '
                       f'{list(allowed)}')
  for field, (value, minimum) in (at_least or {}).items():
    if value < minimum:
      raise ValueError(f'config.adapters.{name}.{field}: must be >= {minimum}, got {value}')


def require_batch_norm(name: str) -> Callable:
  """A variables check raising when the model has no BatchNorm (BN-Adapt, Tent, EATA)."""
  def check(variables):
    if not models.has_batch_norm(variables):
      raise ValueError(f'{name} needs a model with BatchNorm; this model has none')
  return check


class GradientState(NamedTuple):
  """State of a gradient-based adapter: the model variables (only the selected
  parameters change), their optimizer state, and adapter-specific ``extra``."""
  variables: dict
  opt_state: optax.OptState
  extra: Any


def gradient_adapter(name: str, is_selected: Callable, select_field: str,
                     loss_fn: Callable, predict_fn: Callable,
                     opt: optax.GradientTransformation, predict: str,
                     init_extra: Callable = lambda variables: (),
                     check: Callable = lambda variables: None,
                     step_if: Optional[Callable[[Any], jax.Array]] = None,
                     took_step: Optional[Callable[[Any], jax.Array]] = None):
  """An ``Adapter`` taking one optimizer step per batch on a parameter subset.

  Args:
    is_selected: flat parameter path -> bool, the parameters the method updates.
    select_field: the config field named in the error when nothing is selected.
    loss_fn: (variables, batch, extra) -> (loss, (logits, new_extra)); logits are
      the ones computed before the update.
    predict_fn: (variables, x) -> logits, used when ``predict == 'after'`` and as the
      adapter's ``predict`` (the current model, no step).
    predict: 'before' | 'after' (which logits the method predicts with).
    step_if: (the new extra) -> [] bool: whether this batch takes its step; when
      False the parameters and the optimizer state stay bit-identical (EATA on a batch
      that keeps no example). None: every batch steps.
    took_step: (extra) -> [] bool reported as ``Adapter.took_step`` (the batches that
      stepped are counted in the metrics); None: not reported.
  """
  check_predict(name, predict)
  def init(variables, rng):
    del rng
    check(variables)
    selected, _ = split_params(variables['params'], is_selected, select_field)
    return GradientState(variables, opt.init(selected), init_extra(variables))

  def step(state, batch):
    selected, rest = split_params(state.variables['params'], is_selected, select_field)

    def objective(selected):
      variables = {**state.variables, 'params': join_params(selected, rest)}
      return loss_fn(variables, batch, state.extra)

    (_, (logits, extra)), grads = jax.value_and_grad(objective, has_aux=True)(selected)
    updates, opt_state = opt.update(grads, state.opt_state, selected)
    stepped = optax.apply_updates(selected, updates)
    if step_if is not None:
      go = step_if(extra)
      keep_old = lambda new, old: jnp.where(go, new, old)
      stepped = jax.tree.map(keep_old, stepped, selected)
      opt_state = jax.tree.map(keep_old, opt_state, state.opt_state)
    selected = stepped
    variables = {**state.variables, 'params': join_params(selected, rest)}
    if predict == 'after':
      logits = predict_fn(variables, batch.x)
    return GradientState(variables, opt_state, extra), logits

  def predict_current(state, batch):
    return predict_fn(state.variables, batch.x)

  return Adapter(init, step, predict_current, took_step=None if took_step is None else
                 lambda state: took_step(state.extra))


def learn_every(state, seen, count, batch_size: int, frequency: int, enter: Callable,
                learn: Callable):
  """A memory-based adapter's batch (RoTTA, NOTE): its ``count`` examples enter the
  memory one by one, and after each one that makes the stream's total a multiple of
  ``frequency`` the model learns. ``seen``: examples before this batch;
  ``enter(state, start, stop)`` adds the batch's examples start … stop − 1;
  ``learn(state, go)`` learns where ``go``. A batch of B reaches at most ⌈B/F⌉ updates,
  each computed and kept where it is reached."""
  done = 0
  for update in range(-(-batch_size // frequency)):
    point = frequency * (seen // frequency + update + 1) - seen
    state = learn(enter(state, done, jnp.minimum(point, count)), point <= count)
    done = jnp.minimum(point, count)
  return enter(state, done, count)


def reaches_update(seen, count, frequency: int) -> jax.Array:
  """[] bool: whether a batch of ``count`` examples after ``seen`` crosses a multiple of
  ``frequency`` (``learn_every`` then learns on it)."""
  return (seen + count) // frequency > seen // frequency


def scan_entering(add: Callable, memory, items: tuple, start, stop):
  """The memory (a NamedTuple whose field ``x`` holds the stored examples) after
  ``add(memory, *item)`` for the items (arrays with a leading B axis: the examples x
  first, the weight last) whose index is in [start, stop) and whose weight is > 0.

  The loop runs over [start, stop) alone (a ``fori_loop``; under vmap, to the clients'
  longest range) and moves slot indices, not examples: inside it ``memory.x`` is each
  slot's origin (−1: as it was, i: the batch's example i) and an item's x is its index,
  so an example is copied once, after the loop, not once per step. What enters decides
  which examples are kept, so no gradient flows through it."""
  batch_x = items[0]
  items, memory = jax.lax.stop_gradient((items, memory))
  origins = jnp.full(memory.x.shape[:1], -1, jnp.int32)

  def one(index, memory):
    item = [a[index] for a in items[1:]]
    return select(item[-1] > 0, add(memory, index, *item), memory)

  entered = jax.lax.fori_loop(start, stop, one, memory._replace(x=origins))
  moved = (entered.x >= 0).reshape((-1,) + (1,) * (batch_x.ndim - 1))
  return entered._replace(x=jnp.where(moved, batch_x[jnp.maximum(entered.x, 0)], memory.x))
