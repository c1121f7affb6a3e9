"""The compiled round: sampling, gather, vmapped client updates, aggregation.

``build_round`` returns ONE jitted function per run. Two data placements:

* device store (default): the whole [K, N, ...] population lives on the
  accelerator; sampling and the cohort gather happen inside the compiled round.
* host store (``HostStore``): populations larger than device memory keep [K, N]
  in host numpy; the same sampling function picks the cohort, only the cohort is
  copied to the device, and the next round's cohort is gathered and transferred
  while the current round runs. Both placements draw identical cohorts.

Keys: round r uses ``round_key = fold_in(seed_key, r)``; sampling, client and
straggler keys are ``fold_in(round_key, 0 | 1 | 2)``, and client k's key is
``fold_in(client_key, k)`` — a function of the client id, not its cohort slot.
"""
from __future__ import annotations

import concurrent.futures
import functools
import os
import re
from typing import Any, Dict, NamedTuple, Optional, Tuple, Union

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fedjax_shift.core.algorithm import ClientData, FederatedAlgorithm
from fedjax_shift.core.local import LocalSchedule
from fedjax_shift.data.federated import FederatedData
from fedjax_shift.data.store import ClientStore, FirstUseCheck, gather_clients, mapped_file

# A population: padded (FederatedData [K, N, ...]) or stored compactly (ClientStore).
Store = Union[FederatedData, ClientStore]

PyTree = Any
SAMPLING = ('uniform', 'num_examples')
WEIGHTING = ('num_examples', 'uniform')
NO_STEP_LIMIT = np.iinfo(np.int32).max


class RoundConfig(NamedTuple):
  """Static options of the compiled round.

  Attributes:
    cohort_size: C clients per round, sampled without replacement.
    sampling: 'uniform' or 'num_examples' (probability ∝ client size).
    weighting: aggregation weights, 'num_examples' or 'uniform' (empty clients 0).
    straggler_prob: r, the chance a client is a straggler this round.
    straggler_max_steps: τ; a straggler runs uniform 1..τ local steps.
    client_chunk: 0 vmaps the whole cohort at once; c > 0 sorts the cohort by
      examples (largest first) and vmaps groups of c clients one after another
      (``lax.map``), each group looping to ITS largest client's steps: a round's
      scanned steps follow its real ones on skewed client sizes, and a group holds
      C/c times less activation memory. c need not divide C: the last group is
      filled with empty clients (no steps, never aggregated). ``fit_client_chunk``
      picks c from the population's sizes.
    group_examples: per group of the sorted cohort (most examples first), the
      examples its clients are cut to: a static bound of the sizes the group can hold
      (``plan_group_examples``); () keeps every client at the padded N.
    fallback_examples: () when ``group_examples`` hold every cohort; otherwise they
      hold the likely ones (``likely_group_bounds``) and these, every cohort's
      (``group_bounds``): a round whose cohort exceeds ``group_examples`` in some group
      runs at these instead (one ``lax.cond``; metric 'fallback_plan' 1).
    example_buckets: the loop backend's padded client sizes, ascending: a client runs
      cut to the smallest bucket that holds it (one compilation per bucket); () the
      padded N.
    schedule: the local schedule, for the scanned-step count (its unroll).
  """
  cohort_size: int
  sampling: str = 'uniform'
  weighting: str = 'num_examples'
  straggler_prob: float = 0.0
  straggler_max_steps: int = 1
  client_chunk: int = 0
  group_examples: Tuple[int, ...] = ()
  fallback_examples: Tuple[int, ...] = ()
  example_buckets: Tuple[int, ...] = ()
  schedule: Optional[LocalSchedule] = None


def round_key(seed_key: jax.Array, round_index: int) -> jax.Array:
  return jax.random.fold_in(seed_key, round_index)


# Populations above this many clients draw a cohort as the top C of K random keys
# (``sample_cohort``).
LARGE_POPULATION = 16_384


def sample_cohort(key: jax.Array, num_examples: jax.Array, config: RoundConfig) -> jax.Array:
  """Cohort client ids [C] drawn without replacement from the K clients.

  Up to ``LARGE_POPULATION`` clients, ``jax.random.choice``: a shuffle of all K
  clients (uniform) or a sort of K Gumbel keys (∝ size). Above it, the same
  distributions as the C largest of K keys (``lax.top_k``: uniform keys, or Gumbel
  keys plus log-probabilities), 40× cheaper at 100,000 clients on a CPU (1.1 against
  46 ms a round) — other cohorts than ``choice`` draws from the same key."""
  num_clients = num_examples.shape[0]
  key = jax.random.fold_in(key, 0)
  probs = None
  if config.sampling == 'num_examples':
    probs = num_examples / jnp.maximum(jnp.sum(num_examples), 1)
  if num_clients > LARGE_POPULATION:
    if probs is None:
      scores = jax.random.uniform(key, (num_clients,))
    else:
      scores = jax.random.gumbel(key, (num_clients,)) + jnp.log(probs)
    return jax.lax.top_k(scores, config.cohort_size)[1].astype(jnp.int32)
  return jax.random.choice(key, num_clients, (config.cohort_size,), replace=False,
                           p=probs).astype(jnp.int32)


def step_budgets(key: jax.Array, cohort_size: int, config: RoundConfig) -> jax.Array:
  """[C] local-step caps: stragglers get uniform 1..τ, the rest no cap."""
  key = jax.random.fold_in(key, 2)
  straggle_key, steps_key = jax.random.split(key)
  is_straggler = jax.random.bernoulli(straggle_key, config.straggler_prob, (cohort_size,))
  steps = jax.random.randint(steps_key, (cohort_size,), 1, config.straggler_max_steps + 1)
  return jnp.where(is_straggler, steps, NO_STEP_LIMIT).astype(jnp.int32)


def aggregation_weights(num_examples: jax.Array, weighting: str) -> jax.Array:
  """[C] weights summing to 1; clients without examples get 0; all 0 if none has data."""
  has_data = (num_examples > 0).astype(jnp.float32)
  raw = num_examples.astype(jnp.float32) if weighting == 'num_examples' else has_data
  return raw / jnp.maximum(jnp.sum(raw), 1e-12)


def map_clients(fn, in_axes, chunk: int, shard=None):
  """``vmap(fn, in_axes)`` over the client axis, or over chunks of ``chunk`` clients
  run sequentially with ``lax.map`` (same results, less memory). ``chunk`` must divide
  the client axis; ``shard`` (a pytree -> pytree constraint) is applied to each
  vmapped chunk's inputs."""
  shard = shard or (lambda tree: tree)
  vmapped = jax.vmap(fn, in_axes)

  def sharded(*args):
    return vmapped(*[shard(a) if axis is not None else a for a, axis in zip(args, in_axes)])

  if not chunk:
    return sharded

  def chunked(*args):
    mapped = [a for a, axis in zip(args, in_axes) if axis is not None]
    size = jax.tree_util.tree_leaves(mapped)[0].shape[0]
    if size % chunk:
      raise ValueError(f'client_chunk={chunk} must divide the cohort size {size}')
    if size == chunk:
      return sharded(*args)
    split = lambda leaf: leaf.reshape((size // chunk, chunk) + leaf.shape[1:])

    def body(chunk_args):
      it = iter(chunk_args)
      return sharded(*[next(it) if axis is not None else a for a, axis in zip(args, in_axes)])

    out = jax.lax.map(body, tuple(jax.tree.map(split, a) for a in mapped))
    return jax.tree.map(lambda leaf: leaf.reshape((size,) + leaf.shape[2:]), out)

  return chunked


def client_rows(source: Store, rows: jax.Array, budgets: jax.Array,
                examples: Optional[int] = None, real: Optional[jax.Array] = None
                ) -> ClientData:
  """ClientData [R, ...] of ``source``'s clients ``rows`` [R] (None: all, in order),
  cut to their first ``examples`` (None: all N), with step budgets [R]; slots where
  ``real`` [R] is False are empty clients (no examples, no steps)."""
  if isinstance(source, ClientStore):
    rows = jnp.arange(source.num_clients) if rows is None else rows
    x, y, mask, num_examples = gather_clients(source, rows, examples)
  else:
    def cut(leaf):
      leaf = leaf if rows is None else leaf[rows]
      return leaf if examples is None else leaf[:, :examples]

    x, y, mask, num_examples = cut(source.x), cut(source.y), cut(source.mask), cut(
        source.num_examples[:, None])[:, 0]
  if real is not None:
    mask = mask & real[:, None]
    num_examples = jnp.where(real, num_examples, 0)
    budgets = jnp.where(real, budgets, 0)
  return ClientData(x, y, mask, num_examples, budgets)


def run_cohort(client_update, config: RoundConfig, server_state, cohort_states,
               source: Store, rows: Optional[jax.Array], budgets: jax.Array,
               client_keys, shard=None):
  """``client_update`` over the C clients ``rows`` [C] of ``source`` (the store; None:
  ``source`` is the cohort) -> ((outputs [C], states [C]), scanned steps or None,
  1/0 whether the round ran ``config.fallback_examples`` or None without them).

  With ``config.client_chunk`` c < C the clients run sorted by examples (most first)
  in ceil(C/c) vmapped groups of c, one group after another, so that each group's step
  loop ends with its own largest client; group g's clients are cut to
  ``config.group_examples[g]`` examples (a static bound of the sizes it can hold), so
  that the data a round copies follows the cohort's real sizes too. Groups of one
  size run as one ``lax.map``. Slots past C in the last group hold empty clients (0
  examples, 0 steps) whose outputs are dropped. Outputs come back in cohort order.
  """
  size = budgets.shape[0]
  width = config.client_chunk or size
  in_axes = (None, 0, 0, 0)
  if width >= size:   # one group: no sorting
    data = client_rows(source, rows, budgets, (config.group_examples or (None,))[0])
    outputs = map_clients(client_update, in_axes, 0, shard)(server_state, cohort_states, data,
                                                             client_keys)
    return outputs, scanned_steps(outputs[0].metrics, size, config.schedule), None
  width = min(width, size)
  groups = -(-size // width)
  if rows is None:
    rows = jnp.arange(size)
  order = jnp.argsort(-source.num_examples[rows], stable=True)

  def run(examples: Tuple[Optional[int], ...]):
    """The groups of ``width`` clients of the cohort sorted by ``order``, group g cut to
    ``examples[g]`` -> ((outputs, states) in sorted order, scanned)."""
    if len(examples) != groups:
      raise ValueError(f'group_examples has {len(examples)} sizes for {groups} groups of '
                       f'{width} clients')
    padded = groups * width
    slots = jnp.concatenate([order, jnp.zeros(padded - size, order.dtype)])
    real = jnp.arange(padded) < size
    outputs, scanned, start = [], [], 0
    while start < groups:   # runs of groups with one example size: one lax.map each
      stop = start + 1
      while stop < groups and examples[stop] == examples[start]:
        stop += 1
      part = slots[start * width:stop * width]
      data = client_rows(source, rows[part], budgets[part], examples[start],
                         real[start * width:stop * width])
      out = map_clients(client_update, in_axes, width, shard)(
          server_state, take_clients(cohort_states, part), data,
          take_clients(client_keys, part))
      outputs.append(out)
      scanned.append(scanned_steps(out[0].metrics, width, config.schedule, examples[start]))
      start = stop
    outputs = jax.tree.map(lambda *leaves: jnp.concatenate(leaves)[:size], *outputs)
    return outputs, None if scanned[0] is None else sum(scanned)

  if not config.fallback_examples:
    outputs, scanned = run(config.group_examples or (None,) * groups)
    fallback = None
  else:   # the likely plan, or the plan every cohort fits where this one exceeds it
    leaders = source.num_examples[rows][order][::width]   # each group's largest client
    fits = jnp.all(leaders <= jnp.asarray(config.group_examples, leaders.dtype))
    (outputs, scanned), fallback = jax.lax.cond(
        fits, lambda: (run(config.group_examples), jnp.float32(0)),
        lambda: (run(config.fallback_examples), jnp.float32(1)))
  inverse = jnp.argsort(order)   # cohort slot -> its sorted position
  return take_clients(outputs, inverse), scanned, fallback


def scanned_steps(metrics: Dict[str, jax.Array], width: int,
                  schedule: Optional[LocalSchedule], examples: Optional[int] = None
                  ) -> Optional[jax.Array]:
  """Local steps a vmapped run of the clients in groups of ``width`` iterates, from the
  clients' reported 'num_steps' [C'] (C' a multiple of ``width``): per group, width ×
  its largest count (rounded up to the schedule's unroll block), or × the static bound
  of clients padded to ``examples`` (None: the schedule's N) when every step is
  unrolled. None when the method reports no 'num_steps'."""
  if 'num_steps' not in metrics:
    return None
  steps = metrics['num_steps'].reshape(-1, width)
  longest = jnp.max(steps, axis=1)
  unroll = 1 if schedule is None else schedule.unroll
  if unroll is True:
    longest = jnp.full_like(longest, schedule.steps_bound(examples or schedule.max_examples))
  elif int(unroll) > 1:
    longest = jnp.ceil(longest / int(unroll)) * int(unroll)
  return jnp.sum(longest * width)


def take_clients(tree: PyTree, client_ids: jax.Array) -> PyTree:
  return jax.tree.map(lambda leaf: leaf[client_ids], tree)


def put_clients(tree: PyTree, client_ids: jax.Array, values: PyTree) -> PyTree:
  return jax.tree.map(lambda leaf, value: leaf.at[client_ids].set(value), tree, values)


def stack_client_states(algorithm: FederatedAlgorithm, server_state: PyTree,
                        num_clients: int) -> PyTree:
  """[K_total, ...] per-client states, each the algorithm's initial client state."""
  one = algorithm.init_client_state(server_state)
  return jax.tree.map(lambda leaf: jnp.broadcast_to(leaf, (num_clients,) + jnp.shape(leaf)), one)


class RoundOutput(NamedTuple):
  server_state: PyTree
  client_states: PyTree
  metrics: Dict[str, jax.Array]  # weighted means over the cohort + per-client arrays


BACKENDS = ('vmap', 'loop')


def _check_cohort(config: RoundConfig, cohort: Store, cohort_ids) -> None:
  clients = cohort.num_examples.shape[0]
  if clients != config.cohort_size or cohort_ids.shape != (config.cohort_size,):
    raise ValueError(f'the round was built for cohort_size={config.cohort_size} but got '
                     f'{clients} clients and {cohort_ids.shape[0]} ids')


def _finish_round(algorithm: FederatedAlgorithm, config: RoundConfig, server_state,
                  client_states, cohort_num_examples, cohort_ids, outputs, new_states,
                  scanned=None, fallback=None) -> 'RoundOutput':
  """Weighted server update, client-state scatter and round metrics: the weighted means
  of the clients' metrics, where clients report 'num_steps' the round's 'local_steps'
  (their sum) and 'scanned_steps' (what the compiled loops iterated), and with a
  fallback plan 'fallback_plan' (1 when this cohort ran at it)."""
  weights = aggregation_weights(cohort_num_examples, config.weighting)
  server_state = algorithm.server_update(server_state, outputs, weights)
  client_states = put_clients(client_states, cohort_ids, new_states)
  metrics = {name: jnp.sum(weights * value) for name, value in outputs.metrics.items()}
  metrics['cohort_examples'] = jnp.sum(cohort_num_examples)
  if 'num_steps' in outputs.metrics:
    metrics['local_steps'] = jnp.sum(outputs.metrics['num_steps'])
    metrics['scanned_steps'] = metrics['local_steps'] if scanned is None else scanned
  if fallback is not None:
    metrics['fallback_plan'] = fallback
  metrics['cohort'] = cohort_ids
  if 'loss' in outputs.metrics:
    metrics['client_loss'] = outputs.metrics['loss']
  return RoundOutput(server_state, client_states, metrics)


def build_round(algorithm: FederatedAlgorithm, config: RoundConfig,
                mesh: Optional[Mesh] = None, donate: bool = False, backend: str = 'vmap',
                rounds_per_call: int = 1, check_data: bool = True):
  """Returns ``(round_device, round_host)``.

  With ``rounds_per_call`` R > 1, round_device is instead
  ``rounds(server_state, client_states, store, keys [R], active [R])``: R rounds as one
  compiled ``lax.scan`` (``_scan_rounds``), metrics stacked [R, ...].

  round_device(server_state, client_states, store: Store, round_key)
      samples, gathers and trains in one compiled call.
  round_host(server_state, client_states, cohort: Store, cohort_ids, round_key)
      trains a cohort gathered on the host (see HostStore).
  Both return RoundOutput; metrics hold 'cohort' ids [C] and per-client
  'client_loss' [C] beside the weighted means.

  ``backend='vmap'`` (the product) jits each as one program. ``backend='loop'``
  runs the same computation as a Python loop over a jitted ``client_update``
  (fedjax-style; a debug backend whose errors name the client, and the faster one
  for convolutional models on XLA:CPU); it does not support ``mesh``.

  Each data object either is called with is checked the first time it is seen
  (``store.FirstUseCheck``: shapes, finite inputs, labels in [0, algorithm.num_classes));
  ``check_data=False`` for callers that validated their data already (the pipelines:
  their host cohorts are new arrays every round).
  """
  if backend not in BACKENDS:
    raise ValueError(f'unknown round backend {backend!r}; choose from {list(BACKENDS)}')
  if mesh is not None and config.cohort_size % mesh.size:
    raise ValueError(f'cohort_size={config.cohort_size} must be divisible by the '
                     f'{mesh.size} devices of the client mesh')
  if mesh is not None and config.client_chunk % mesh.size:
    raise ValueError(f'client_chunk={config.client_chunk} must be divisible by the '
                     f'{mesh.size} devices of the client mesh')
  if rounds_per_call > 1 and backend != 'vmap':
    raise ValueError('config.engine.rounds_per_call > 1 scans rounds inside one compiled '
                     "program: it needs config.engine.backend='vmap'")
  def explain(round_fn, what: str, padded_rows: bool = False):
    check = FirstUseCheck(algorithm.num_classes, what, padded_rows) if check_data else None
    return ExplainedRound(round_fn, config, check)

  def explain_both(round_device, round_host):
    return (explain(round_device, 'the data of the round'),
            explain(round_host, "the round's cohort", padded_rows=True))

  if backend == 'loop':
    if mesh is not None:
      raise ValueError("backend='loop' runs clients one at a time; it takes no mesh")
    return explain_both(*_build_loop_round(algorithm, config))

  def shard_clients(tree):
    if mesh is None:
      return tree
    spec = NamedSharding(mesh, PartitionSpec('clients'))
    return jax.tree.map(lambda leaf: jax.lax.with_sharding_constraint(leaf, spec), tree)

  def round_on_rows(server_state, client_states, source: Store, rows, cohort_ids, key):
    """The round of the clients ``rows`` [C] of ``source`` (None: ``source`` is the
    cohort), whose ids are ``cohort_ids``."""
    client_keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.fold_in(key, 1),
                                                          cohort_ids)
    (outputs, new_states), scanned, fallback = run_cohort(
        algorithm.client_update, config, server_state, take_clients(client_states, cohort_ids),
        source, rows, step_budgets(key, config.cohort_size, config), client_keys,
        shard_clients)
    num_examples = source.num_examples if rows is None else source.num_examples[rows]
    return _finish_round(algorithm, config, server_state, client_states, num_examples,
                         cohort_ids, outputs, new_states, scanned, fallback)

  def round_on_cohort(server_state, client_states, cohort: Store, cohort_ids, key):
    _check_cohort(config, cohort, cohort_ids)
    return round_on_rows(server_state, client_states, cohort, None, cohort_ids, key)

  def round_device(server_state, client_states, store: Store, key):
    cohort_ids = sample_cohort(key, store.num_examples, config)
    return round_on_rows(server_state, client_states, store, cohort_ids, cohort_ids, key)

  donate_argnums = (0, 1) if donate else ()
  on_device = _scan_rounds(round_device) if rounds_per_call > 1 else round_device
  # Over several processes every output is replicated on the mesh: each process holds
  # the whole state, to checkpoint and evaluate (fedjax_shift/distributed.py).
  out = ({'out_shardings': NamedSharding(mesh, PartitionSpec())}
         if mesh is not None and jax.process_count() > 1 else {})
  return explain_both(jax.jit(on_device, donate_argnums=donate_argnums, **out),
                      jax.jit(round_on_cohort, donate_argnums=donate_argnums, **out))


class ExplainedRound:
  """A compiled round whose data are checked before their first use (``check`` of the
  store or cohort argument) and whose out-of-memory error names the fields to lower:
  the width of the vmapped client groups (``client_chunk``) or the cohort. Everything
  else (``lower``, the cache) is the jitted function's."""

  def __init__(self, round_fn, config: RoundConfig, check=None):
    self._round_fn = round_fn
    self._config = config
    self._check = check

  def __getattr__(self, name):
    return getattr(self._round_fn, name)

  def __call__(self, *args):
    if self._check is not None and len(args) > 2:
      self._check(args[2])
    try:
      return self._round_fn(*args)
    except flax.errors.ScopeParamShapeError as err:
      data = args[2]   # the store or cohort
      shape = (data.example_shape if isinstance(data, ClientStore)
               else tuple(data.x.shape[2:]))
      raise ValueError(
          f'the data do not fit the model\'s parameters: x of shape {tuple(data.x.shape)} '
          f'holds examples of shape {shape}, and the state was initialised for examples of '
          f'another shape ({str(err).split(" (https")[0]}). Initialise the '
          f'state with an example of these data: algorithm.init(key, data.first_example())'
          ) from None
    except jax.errors.JaxRuntimeError as err:
      explained = memory_error(err, self._config)
      if explained is None:
        raise
      raise explained from err


def memory_error(err: Exception, config: Optional[RoundConfig] = None
                 ) -> Optional[MemoryError]:
  """The MemoryError that says what to lower for a JAX out-of-memory ``err`` (None for
  any other error): the bytes the allocation asked for, the width of the vmapped client
  groups and the cohort (``config``'s, when known), and the host store. Raised where a
  compiled call fails and where its result is read (the dispatch is asynchronous)."""
  text = str(err)
  if 'RESOURCE_EXHAUSTED' not in text and 'Out of memory' not in text:
    return None
  asked = re.search(r'allocat\w* ([\d.]+ ?[KMGT]i?B|\d+ bytes)', text)
  asked = f' (an allocation of {asked.group(1)})' if asked else ''
  if config is not None:
    width = config.client_chunk or config.cohort_size
    what = (f'the round of {config.cohort_size} clients in vmapped groups of {width} does '
            f'not fit in device memory{asked}: lower config.engine.client_chunk (now '
            f'{config.client_chunk}; each group of that many clients is in memory at once) '
            f'or config.cohort_size')
  else:
    what = (f'a compiled call ran out of device memory{asked}: lower '
            f'config.engine.client_chunk (each vmapped group of that many clients is in '
            f'memory at once; 0 fits the widest under engine.max_scanned), '
            f'config.cohort_size or the model')
  return MemoryError(f"{what}; the data of the population itself moves to the host with "
                     f"config.data.store='host'. ({text.splitlines()[0][:300]})")


def _scan_rounds(round_device):
  """R rounds as one ``lax.scan``: ``rounds(server, clients, store, keys [R],
  active [R] bool)`` -> RoundOutput with metrics stacked [R, ...]. An inactive round
  (past the end of a chunk) leaves the state unchanged; its metrics are computed and
  ignored."""

  def rounds(server_state, client_states, store: Store, keys, active):
    def body(carry, inputs):
      key, on = inputs
      out = round_device(*carry, store, key)
      new = jax.tree.map(lambda a, b: jnp.where(on, a, b),
                         (out.server_state, out.client_states), carry)
      return new, out.metrics

    (server_state, client_states), metrics = jax.lax.scan(
        body, (server_state, client_states), (keys, active))
    return RoundOutput(server_state, client_states, metrics)

  return rounds


def _build_loop_round(algorithm: FederatedAlgorithm, config: RoundConfig):
  """The loop backend: a Python loop over the cohort calling a jitted ``client_update``
  on each client cut to the smallest of ``config.example_buckets`` that holds it (its
  own steps, never the population's largest client's; one compilation per bucket)."""
  client_update = jax.jit(algorithm.client_update)
  buckets = np.asarray(config.example_buckets, np.int64)

  @jax.jit
  def prepare(client_states, cohort_ids, key):
    client_keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.fold_in(key, 1),
                                                          cohort_ids)
    return (take_clients(client_states, cohort_ids), client_keys,
            step_budgets(key, config.cohort_size, config))

  @functools.partial(jax.jit, static_argnames='examples')
  def one_client(source, row, budget, examples):
    data = client_rows(source, row[None], budget[None], examples)
    return jax.tree.map(lambda leaf: leaf[0], data)

  finish = jax.jit(lambda *args: _finish_round(algorithm, config, *args))
  sample = jax.jit(lambda store, key: sample_cohort(key, store.num_examples, config))

  def round_on_rows(server_state, client_states, source: Store, rows, cohort_ids, key):
    cohort_states, client_keys, budgets = prepare(client_states, cohort_ids, key)
    sizes = np.asarray(source.num_examples)[np.asarray(rows)]
    results, scanned = [], 0
    for slot in range(config.cohort_size):
      examples = (int(buckets[np.searchsorted(buckets, sizes[slot])]) if buckets.size
                  else None)
      one = lambda tree: jax.tree.map(lambda leaf: leaf[slot], tree)
      try:
        # Block inside the try: on an accelerator a client's error (e.g. from a
        # callback) surfaces only when its result is awaited.
        result = jax.block_until_ready(client_update(
            server_state, one(cohort_states), one_client(source, rows[slot], budgets[slot],
                                                         examples), client_keys[slot]))
      except Exception as err:
        raise RuntimeError(f'client_update failed for client {int(cohort_ids[slot])} '
                           f'(cohort slot {slot}): {err}') from err
      results.append(result)
      steps = scanned_steps(result[0].metrics, 1, config.schedule, examples)
      scanned = None if steps is None else scanned + steps
    outputs, new_states = jax.tree.map(lambda *leaves: jnp.stack(leaves), *results)
    return finish(server_state, client_states, source.num_examples[rows], cohort_ids, outputs,
                  new_states, scanned)

  def round_host(server_state, client_states, cohort: Store, cohort_ids, key):
    _check_cohort(config, cohort, cohort_ids)
    return round_on_rows(server_state, client_states, cohort,
                         jnp.arange(config.cohort_size), cohort_ids, key)

  def round_device(server_state, client_states, store: Store, key):
    cohort_ids = sample(store, key)
    return round_on_rows(server_state, client_states, store, cohort_ids, cohort_ids, key)

  return round_device, round_host


class HostStore:
  """Keeps the population in host memory; moves only cohorts.

  ``cohort(r)`` returns (the cohort on device, cohort ids) for round r and starts
  gathering round r+1's cohort on a worker thread, so the host gather and the
  host→device copy overlap the running round. Device memory grows with the cohort,
  not the population.

  A ``ClientStore`` population sends a cohort store: the cohort's own examples in the
  store's dtype (uint8 codes for images), concatenated and padded to ``capacity`` rows
  (the compiled round's input shape): at first the expected cohort's examples plus two
  standard deviations, raised to the ladder ``cohort_capacity`` of a cohort that holds
  more, never lowered, so that a run compiles its round for a few sizes, not one per
  round; a padded ``FederatedData`` population sends its cohort at the padded N. With
  a ``sharding`` over the devices of several processes each process gathers and moves
  only the clients of its own devices' shards (``jax.make_array_from_callback``; a
  ClientStore's cohort goes padded then).
  """

  def __init__(self, data: Store, seed_key: jax.Array, config: RoundConfig,
               sharding=None):
    self.data = data
    self.seed_key = seed_key
    self.config = config
    self.sharding = sharding
    self._num_examples = jnp.asarray(data.num_examples)
    self._sample = jax.jit(lambda key, num_examples: sample_cohort(key, num_examples, config))
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    self._pending: Dict[int, concurrent.futures.Future] = {}
    self.bytes_sent = 0   # host→device bytes of the cohorts fetched so far
    self.capacity = (expected_cohort_rows(np.asarray(data.num_examples), config.cohort_size)
                     if isinstance(data, ClientStore) else 0)
    # A store memory-mapped from a file: its size and time of change now, checked before
    # every gather (a file rewritten under a run would feed it other examples).
    self._file = mapped_file(data) if isinstance(data, ClientStore) else None
    self._file_stat = _stat(self._file) if self._file else None

  def _check_file(self):
    if self._file and _stat(self._file) != self._file_stat:
      raise ValueError(f'{self._file} changed while the run read it (size, time of change '
                       f'{self._file_stat} -> {_stat(self._file)}): the run stops rather '
                       'than train on other examples; save the store again and re-run')

  def _fetch(self, round_index: int):
    self._check_file()
    key = round_key(self.seed_key, round_index)
    ids = np.asarray(self._sample(key, self._num_examples))
    data = self.data
    if self.sharding is not None and not self.sharding.is_fully_addressable:
      if isinstance(data, ClientStore):
        data = data.take(ids)
        ids_in_data = np.arange(len(ids))
      else:
        ids_in_data = ids

      def shard(array):   # only the rows of this process's devices
        return jax.make_array_from_callback(
            (len(ids),) + array.shape[1:], self.sharding,
            lambda index: np.asarray(array[ids_in_data[index[0]]]))
      return jax.tree.map(shard, data), ids
    if isinstance(data, ClientStore):
      total = int(np.asarray(data.num_examples)[ids].sum())
      if total > self.capacity:
        self.capacity = cohort_capacity(total)
      cohort = cohort_store(data, ids, self.capacity)
    else:
      cohort = data.take(ids)
    self.bytes_sent += sum(int(np.asarray(leaf).nbytes) for leaf in jax.tree.leaves(cohort))
    if self.sharding is not None and not isinstance(cohort, ClientStore):
      cohort = jax.device_put(cohort, self.sharding)
    else:
      cohort = jax.device_put(cohort)
    return cohort, jnp.asarray(ids)

  def cohort(self, round_index: int) -> Tuple[Store, jax.Array]:
    future = self._pending.pop(round_index, None)
    result = future.result() if future is not None else self._fetch(round_index)
    self._pending = {round_index + 1: self._pool.submit(self._fetch, round_index + 1)}
    return result

  def close(self):
    self._pool.shutdown(wait=False, cancel_futures=True)


def _stat(path: str) -> Optional[Tuple[int, int]]:
  try:
    info = os.stat(path)
  except FileNotFoundError:
    return None
  return info.st_size, info.st_mtime_ns


def cohort_capacity(total: int) -> int:
  """``total`` rounded up to the ladder of cohort sizes: a multiple of 2^(⌊log2 total⌋ −
  4), sixteen sizes per doubling (at most 1/16 more)."""
  total = max(int(total), 1)
  step = 1 << max(total.bit_length() - 5, 0)
  return -(-total // step) * step


def expected_cohort_rows(num_examples: np.ndarray, cohort_size: int) -> int:
  """``cohort_capacity`` of the examples of a cohort of ``cohort_size`` drawn uniformly
  without replacement from clients of ``num_examples`` [K]: the mean plus two standard
  deviations."""
  sizes = np.asarray(num_examples, np.float64)
  clients = len(sizes)
  variance = cohort_size * sizes.var() * (clients - cohort_size) / max(clients - 1, 1)
  return cohort_capacity(cohort_size * sizes.mean() + 2 * np.sqrt(max(variance, 0.0)))


def cohort_store(store: ClientStore, client_ids: np.ndarray,
                 capacity: Optional[int] = None) -> ClientStore:
  """The clients ``client_ids`` [C] of a host ``store`` as a store of their own (host
  numpy): their examples concatenated in cohort order in the store's dtype, padded with
  row 0 (never a client's) to ``capacity`` rows (default: ``cohort_capacity`` of
  theirs), and their offsets [C+1]."""
  client_ids = np.asarray(client_ids, np.int64)
  offsets = np.asarray(store.offsets, np.int64)
  counts = offsets[client_ids + 1] - offsets[client_ids]
  total = int(counts.sum())
  capacity = cohort_capacity(total) if capacity is None else int(capacity)
  if capacity < total:
    raise ValueError(f'a cohort of {total} examples does not fit {capacity} rows')
  new_offsets = np.concatenate([[0], np.cumsum(counts)])
  rows = np.repeat(offsets[client_ids] - new_offsets[:-1], counts) + np.arange(total)
  rows = np.concatenate([rows, np.zeros(capacity - total, np.int64)])
  x, y = np.asarray(store.x), np.asarray(store.y)
  if not len(y):   # an empty store: zero rows of padding
    x, y = np.zeros((1,) + x.shape[1:], x.dtype), np.zeros(1, y.dtype)
  return ClientStore(x[rows], y[rows], new_offsets.astype(np.int32), counts.astype(np.int32),
                     None if store.palette is None else np.asarray(store.palette),
                     store.max_examples)


def client_mesh(num_devices: Optional[int] = None) -> Mesh:
  """A 1-D mesh named 'clients' over the first ``num_devices`` devices (all by default).

  On several hosts call ``jax.distributed.initialize()`` first; ``jax.devices()``
  then lists every host's devices and the same program runs on each.
  """
  devices = jax.devices()
  if num_devices:
    if num_devices > len(devices):
      raise ValueError(f'asked for {num_devices} devices but only {len(devices)} exist')
    devices = devices[:num_devices]
  return Mesh(np.array(devices), ('clients',))
