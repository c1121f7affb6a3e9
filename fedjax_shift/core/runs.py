"""Several runs of one method as one program: the compiled round ``vmap``ped over a
leading run axis of stacked states (the points of a hyperparameter grid × seeds).

``stack_runs`` stacks the runs' pytrees, ``take_run`` takes one run's slice back, and
``grid_round`` turns a round function into one XLA call over P points × S seeds whose
points share each seed's data (not copied per point).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

def stack_runs(trees):
  """One pytree whose leaves are the trees' leaves stacked on a new leading axis."""
  return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def take_run(tree, index: int):
  """Run ``index``'s slice of a pytree stacked by ``stack_runs``."""
  return jax.tree.map(lambda leaf: leaf[index], tree)


def grid_round(round_fn: Callable, num_points: int, num_seeds: int) -> Callable:
  """jit of (values [P] each, server [P·S, ...], clients [P·S, ...], data [S, ...],
  keys [S]) -> RoundOutput over P·S runs: ``round_fn(values, server, clients, data,
  key)`` vmapped over the seeds (inner) and the points (outer, sharing the data)."""
  over_seeds = jax.vmap(round_fn, in_axes=(None, 0, 0, 0, 0))
  over_points = jax.vmap(over_seeds, in_axes=(0, 0, 0, None, None))

  def split(tree):
    return jax.tree.map(lambda a: a.reshape((num_points, num_seeds) + a.shape[1:]), tree)

  def grid(values, server_states, client_states, data, keys):
    out = over_points(values, split(server_states), split(client_states), data, keys)
    return jax.tree.map(lambda a: a.reshape((num_points * num_seeds,) + a.shape[2:]), out)

  return jax.jit(grid)
