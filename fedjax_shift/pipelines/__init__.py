"""Run loops, looked up by ``config.pipeline`` (``base.PIPELINES``), one file each:
``federated`` (every method × seed trained and evaluated), ``atp`` (ATP's protocol:
pretraining → α → test-time adapters), ``hetero`` (HeteroFedTTA's architecture groups)
and ``pretrain`` (a backbone only), all over the one run loop of ``loop.py``.
Adding a pipeline: one file plus one import line here.

    results = pipelines.run(config, workdir)   # validate, config.json, run, results.md
"""
from __future__ import annotations

import ml_collections

from fedjax_shift.pipelines import atp, federated, hetero, pretrain  # noqa: F401
from fedjax_shift.pipelines.base import (PIPELINES, Results, format_results,  # noqa: F401
                                         prologue, validate, write_results)
from fedjax_shift.pipelines.workdir import (RunMismatchError, WorkdirBusyError,  # noqa: F401
                                            WorkdirLock)


def run(config: ml_collections.ConfigDict, workdir: str) -> Results:
  """Validates ``config``, locks ``workdir`` (one writer), checks its runs' fingerprints,
  writes the prologue, runs ``config.pipeline`` and writes results.md; returns its
  ``Results``."""
  pipeline = PIPELINES.get(config.pipeline, 'config.pipeline')
  validate(config, workdir)
  with WorkdirLock(workdir):
    prologue(config, workdir)
    results = pipeline(config, workdir)
    write_results(workdir, results)
  return results
