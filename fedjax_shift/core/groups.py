"""The grouped compiled round: clients of different architectures in one program.

Heterogeneous-model methods (HeteroFedTTA, FedMD-style) give each client a model of
one of G architectures and exchange no parameters, only what every architecture can
produce (logits on a public set). Their per-client states cannot share one stacked
pytree, so the population is split into groups: group g holds K_g clients whose
states are stacked [K_g, ...] and whose ``client_update`` is vmapped over its cohort.
The G vmapped stacks, the concatenation of their outputs and the server update are ONE
``jax.jit``-compiled call per round (the groups are a static Python tuple, unrolled at
trace time).

Sampling is stratified: group g contributes a fixed C_g of its K_g clients each round
(drawn without replacement, uniformly), so every shape is static. With
C_g = K_g every client takes part in every round (FedMD, HeteroFedTTA).

Keys follow ``core/round.py``: round r's key is ``fold_in(seed_key, r)``; group g's
sampling key ``fold_in(fold_in(round_key, 0), g)``; client k's key is
``fold_in(fold_in(round_key, 1), k)`` with k its id in the whole population.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_shift.core.algorithm import ClientData, ClientOutput
from fedjax_shift.core.round import (NO_STEP_LIMIT, aggregation_weights, put_clients,
                                     take_clients)
from fedjax_shift.data.federated import FederatedData

PyTree = Any


class ClientGroup(NamedTuple):
  """The clients of one architecture.

  Attributes:
    name: the architecture's name (e.g. 'small').
    init_client_state: (rng) -> ONE client's state (its own model).
    client_update: (server_state, client_state, ClientData, rng) ->
      (ClientOutput, client_state); written for one client, pure. Every group's
      ``ClientOutput`` has the same structure and shapes (what the server averages).
  """
  name: str
  init_client_state: Callable[[jax.Array], PyTree]
  client_update: Callable[..., Tuple[ClientOutput, PyTree]]


class GroupedAlgorithm(NamedTuple):
  """A training method over architecture groups.

  Attributes:
    init: (rng) -> ServerState.
    groups: one ClientGroup per architecture.
    server_update: (ServerState, ClientOutput stacked over the whole cohort [C, ...],
      weights [C]) -> ServerState; weights sum to 1 (all 0 when no client has data).
  """
  init: Callable[[jax.Array], PyTree]
  groups: Tuple[ClientGroup, ...]
  server_update: Callable[..., PyTree]


class GroupedRoundOutput(NamedTuple):
  server_state: PyTree
  group_states: Tuple[PyTree, ...]   # per group [K_g, ...]
  metrics: dict                      # weighted means over the cohort, 'cohort' ids [C]


def init_group_states(algorithm: GroupedAlgorithm, key: jax.Array,
                      group_client_ids: Sequence[np.ndarray]) -> Tuple[PyTree, ...]:
  """Per group [K_g, ...] initial states; client k's from ``fold_in(key, k)``."""
  states = []
  for group, ids in zip(algorithm.groups, group_client_ids):
    keys = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.asarray(ids, jnp.int32))
    states.append(jax.jit(jax.vmap(group.init_client_state))(keys))
  return tuple(states)


def cohort_sizes(group_sizes: Sequence[int], cohort_size: int) -> Tuple[int, ...]:
  """C_g per group: every client when ``cohort_size`` covers the population, else
  max(1, round(cohort_size · K_g / K)) (stratified by group size)."""
  total = sum(group_sizes)
  if cohort_size >= total:
    return tuple(group_sizes)
  return tuple(min(k, max(1, int(round(cohort_size * k / total)))) for k in group_sizes)


def build_grouped_round(algorithm: GroupedAlgorithm, sizes: Sequence[int],
                        weighting: str = 'uniform'):
  """Returns jitted ``round(server_state, group_states, group_data, group_client_ids,
  key)`` -> GroupedRoundOutput.

  ``group_data``: per group a FederatedData [K_g, N, ...] (one padded N for all);
  ``group_client_ids``: per group [K_g] int32 population ids; ``sizes``: C_g per group
  (static). Aggregation weights over the concatenated cohort by ``weighting``
  ('num_examples' or 'uniform'; clients without examples get 0).
  """
  if len(sizes) != len(algorithm.groups):
    raise ValueError(f'{len(sizes)} cohort sizes for {len(algorithm.groups)} groups')

  def round_fn(server_state, group_states, group_data, group_client_ids, key):
    sampling_key, client_key = jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)
    outputs, num_examples, cohort, new_group_states = [], [], [], []
    for g, (group, states, data, ids) in enumerate(zip(algorithm.groups, group_states,
                                                       group_data, group_client_ids)):
      size = sizes[g]
      if size == 0:
        new_group_states.append(states)
        continue
      slots = jax.random.choice(jax.random.fold_in(sampling_key, g), ids.shape[0], (size,),
                                replace=False)
      cohort_data = take_clients(data, slots)
      client_ids = ids[slots]
      keys = jax.vmap(jax.random.fold_in, (None, 0))(client_key, client_ids)
      client_data = ClientData(cohort_data.x, cohort_data.y, cohort_data.mask,
                               cohort_data.num_examples,
                               jnp.full((size,), NO_STEP_LIMIT, jnp.int32))
      output, new_states = jax.vmap(group.client_update, (None, 0, 0, 0))(
          server_state, take_clients(states, slots), client_data, keys)
      outputs.append(output)
      num_examples.append(cohort_data.num_examples)
      cohort.append(client_ids)
      new_group_states.append(put_clients(states, slots, new_states))
    stacked = jax.tree.map(lambda *leaves: jnp.concatenate(leaves), *outputs)
    num_examples = jnp.concatenate(num_examples)
    weights = aggregation_weights(num_examples, weighting)
    server_state = algorithm.server_update(server_state, stacked, weights)
    metrics = {name: jnp.sum(weights * value) for name, value in stacked.metrics.items()}
    metrics['cohort'] = jnp.concatenate(cohort)
    return GroupedRoundOutput(server_state, tuple(new_group_states), metrics)

  return jax.jit(round_fn)


def split_groups(data: FederatedData, group_client_ids: Sequence[np.ndarray]
                 ) -> Tuple[FederatedData, ...]:
  """The rows of ``data`` [K, ...] of each group's clients (ids into its K)."""
  return tuple(data.take(np.asarray(ids)) for ids in group_client_ids)
