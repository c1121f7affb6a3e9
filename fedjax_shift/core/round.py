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
from typing import Any, Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fedjax_shift.core.algorithm import ClientData, FederatedAlgorithm
from fedjax_shift.data.federated import FederatedData

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
    client_chunk: 0 vmaps the whole cohort at once; c > 0 vmaps chunks of c
      clients and runs the chunks one after another (``lax.map``), trading
      speed for memory (C/c times less activation memory).
  """
  cohort_size: int
  sampling: str = 'uniform'
  weighting: str = 'num_examples'
  straggler_prob: float = 0.0
  straggler_max_steps: int = 1
  client_chunk: int = 0


def round_key(seed_key: jax.Array, round_index: int) -> jax.Array:
  return jax.random.fold_in(seed_key, round_index)


def sample_cohort(key: jax.Array, num_examples: jax.Array, config: RoundConfig) -> jax.Array:
  """Cohort client ids [C] drawn without replacement from the K clients."""
  num_clients = num_examples.shape[0]
  if config.sampling == 'num_examples':
    probs = num_examples / jnp.maximum(jnp.sum(num_examples), 1)
  else:
    probs = None
  return jax.random.choice(jax.random.fold_in(key, 0), num_clients,
                           (config.cohort_size,), replace=False, p=probs).astype(jnp.int32)


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


def map_clients(fn, in_axes, chunk: int):
  """``vmap(fn, in_axes)`` over the client axis, or over chunks of ``chunk`` clients
  run sequentially with ``lax.map`` (same results, less memory)."""
  vmapped = jax.vmap(fn, in_axes)
  if not chunk:
    return vmapped

  def chunked(*args):
    mapped = [a for a, axis in zip(args, in_axes) if axis is not None]
    size = jax.tree_util.tree_leaves(mapped)[0].shape[0]
    if size % chunk:
      raise ValueError(f'client_chunk={chunk} must divide the cohort size {size}')
    split = lambda leaf: leaf.reshape((size // chunk, chunk) + leaf.shape[1:])

    def body(chunk_args):
      it = iter(chunk_args)
      full = [next(it) if axis is not None else a for a, axis in zip(args, in_axes)]
      return vmapped(*full)

    out = jax.lax.map(body, tuple(jax.tree.map(split, a) for a in mapped))
    return jax.tree.map(lambda leaf: leaf.reshape((size,) + leaf.shape[2:]), out)

  return chunked


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


def _check_cohort(config: RoundConfig, cohort: FederatedData, cohort_ids) -> None:
  if cohort.x.shape[0] != config.cohort_size or cohort_ids.shape != (config.cohort_size,):
    raise ValueError(f'the round was built for cohort_size={config.cohort_size} but got '
                     f'{cohort.x.shape[0]} clients and {cohort_ids.shape[0]} ids')


def _client_inputs(config: RoundConfig, client_states, cohort: FederatedData, cohort_ids, key):
  """Per-client (ClientData [C, ...], states [C, ...], keys [C]) of a cohort."""
  client_keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.fold_in(key, 1), cohort_ids)
  data = ClientData(cohort.x, cohort.y, cohort.mask, cohort.num_examples,
                    step_budgets(key, config.cohort_size, config))
  return data, take_clients(client_states, cohort_ids), client_keys


def _sample_and_take(store: FederatedData, key, config: RoundConfig):
  """(cohort FederatedData [C, ...], cohort ids [C]) of round ``key``."""
  cohort_ids = sample_cohort(key, store.num_examples, config)
  return take_clients(store, cohort_ids), cohort_ids


def _finish_round(algorithm: FederatedAlgorithm, config: RoundConfig, server_state,
                  client_states, cohort_num_examples, cohort_ids, outputs, new_states
                  ) -> 'RoundOutput':
  """Weighted server update, client-state scatter and round metrics."""
  weights = aggregation_weights(cohort_num_examples, config.weighting)
  server_state = algorithm.server_update(server_state, outputs, weights)
  client_states = put_clients(client_states, cohort_ids, new_states)
  metrics = {name: jnp.sum(weights * value) for name, value in outputs.metrics.items()}
  metrics['cohort_examples'] = jnp.sum(cohort_num_examples)
  metrics['cohort'] = cohort_ids
  if 'loss' in outputs.metrics:
    metrics['client_loss'] = outputs.metrics['loss']
  return RoundOutput(server_state, client_states, metrics)


def build_round(algorithm: FederatedAlgorithm, config: RoundConfig,
                mesh: Optional[Mesh] = None, donate: bool = False, backend: str = 'vmap',
                rounds_per_call: int = 1):
  """Returns ``(round_device, round_host)``.

  With ``rounds_per_call`` R > 1, round_device is instead
  ``rounds(server_state, client_states, store, keys [R], active [R])``: R rounds as one
  compiled ``lax.scan`` (``_scan_rounds``), metrics stacked [R, ...].

  round_device(server_state, client_states, store: FederatedData, round_key)
      samples, gathers and trains in one compiled call.
  round_host(server_state, client_states, cohort: FederatedData, cohort_ids, round_key)
      trains a cohort gathered on the host (see HostStore).
  Both return RoundOutput; metrics hold 'cohort' ids [C] and per-client
  'client_loss' [C] beside the weighted means.

  ``backend='vmap'`` (the product) jits each as one program. ``backend='loop'``
  runs the same computation as a Python loop over a jitted ``client_update``
  (fedjax-style; a debug backend whose errors name the client, and the faster one
  for convolutional models on XLA:CPU); it does not support ``mesh``.
  """
  if backend not in BACKENDS:
    raise ValueError(f'unknown round backend {backend!r}; choose from {list(BACKENDS)}')
  if mesh is not None and config.cohort_size % mesh.size:
    raise ValueError(f'cohort_size={config.cohort_size} must be divisible by the '
                     f'{mesh.size} devices of the client mesh')
  if rounds_per_call > 1 and backend != 'vmap':
    raise ValueError('config.engine.rounds_per_call > 1 scans rounds inside one compiled '
                     "program: it needs config.engine.backend='vmap'")
  if backend == 'loop':
    if mesh is not None:
      raise ValueError("backend='loop' runs clients one at a time; it takes no mesh")
    return _build_loop_round(algorithm, config)

  def shard_clients(tree):
    if mesh is None:
      return tree
    spec = NamedSharding(mesh, PartitionSpec('clients'))
    return jax.tree.map(lambda leaf: jax.lax.with_sharding_constraint(leaf, spec), tree)

  def round_on_cohort(server_state, client_states, cohort: FederatedData, cohort_ids, key):
    _check_cohort(config, cohort, cohort_ids)
    data, cohort_states, client_keys = _client_inputs(config, client_states,
                                                      shard_clients(cohort), cohort_ids, key)
    outputs, new_states = map_clients(algorithm.client_update, (None, 0, 0, 0),
                                      config.client_chunk)(
        server_state, shard_clients(cohort_states), data, client_keys)
    return _finish_round(algorithm, config, server_state, client_states, cohort.num_examples,
                         cohort_ids, outputs, new_states)

  def round_device(server_state, client_states, store: FederatedData, key):
    cohort, cohort_ids = _sample_and_take(store, key, config)
    return round_on_cohort(server_state, client_states, cohort, cohort_ids, key)

  donate_argnums = (0, 1) if donate else ()
  on_device = _scan_rounds(round_device) if rounds_per_call > 1 else round_device
  # Over several processes every output is replicated on the mesh: each process holds
  # the whole state, to checkpoint and evaluate (fedjax_shift/distributed.py).
  out = ({'out_shardings': NamedSharding(mesh, PartitionSpec())}
         if mesh is not None and jax.process_count() > 1 else {})
  return (jax.jit(on_device, donate_argnums=donate_argnums, **out),
          jax.jit(round_on_cohort, donate_argnums=donate_argnums, **out))


def _scan_rounds(round_device):
  """R rounds as one ``lax.scan``: ``rounds(server, clients, store, keys [R],
  active [R] bool)`` -> RoundOutput with metrics stacked [R, ...]. An inactive round
  (past the end of a chunk) leaves the state unchanged; its metrics are computed and
  ignored."""

  def rounds(server_state, client_states, store: FederatedData, keys, active):
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
  client_update = jax.jit(algorithm.client_update)
  client_inputs = jax.jit(lambda states, cohort, ids, key: _client_inputs(config, states,
                                                                          cohort, ids, key))
  finish = jax.jit(lambda *args: _finish_round(algorithm, config, *args))
  sample_and_take = jax.jit(lambda store, key: _sample_and_take(store, key, config))

  def round_host(server_state, client_states, cohort: FederatedData, cohort_ids, key):
    _check_cohort(config, cohort, cohort_ids)
    data, cohort_states, client_keys = client_inputs(client_states, cohort, cohort_ids, key)
    results = []
    for slot in range(config.cohort_size):
      one = lambda tree: jax.tree.map(lambda leaf: leaf[slot], tree)
      try:
        # Block inside the try: on an accelerator a client's error (e.g. from a
        # callback) surfaces only when its result is awaited.
        results.append(jax.block_until_ready(client_update(
            server_state, one(cohort_states), one(data), client_keys[slot])))
      except Exception as err:
        raise RuntimeError(f'client_update failed for client {int(cohort_ids[slot])} '
                           f'(cohort slot {slot}): {err}') from err
    outputs, new_states = jax.tree.map(lambda *leaves: jnp.stack(leaves), *results)
    return finish(server_state, client_states, cohort.num_examples, cohort_ids, outputs,
                  new_states)

  def round_device(server_state, client_states, store: FederatedData, key):
    cohort, cohort_ids = sample_and_take(store, key)
    return round_host(server_state, client_states, cohort, cohort_ids, key)

  return round_device, round_host


class HostStore:
  """Keeps the [K, N, ...] population in host memory; moves only cohorts.

  ``cohort(r)`` returns (cohort FederatedData on device, cohort ids) for round r and
  starts gathering round r+1's cohort on a worker thread, so the host gather and
  the host→device copy overlap the running round. Device memory grows with the
  cohort, not the population. With a ``sharding`` over the devices of several
  processes each process gathers and moves only the clients of its own devices'
  shards (``jax.make_array_from_callback``).
  """

  def __init__(self, data: FederatedData, seed_key: jax.Array, config: RoundConfig,
               sharding=None):
    self.data = data
    self.seed_key = seed_key
    self.config = config
    self.sharding = sharding
    self._num_examples = jnp.asarray(data.num_examples)
    self._sample = jax.jit(lambda key, num_examples: sample_cohort(key, num_examples, config))
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    self._pending: Dict[int, concurrent.futures.Future] = {}

  def _fetch(self, round_index: int):
    key = round_key(self.seed_key, round_index)
    ids = np.asarray(self._sample(key, self._num_examples))
    if self.sharding is not None and not self.sharding.is_fully_addressable:
      def shard(array):   # only the rows of this process's devices
        return jax.make_array_from_callback(
            (len(ids),) + array.shape[1:], self.sharding,
            lambda index: np.asarray(array[ids[index[0]]]))
      return jax.tree.map(shard, self.data), ids
    cohort = self.data.take(ids)
    if self.sharding is not None:
      cohort = jax.device_put(cohort, self.sharding)
    else:
      cohort = jax.device_put(cohort)
    return cohort, jnp.asarray(ids)

  def cohort(self, round_index: int) -> Tuple[FederatedData, jax.Array]:
    future = self._pending.pop(round_index, None)
    result = future.result() if future is not None else self._fetch(round_index)
    self._pending = {round_index + 1: self._pool.submit(self._fetch, round_index + 1)}
    return result

  def close(self):
    self._pool.shutdown(wait=False, cancel_futures=True)


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
