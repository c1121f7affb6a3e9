"""A workdir holds one experiment's runs, and a re-run must never report a result
of a different configuration: one writer at a time (``WorkdirLock``), and each run
directory's fingerprint (``run.json``: the fields ``fingerprints.run_fields`` lists)
checked before it resumes (``check_run_dir``, ``check_other_seeds``, ``check_layout``)
and recorded (``record_run``).

``run.json``::

    {"fields": {"client.learning_rate": "0.05", ...},   # what determines the state
     "fingerprint": "<sha256 of fields>",
     "rounds": 30,                                       # the run's target
     "history": [{"time": ..., "rounds": 30, "event": "created"}, ...]}

``rounds`` is checked on its own: raising it continues a finished run only with
``config.resume='extend'`` (recorded in the history); lowering it evaluates the kept
checkpoint of that round, or refuses.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
import weakref
from typing import Dict, Iterable, Optional, Tuple

import ml_collections

from fedjax_shift.metrics import changed_fields, read_json, record_changes
from fedjax_shift.pipelines.fingerprints import (DATA_FIELDS_ADDED_AT, fingerprint,
                                                 other_benchmark_fields)

log = logging.getLogger('fedjax_shift')


RESUME_CHOICES = ('', 'extend')


class RunMismatchError(ValueError):
  """The workdir holds a run of another configuration."""


class WorkdirBusyError(RuntimeError):
  """Another live process holds the workdir."""


def _read_json(path: str) -> dict:
  return read_json(path, 'it records which configuration this run belongs to: restore it '
                         'or use a new --workdir')


def check_run_dir(run_dir: str, fields: Dict[str, str], run_config: ml_collections.ConfigDict,
                  resume: str) -> None:
  """Raises RunMismatchError when ``run_dir`` holds a run whose state fields differ
  from ``fields`` (``fingerprints.run_fields`` of ``run_config``), whose round target is
  below ``run_config.rounds`` without ``resume='extend'``, or whose kept checkpoints
  cannot give round ``run_config.rounds`` (``check_rounds``); recorded fields of other
  benchmarks' data (that cannot affect this run) are not compared. Reads only."""
  rounds = run_config.rounds
  path = os.path.join(run_dir, 'run.json')
  if os.path.exists(path):
    recorded = _read_json(path)
    changed = changed_fields(recorded['fields'], fields,
                             other_benchmark_fields(run_config.data.benchmark),
                             DATA_FIELDS_ADDED_AT)
    if changed:
      raise RunMismatchError(
          f'{run_dir} holds a run of another configuration; changed fields:\n  ' +
          '\n  '.join(changed) + '\nUse a new --workdir for the new configuration (or '
          f'delete {run_dir} to retrain it).')
    if rounds > recorded['rounds'] and resume != 'extend':
      raise RunMismatchError(
          f'{run_dir} was trained for rounds={recorded["rounds"]}; config.rounds={rounds} '
          f'would continue it. Pass --config.resume=extend to extend it (recorded in '
          f'run.json), or use a new --workdir.')
  check_rounds(run_dir, rounds)


def check_other_seeds(run_dir: str, fields: Dict[str, str],
                      run_config: ml_collections.ConfigDict, running: Iterable[str] = ()
                      ) -> None:
  """Raises RunMismatchError when a sibling ``seed_<s>`` directory of ``run_dir`` that
  this run does not train (not in ``running``) holds the same method trained with
  other fields or another ``run_config.rounds``: its results would be averaged with
  this run's as seeds of one configuration. Reads only."""
  parent, name = os.path.split(os.path.normpath(run_dir))
  if not name.startswith('seed_') or not os.path.isdir(parent):
    return
  running = {os.path.normpath(r) for r in running}
  for sibling in sorted(os.listdir(parent)):
    other = os.path.join(parent, sibling)
    path = os.path.join(other, 'run.json')
    if not sibling.startswith('seed_') or os.path.normpath(other) in running or \
        not os.path.exists(path):
      continue
    recorded = _read_json(path)
    changed = record_changes(recorded, fields, run_config.rounds,
                             other_benchmark_fields(run_config.data.benchmark),
                             DATA_FIELDS_ADDED_AT)
    if changed:
      raise RunMismatchError(
          f'{other} holds another seed of this method trained with another configuration '
          f'(its results would be averaged with this run\'s as seeds of one); changed:\n  ' +
          '\n  '.join(changed) + '\nUse a new --workdir, or run every seed with the same '
          'configuration (config.seeds naming them all; --config.resume=extend to extend '
          'them together).')


def check_layout(run_dirs: Iterable[str]) -> None:
  """Raises RunMismatchError when one of ``run_dirs`` is a plain run
  (``<method>/seed_<s>``) of a method whose directory holds points of a sweep
  (``<method>/<field>=<value>/seed_<s>``), or a point of a sweep of a method whose
  directory holds plain runs: a report would average the two as seeds of one
  configuration. Reads only."""
  for run_dir in run_dirs:
    parent = os.path.dirname(os.path.normpath(run_dir))
    swept = '=' in os.path.basename(parent)
    method_dir = os.path.dirname(parent) if swept else parent
    if not os.path.isdir(method_dir):
      continue
    others = [name for name in sorted(os.listdir(method_dir))
              if os.path.isdir(os.path.join(method_dir, name)) and
              (name.startswith('seed_') if swept else '=' in name)]
    if others:
      held = (f'plain runs ({", ".join(others)})' if swept else
              f'points of a config.sweep ({", ".join(others)})')
      this = (f'a point of a config.sweep into {parent}' if swept else
              f'without config.sweep into {run_dir}')
      raise RunMismatchError(
          f'{method_dir} holds {held}; this run trains {os.path.basename(method_dir)} {this}: '
          f'a report would average the two as seeds of one configuration. Use a new '
          f'--workdir, or add a value to the workdir\'s sweep as one more point '
          f'(config_history.jsonl holds its config.sweep).')


def record_run(run_dir: str, fields: Dict[str, str], rounds: int) -> None:
  """Writes (or updates) ``run.json`` after ``check_run_dir`` passed."""
  path = os.path.join(run_dir, 'run.json')
  now = time.strftime('%Y-%m-%dT%H:%M:%S')
  if os.path.exists(path):
    recorded = _read_json(path)
    if rounds > recorded['rounds']:
      recorded['history'].append({'time': now, 'rounds': rounds, 'event': 'extended',
                                  'from_rounds': recorded['rounds']})
      recorded['rounds'] = rounds
    else:
      return
  else:
    recorded = {'fields': fields, 'fingerprint': fingerprint(fields), 'rounds': rounds,
                'history': [{'time': now, 'rounds': rounds, 'event': 'created'}]}
  os.makedirs(run_dir, exist_ok=True)
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    json.dump(recorded, f, indent=1)
  os.replace(tmp, path)


def checkpoint_rounds(run_dir: str) -> Tuple[int, ...]:
  """The rounds of the checkpoints kept in ``<run_dir>/checkpoints`` (read-only)."""
  directory = os.path.join(run_dir, 'checkpoints')
  if not os.path.isdir(directory):
    return ()
  return tuple(sorted(int(name) for name in os.listdir(directory) if name.isdigit()))


def check_rounds(run_dir: str, rounds: int) -> None:
  """A run holding checkpoints past ``rounds`` can report round ``rounds`` only from
  its checkpoint of that round; raises RunMismatchError when it was not kept."""
  kept = checkpoint_rounds(run_dir)
  if kept and kept[-1] > rounds and rounds not in kept:
    raise RunMismatchError(
        f'{run_dir} has trained past config.rounds={rounds} and kept checkpoints of rounds '
        f'{list(kept)} only: set rounds to one of those (its checkpoint is evaluated), or use '
        f'a new --workdir to train {rounds} rounds.')


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


class WorkdirLock:
  """``<workdir>/.lock`` holding host, pid and start time, created exclusively.

  Every look at ``.lock`` and every change of it happens under an exclusive ``flock``
  of ``.lock.guard`` (held by one process at a time, let go by the kernel when its
  process dies, and removed when its holder is done), so that of any number of
  processes started together exactly one takes the lock, a dead run's included. The lock's content is written to a file of
  this process's own first and then linked into place, so a ``.lock`` is never seen
  empty or half-written. A lock left by a dead process on this host is taken over with
  a warning; a live lock (or one from another host, whose process cannot be checked)
  is an error that names its holder. Use as a context manager.
  """

  # The locks this process holds, for ``release_held`` (a process stopping at once).
  held_by_this_process: 'weakref.WeakSet[WorkdirLock]' = weakref.WeakSet()

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, '.lock')
    self.held = False

  def _holder(self) -> Tuple[Optional[dict], Optional[int]]:
    """(the lock's content or None when unreadable, its inode or None when absent)."""
    try:
      with open(self.path) as f:
        inode = os.fstat(f.fileno()).st_ino
        try:
          return json.load(f), inode
        except ValueError:
          return None, inode
    except OSError:
      return None, None

  @contextlib.contextmanager
  def _guard(self):
    """An exclusive ``flock`` of ``.lock.guard``, removed by its holder before it lets
    go (no file is left behind): a process that was waiting on a removed guard finds
    that its file is no longer the path's and locks the path's new file instead."""
    path = self.path + '.guard'
    while True:
      guard = open(path, 'a')
      fcntl.flock(guard.fileno(), fcntl.LOCK_EX)
      try:
        if os.stat(path).st_ino == os.fstat(guard.fileno()).st_ino:
          break
      except FileNotFoundError:
        pass
      guard.close()   # removed while this process waited: lock the path's new file
    try:
      yield
    finally:
      os.remove(path)
      guard.close()   # lets go of the flock

  def acquire(self) -> 'WorkdirLock':
    mine = {'host': socket.gethostname(), 'pid': os.getpid(),
            'started': time.strftime('%Y-%m-%dT%H:%M:%S')}
    draft = f'{self.path}.{mine["host"]}.{mine["pid"]}.tmp'
    with open(draft, 'w') as f:
      json.dump(mine, f)
    try:
      with self._guard():
        holder, inode = self._holder()
        if inode is not None:
          if holder is None:
            log.warning('%s is unreadable (not written by this library?); taking it over',
                        self.path)
          elif holder.get('host') != mine['host']:
            raise WorkdirBusyError(
                f'{os.path.dirname(self.path)} is in use by pid {holder.get("pid")} on host '
                f'{holder.get("host")} since {holder.get("started")}; if that run is dead, '
                f'delete {self.path}') from None
          elif _alive(int(holder.get('pid', -1))):
            raise WorkdirBusyError(
                f'{os.path.dirname(self.path)} is in use by a live run: pid {holder["pid"]} '
                f'on this host since {holder.get("started")}; wait for it or use another '
                f'--workdir') from None
          else:
            log.warning('taking over the lock of a dead run (pid %s, started %s) in %s',
                        holder.get('pid'), holder.get('started'), os.path.dirname(self.path))
          os.remove(self.path)
        os.link(draft, self.path)
        self.held = True
        WorkdirLock.held_by_this_process.add(self)
        return self
    finally:
      os.remove(draft)

  def release(self) -> None:
    if self.held:
      with self._guard():
        holder, _ = self._holder()
        if holder is not None and holder.get('pid') == os.getpid():
          os.remove(self.path)
      self.held = False
      WorkdirLock.held_by_this_process.discard(self)

  def __enter__(self) -> 'WorkdirLock':
    return self.acquire()

  @staticmethod
  def release_held() -> None:
    """Lets go of every lock this process holds (before it exits without unwinding)."""
    for lock in list(WorkdirLock.held_by_this_process):
      lock.release()

  def __exit__(self, *exc) -> None:
    self.release()
