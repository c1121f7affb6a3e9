"""Full-state checkpoints with orbax: server state, client states, round.

The state pytree is saved as its flat list of leaves and restored into the
structure of a freshly initialised state, so any NamedTuple / dict layout an
algorithm uses round-trips without orbax needing to know it.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Tuple

import jax
import numpy as np
import orbax.checkpoint as ocp

PyTree = Any


class Checkpointer:
  """Saves every ``every`` rounds into ``directory``, keeps the last ``keep``."""

  def __init__(self, directory: str, every: int, keep: int):
    self.every = every
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=False)
    self.manager = ocp.CheckpointManager(os.path.abspath(directory), options=options)

  @staticmethod
  def _as_leaves(state: PyTree) -> dict:
    return {f'leaf_{i:05d}': np.asarray(leaf)
            for i, leaf in enumerate(jax.tree_util.tree_leaves(state))}

  def save(self, round_index: int, state: PyTree, force: bool = False) -> bool:
    """Saves ``state`` after round ``round_index`` if due (or ``force``)."""
    if not force and round_index % self.every:
      return False
    if round_index in self.manager.all_steps():
      return False
    self.manager.save(round_index, args=ocp.args.StandardSave(self._as_leaves(state)),
                      force=True)
    self.manager.wait_until_finished()
    return True

  def latest_round(self) -> Optional[int]:
    return self.manager.latest_step()

  def restore(self, template: PyTree) -> Tuple[Optional[int], PyTree]:
    """(round, state) from the latest checkpoint, or (None, template) if none."""
    step = self.manager.latest_step()
    if step is None:
      return None, template
    leaves, treedef = jax.tree_util.tree_flatten(template)
    abstract = {f'leaf_{i:05d}': jax.ShapeDtypeStruct(np.shape(leaf), np.asarray(leaf).dtype)
                for i, leaf in enumerate(leaves)}
    restored = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
    new_leaves = [restored[f'leaf_{i:05d}'] for i in range(len(leaves))]
    return step, jax.tree_util.tree_unflatten(treedef, new_leaves)

  def close(self):
    self.manager.close()
