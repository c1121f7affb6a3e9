"""Full-state checkpoints with orbax: server state, client states, round.

A state pytree is saved as a nested dict named by its pytree paths (NamedTuple and
dataclass fields, dict keys, list positions): a run's checkpoint reads as
``{'server': {'params': {'Dense_0': {'kernel': ...}}, ...}, 'clients': ..., 'seconds': ...}``
and ``read`` returns it without the library (any orbax reader does too). Restoring
into a run puts the arrays into the structure of a freshly initialised state, so any
NamedTuple / dict layout an algorithm uses round-trips without orbax needing to know
it. Checkpoints written before the names (arrays ``leaf_00000``, ``leaf_00001``, … in
the state's flattening order) still restore.

Restoring tries the newest checkpoint first; one that cannot be read (a truncated
file, a missing manifest or ``default/`` folder) is moved aside to
``<directory>/../corrupt_checkpoints/`` with a warning naming its round and the
error, and the next older one is tried. A checkpoint whose leaves do not have the
template's shapes is an error (another model's state), never restored.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from typing import Any, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

PyTree = Any
log = logging.getLogger('fedjax_shift')


class RunState(NamedTuple):
  """What a run checkpoints: its method's server state, the per-client (or per-group)
  states stacked on a leading axis, and the training seconds so far."""
  server: Any
  clients: Any
  seconds: Any


LEGACY_PREFIX = 'leaf_'   # checkpoints of anonymous leaves, in flattening order


def _path_name(key) -> str:
  for attribute in ('name', 'key', 'idx'):
    if hasattr(key, attribute):
      return str(getattr(key, attribute)).replace('.', '_')
  return str(key).replace('.', '_')


def leaf_names(state: PyTree) -> list:
  """The '.'-joined path name of every leaf of ``state``, in flattening order."""
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
  return ['.'.join(_path_name(key) for key in path) or 'value' for path in paths]


def _nest(names, values) -> dict:
  """{'a': {'b': value}} from '.'-joined ``names`` ('a.b') and their ``values``."""
  if len(set(names)) != len(names):
    raise ValueError(f'two leaves of the state have one name: {sorted(names)}')
  tree: dict = {}
  for name, value in zip(names, values):
    node = tree
    *parents, last = name.split('.')
    for parent in parents:
      node = node.setdefault(parent, {})
    node[last] = value
  return tree


def named_tree(state: PyTree) -> dict:
  """``state`` as a nested dict of numpy arrays named by its pytree paths (what a
  checkpoint holds)."""
  return _nest(leaf_names(state), [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(state)])


def _flat_names(tree, prefix: str = '') -> dict:
  """{'a.b.c': leaf} of a nested dict (a checkpoint's tree or its metadata)."""
  if not isinstance(tree, dict):
    return {prefix: tree}
  flat = {}
  for key, value in tree.items():
    flat.update(_flat_names(value, f'{prefix}.{key}' if prefix else str(key)))
  return flat


class CheckpointMismatchError(ValueError):
  """A checkpoint holds a state of other shapes than the run's template."""


class DiskFullError(OSError):
  """The disk under a checkpoint directory filled up while saving."""


def is_disk_full(err: BaseException) -> bool:
  """Whether ``err`` or an exception it was raised from is ENOSPC / EDQUOT."""
  while err is not None:
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
      return True
    if 'No space left on device' in str(err):
      return True
    err = err.__cause__ or err.__context__
  return False


def check_keep(keep: int) -> None:
  """``config.keep_checkpoints`` must be >= 1: the final checkpoint is what a re-run
  resumes from."""
  if keep < 1:
    raise ValueError(f'config.keep_checkpoints: must be >= 1 (the final checkpoint is '
                     f'what a re-run resumes from), got {keep}')


def prune(directory: str, keep: int, target_round: int) -> Tuple[int, ...]:
  """Deletes the checkpoints of ``directory`` older than its newest ``keep`` (all but
  the one of ``target_round``, which a run lowered to that round evaluates), as the
  run's next save would; returns the rounds deleted. Run before a re-run writes
  anything, so that lowering config.keep_checkpoints frees a full disk."""
  if not os.path.isdir(directory):
    return ()
  rounds = sorted(int(name) for name in os.listdir(directory) if name.isdigit())
  deleted = tuple(r for r in rounds[:-keep] if r != target_round)
  for round_index in deleted:
    shutil.rmtree(os.path.join(directory, str(round_index)))
  return deleted


class Checkpointer:
  """Saves every ``every`` rounds into ``directory``, keeps the last ``keep`` (>= 1)."""

  def __init__(self, directory: str, every: int, keep: int):
    check_keep(keep)
    self.every = every
    self.directory = os.path.abspath(directory)
    self.options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                enable_async_checkpointing=False)
    self.manager = ocp.CheckpointManager(self.directory, options=self.options,
                                        item_handlers=ocp.StandardCheckpointHandler())

  def save(self, round_index: int, state: PyTree, force: bool = False) -> bool:
    """Saves ``state`` after round ``round_index`` if due (or ``force``)."""
    if not force and round_index % self.every:
      return False
    if round_index in self.manager.all_steps():
      return False
    tree = named_tree(state)
    try:
      self.manager.save(round_index, args=ocp.args.StandardSave(tree), force=True)
      self.manager.wait_until_finished()
    except Exception as err:   # orbax wraps the OSError of a full disk
      if not is_disk_full(err):
        raise
      needed = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(tree)) / 2 ** 20
      free = shutil.disk_usage(self.directory).free / 2 ** 20
      kept = sorted(step for step in self.manager.all_steps() if step != round_index)
      older = (f' (e.g. delete its older checkpoints '
               f'{[os.path.join(self.directory, str(step)) for step in kept[:-1]]}: the newest, '
               f'round {kept[-1]}, is what a re-run resumes from)' if len(kept) > 1 else '')
      raise DiskFullError(
          errno.ENOSPC,
          f'the disk is full: saving the round-{round_index} checkpoint into '
          f'{self.directory} needs about {needed:.1f} MiB and {free:.1f} MiB are free. The '
          f'run keeps config.keep_checkpoints={self.options.max_to_keep} checkpoints of this '
          f'size per run: free space{older}, or pass another --workdir, and re-run the same '
          f'command; it resumes from the newest complete checkpoint (a lower '
          f'keep_checkpoints deletes the older ones when the re-run starts).'
      ) from err
    return True

  def latest_round(self) -> Optional[int]:
    return self.manager.latest_step()

  def rounds(self) -> Tuple[int, ...]:
    """The rounds of the kept checkpoints, ascending."""
    return tuple(sorted(self.manager.all_steps()))

  def _move_aside(self, step: int, reason: str) -> str:
    target_dir = os.path.join(os.path.dirname(self.directory), 'corrupt_checkpoints')
    os.makedirs(target_dir, exist_ok=True)
    target = os.path.join(target_dir, f'{step}-{time.strftime("%Y%m%dT%H%M%S")}')
    shutil.move(os.path.join(self.directory, str(step)), target)
    with open(os.path.join(target, 'WHY.txt'), 'w') as f:
      f.write(reason + '\n')
    self.manager.close()
    self.manager = ocp.CheckpointManager(self.directory, options=self.options,
                                        item_handlers=ocp.StandardCheckpointHandler())
    return target

  def _restore_step(self, step: int, template: PyTree) -> PyTree:
    leaves, treedef = jax.tree_util.tree_flatten(template)
    saved = _flat_names(self.manager.item_metadata(step).tree)
    legacy = all(name.startswith(LEGACY_PREFIX) for name in saved)
    names = ([f'{LEGACY_PREFIX}{i:05d}' for i in range(len(leaves))] if legacy else
             leaf_names(template))
    if legacy and len(saved) != len(leaves):
      raise CheckpointMismatchError(
          f'the checkpoint of round {step} in {self.directory} holds {len(saved)} arrays, '
          f'this run\'s state {len(leaves)}: it is another model\'s or method\'s state')
    if not legacy and set(saved) != set(names):
      missing = sorted(set(names) - set(saved))
      extra = sorted(set(saved) - set(names))
      raise CheckpointMismatchError(
          f'the checkpoint of round {step} in {self.directory} is another model\'s or '
          f'method\'s state: this run\'s state has {missing[:3]}{" …" if len(missing) > 3 else ""}'
          f' that it lacks, it has {extra[:3]}{" …" if len(extra) > 3 else ""} that the state '
          f'lacks')
    for name, leaf in zip(names, leaves):
      if tuple(saved[name].shape) != np.shape(leaf):
        raise CheckpointMismatchError(
            f'the checkpoint of round {step} in {self.directory} holds {name} of shape '
            f'{tuple(saved[name].shape)} where this run\'s state has {np.shape(leaf)}: it is '
            f'another model\'s state')
    specs = [jax.ShapeDtypeStruct(np.shape(leaf), jnp.result_type(leaf)) for leaf in leaves]
    abstract = dict(zip(names, specs)) if legacy else _nest(names, specs)
    restored = _flat_names(self.manager.restore(step, args=ocp.args.StandardRestore(abstract)))
    return jax.tree_util.tree_unflatten(treedef, [restored[name] for name in names])

  def restore(self, template: PyTree, max_round: Optional[int] = None,
              move_damaged: bool = True) -> Tuple[Optional[int], PyTree]:
    """(round, state) from the newest readable checkpoint of a round <= ``max_round``
    (any round when None), or (None, template) if there is none. Unreadable ones are
    moved aside with a warning (see the module docstring); with ``move_damaged=False``
    (a reader of a workdir, which must not change it) the first is DamagedCheckpoint."""
    for step in sorted(self.manager.all_steps(), reverse=True):
      if max_round is not None and step > max_round:
        continue
      try:
        return step, self._restore_step(step, template)
      except CheckpointMismatchError:
        raise
      except Exception as err:  # orbax / tensorstore errors of a damaged checkpoint
        reason = f'{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ""}'
        if not move_damaged:
          raise damaged(os.path.join(self.directory, str(step)), reason) from None
        target = self._move_aside(step, reason)
        log.warning('the checkpoint of round %d in %s is unreadable (%s); moved it to %s and '
                    'falling back to an earlier one', step, self.directory, reason, target)
    return None, template

  def close(self):
    self.manager.close()


def read(directory: str, round_index: Optional[int] = None) -> Tuple[int, dict]:
  """(round, tree) of the checkpoint of ``round_index`` (None: the newest) in a run's
  ``checkpoints/`` ``directory``: the nested dict of numpy arrays it holds, named by the
  state's pytree paths, read without a template. FileNotFoundError naming the kept
  rounds when there is no such checkpoint."""
  directory = os.path.abspath(directory)
  rounds = sorted(int(name) for name in os.listdir(directory) if name.isdigit()) \
      if os.path.isdir(directory) else []
  if not rounds and os.path.isdir(os.path.join(directory, 'checkpoints')):
    raise FileNotFoundError(f'{directory} holds no checkpoint: it is a run\'s directory; '
                            f'did you mean {os.path.join(directory, "checkpoints")}?')
  if round_index is None and rounds:
    round_index = rounds[-1]
  if round_index not in rounds:
    raise FileNotFoundError(f'{directory} holds no checkpoint of round {round_index}; its '
                            f'rounds: {rounds}')
  manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
      enable_async_checkpointing=False, create=False),
      item_handlers=ocp.StandardCheckpointHandler())
  try:
    return round_index, manager.restore(round_index)
  except Exception as err:   # orbax / tensorstore errors of a damaged checkpoint
    raise damaged(os.path.join(directory, str(round_index)),
                  f'{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ""}'
                  ) from None
  finally:
    manager.close()


class DamagedCheckpoint(OSError):
  """A checkpoint that cannot be read (cut short, a file missing)."""


def damaged(path: str, reason: str) -> DamagedCheckpoint:
  return DamagedCheckpoint(f'the checkpoint {path} is damaged and cannot be read ({reason}); '
                           f'a training run in its workdir moves it to corrupt_checkpoints/ '
                           f'and resumes from the newest readable one')
