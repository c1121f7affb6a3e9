"""Opening a workdir's runs, before and as they train: ``prologue`` (every run
directory the pipeline will train checked by ``preflight`` before anything is written,
then config.json, the invocation history, the devices), ``checked_fields`` (a run's
fingerprint checked on every process of a run) and ``open_run`` (a run directory
restored from its newest checkpoint, its run.json recorded, its metrics opened).
"""
from __future__ import annotations

import json
import logging
import os
import platform
import time
from typing import Any, Dict, NamedTuple, Optional

import ml_collections

from fedjax_shift import checkpoint, distributed, events
from fedjax_shift.pipelines import workdir as workdir_lib
from fedjax_shift.pipelines.base import PIPELINES, hardware
from fedjax_shift.pipelines.fingerprints import run_fields

log = logging.getLogger('fedjax_shift')


def checked_fields(run_dir: str, run_config: ml_collections.ConfigDict, section: str,
                   resume: str, depends_on: Optional[dict] = None) -> dict:
  """``workdir.check_run_dir`` on every process of a run: process 0 reads the run's files
  (which it writes, and the others could read half-written), its verdict reaches every
  process; returns the fields."""
  fields = run_fields(run_config, section, depends_on)
  distributed.primary_decides(lambda: workdir_lib.check_run_dir(run_dir, fields, run_config,
                                                                resume),
                              f'the check of {run_dir}/run.json')
  return fields


class OpenRun(NamedTuple):
  """A run directory opened for training (``open_run``)."""
  checkpointer: Any        # checkpoint.Checkpointer of <run_dir>/checkpoints
  start_round: int         # rounds already trained (0 for a new run)
  state: Any               # the restored (or initial) state, last leaf the seconds so far
  writer: Any              # metrics.MetricsWriter, None when no round is left to train


def open_run(run_dir: str, config: ml_collections.ConfigDict, fields: dict, state,
             max_round: Optional[int] = None) -> OpenRun:
  """Restores ``state`` (a tuple whose last element is the elapsed seconds) from the
  latest checkpoint of ``run_dir`` up to ``config.rounds`` (and ``max_round``: runs
  trained in lockstep resume at a round they all have), records run.json and opens
  metrics.jsonl from the restored round."""
  from fedjax_shift.metrics import MetricsWriter, NullWriter, drop_cut_line, read_metrics
  checkpointer = checkpoint.Checkpointer(os.path.join(run_dir, 'checkpoints'),
                                         config.checkpoint_every, config.keep_checkpoints)
  limit = config.rounds if max_round is None else min(config.rounds, max_round)
  start_round, state = checkpointer.restore(checkpoint.RunState(*state), max_round=limit)
  start_round = start_round or 0
  if start_round:
    log.info('resumed from round %d in %s', start_round, run_dir)
  primary = distributed.is_primary()
  if primary:
    workdir_lib.record_run(run_dir, fields, config.rounds)
  tensorboard = config.tensorboard
  writer = None
  if start_round < config.rounds:
    writer = (MetricsWriter(run_dir, start_round, fields, tensorboard) if primary else
              NullWriter())
  elif primary:   # finished: a cut last line dropped, its event files written if missing
    drop_cut_line(os.path.join(run_dir, 'metrics.jsonl'))
    if tensorboard:
      events.ensure(run_dir, read_metrics(os.path.join(run_dir, 'metrics.jsonl')), fields)
  return OpenRun(checkpointer, start_round, state, writer)


def preflight(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Checks every run directory the pipeline will train before anything is written,
  then deletes the checkpoints each keeps past its config.keep_checkpoints (a re-run
  with a lower value frees disk space before it writes)."""
  entries = PIPELINES.meta(config.pipeline)['run_dirs'](config, workdir)
  running = [entry[0] for entry in entries]
  workdir_lib.check_layout(running)
  for run_dir, run_config, section, *depends_on in entries:
    fields = run_fields(run_config, section, *depends_on)
    workdir_lib.check_run_dir(run_dir, fields, run_config, config.resume)
    workdir_lib.check_other_seeds(run_dir, fields, run_config, running)
  for run_dir, run_config, *_ in entries:
    deleted = checkpoint.prune(os.path.join(run_dir, 'checkpoints'),
                               run_config.keep_checkpoints, run_config.rounds)
    if deleted:
      log.info('%s: deleted the checkpoints of rounds %s (config.keep_checkpoints=%d)',
               run_dir, list(deleted), run_config.keep_checkpoints)


def prologue(config: ml_collections.ConfigDict, workdir: str) -> Dict[str, object]:
  """With the workdir validated and locked: checks its runs (``preflight``), writes
  ``config.json``, appends the invocation to ``config_history.jsonl`` and logs the
  devices; returns the hardware."""
  preflight(config, workdir)
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    f.write(config.to_json_best_effort(indent=1))
  with open(os.path.join(workdir, 'config_history.jsonl'), 'a') as f:
    f.write(json.dumps({'time': time.strftime('%Y-%m-%dT%H:%M:%S'), 'pid': os.getpid(),
                        'host': platform.node(),
                        'config': json.loads(config.to_json_best_effort())}) + '\n')
  info = hardware()
  log.info('pipeline %s; devices: %s (%s), jax %s, device memory %s GB', config.pipeline,
           info['devices'], info['backend'], info['jax'], info.get('device_memory_gb', 'n/a'))
  return info
