"""Run loops, looked up by ``config.pipeline`` (``base.PIPELINES``), one file each:
``federated`` (every method × seed trained and evaluated), ``atp`` (ATP's protocol:
pretraining → α → test-time adapters), ``hetero`` (HeteroFedTTA's architecture groups)
and ``pretrain`` (a backbone only), all over the one run loop of ``loop.py``.
Adding a pipeline: one file plus one import line here.

    results = pipelines.run(config, workdir)   # validate, config.json, run, results.md
    run = pipelines.load_run(workdir, 'fedavg', seed=0)   # a trained run, back in Python
    metrics = pipelines.evaluate(run, adapters=('tent:episodic',))   # as results.json's
    pipelines.run(config, workdir, callbacks=[callbacks.EarlyStopping(...)])  # per round

What they share, one job a file: ``base`` (the registry, ``Results``, what results
record), ``run_config`` (the checks of the fields every run reads, and their resolved
values), ``fingerprints`` (the fields of a run's run.json), ``workdir`` (the lock and
the run.json checks), ``opening`` (a workdir's runs checked, restored and opened),
``runs`` (data, keys and shardings of one run), ``programs`` (its compiled programs),
``single_run`` / ``lockstep`` (one run, or several in one program), ``sweep`` (grids),
``load`` (a finished run back in Python, and its evaluation), ``callbacks`` (hooks into
the run loop: early stopping, loggers).
"""
from __future__ import annotations

import json
from typing import Sequence

import ml_collections

from fedjax_shift import distributed
from fedjax_shift.pipelines import atp, federated, hetero, pretrain, tta_bench  # noqa: F401
from fedjax_shift.pipelines import callbacks as callbacks_lib
from fedjax_shift.pipelines.base import (PIPELINES, Results, format_results,  # noqa: F401
                                         write_results)
from fedjax_shift.pipelines.opening import prologue  # noqa: F401
from fedjax_shift.pipelines.run_config import validate  # noqa: F401
from fedjax_shift.pipelines.load import LoadedRun, evaluate, load_backbone, load_run  # noqa: F401
from fedjax_shift.pipelines.workdir import (RunMismatchError, WorkdirBusyError,  # noqa: F401
                                            WorkdirLock)


class PrimaryRefused(RuntimeError):
  """Process 0 of a multi-process run refused it (its workdir lock or a fingerprint)."""


def run(config: ml_collections.ConfigDict, workdir: str,
        callbacks: Sequence[callbacks_lib.Callback] = ()) -> Results:
  """Validates ``config``, locks ``workdir`` (one writer), checks its runs' fingerprints,
  writes the prologue, runs ``config.pipeline`` and writes results.md; returns its
  ``Results``. ``callbacks``: ``callbacks.Callback``s told of every run's start, rounds
  and end, after the config's own (``config.early_stopping``, ``config.log_to``). Over several processes (fedjax_shift/distributed.py) process 0 locks,
  checks and writes, and its verdict reaches every process before anything trains."""
  pipeline = PIPELINES.get(config.pipeline, 'config.pipeline')
  differing = distributed.differing_processes(json.dumps(   # progress: process 0's alone
      {k: v for k, v in config.to_dict().items() if k != 'progress'}, sort_keys=True,
      default=repr))
  if differing:
    raise ValueError(f'processes {differing} were started with another config than '
                     f'process 0: every process of a run runs the same command')
  primary = distributed.is_primary()
  validate(config, workdir if primary else None)
  lock = WorkdirLock(workdir)
  if primary:
    try:
      lock.acquire()
      try:
        prologue(config, workdir)
      except BaseException:
        lock.release()
        raise
    except Exception as err:   # the others learn why before raising it here
      distributed.agree(f'{type(err).__name__}: {err}')
      raise
  refusal = distributed.agree(None)   # process 0 went on; the others learn it here
  if refusal is not None:
    raise PrimaryRefused(f'process 0 refused the run: {refusal}')
  try:
    with callbacks_lib.given(callbacks):
      results = pipeline(config, workdir)
    if primary:
      write_results(workdir, results)
  finally:
    if primary:
      lock.release()
  return results
