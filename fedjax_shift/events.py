"""TensorBoard event files of a run directory, derived from its metrics.jsonl.

``<run_dir>/tensorboard/`` holds one event file: every numeric field of every
metrics.jsonl record as a scalar at its round (training loss, each evaluated accuracy,
ATP's α and the learned rates per module, seconds per round, compile seconds,
examples/s), and the run's fingerprint fields as TensorBoard hyperparameters, so that
the HParams view compares runs. metrics.jsonl stays the source of truth: whenever a
run directory is opened its event file is written anew from the records kept there,
and ``launch/report.py --tensorboard=WORKDIR`` rebuilds every run's. Written with
tensorboardX, which needs protobuf alone (no TensorFlow, no PyTorch)::

    tensorboard --logdir WORKDIR
"""
from __future__ import annotations

import glob
import json
import logging
import math
import os
import shutil
import struct
from typing import Dict, Iterable, List, Mapping, Optional

log = logging.getLogger('fedjax_shift')
DIRECTORY = 'tensorboard'
# NaN and inf are recorded as they are (a diverged round); tensorboardX warns on each.
logging.getLogger('tensorboardX.x2num').setLevel(logging.ERROR)


class EventDirectoryError(OSError):
  """The event directory of a run cannot be written."""


def scalars(record: Mapping[str, object]) -> Dict[str, float]:
  """The record's numeric fields but its round, as floats (metrics.jsonl writes NaN as
  null and infinities as 'inf' / '-inf')."""
  out = {}
  for key, value in record.items():
    if key == 'round' or isinstance(value, bool):
      continue
    if isinstance(value, (int, float)):
      out[key] = float(value)
    elif value is None:
      out[key] = math.nan
    elif value in ('inf', '-inf'):
      out[key] = float(value)
  return out


def _hparam_value(text: str):
  """A fingerprint field's JSON value as TensorBoard takes it (number, bool, string)."""
  try:
    value = json.loads(text)
  except (TypeError, ValueError):
    return str(text)
  if isinstance(value, (bool, int, float, str)) and not (
      isinstance(value, float) and not math.isfinite(value)):
    return value
  return json.dumps(value, sort_keys=True)


def run_identity(run_dir: str) -> Dict[str, str]:
  """The hyperparameters that name a run in TensorBoard's HParams view, from its
  directory ``<workdir>/<method>[/<point>]/seed_<s>``: 'method', 'point' (a sweep's,
  '' for none), 'seed' (JSON values, as the fingerprint fields)."""
  parts = os.path.normpath(run_dir).split(os.sep)
  if len(parts) < 2 or not parts[-1].startswith('seed_') or not parts[-1][5:].isdigit():
    return {}
  swept = len(parts) >= 3 and '=' in parts[-2]
  return {'method': json.dumps(parts[-3] if swept else parts[-2]),
          'point': json.dumps(parts[-2] if swept else ''), 'seed': parts[-1][5:]}


def event_files(directory: str) -> List[str]:
  """The TensorBoard event files in ``directory`` ([] if it does not exist)."""
  return glob.glob(os.path.join(directory, 'events.out.tfevents.*'))


def intact(directory: str) -> bool:
  """Whether every event file in ``directory`` is a whole sequence of records (length,
  masked CRC-32C of the length, data, masked CRC-32C of the data)."""
  from tensorboardX.crc32c import crc32c

  def masked(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xa282ead8) & 0xffffffff

  files = event_files(directory)
  if not files:
    return False
  for path in files:
    with open(path, 'rb') as f:
      data = f.read()
    at = 0
    while at < len(data):
      header = data[at:at + 12]
      if len(header) < 12:
        return False
      length, = struct.unpack('<Q', header[:8])
      if struct.unpack('<I', header[8:])[0] != masked(header[:8]):
        return False
      body = data[at + 12:at + 12 + length]
      footer = data[at + 12 + length:at + 16 + length]
      if len(body) < length or len(footer) < 4 or \
          struct.unpack('<I', footer)[0] != masked(body):
        return False
      at += 16 + length
  return True


class EventWriter:
  """Writes ``<run_dir>/tensorboard/`` anew from ``records`` (the metrics.jsonl
  records kept), then one record at a time with ``write``. ``hparams``: the run's
  fingerprint fields {path: JSON value}. Raises EventDirectoryError naming the
  directory when it cannot be written."""

  def __init__(self, run_dir: str, records: Iterable[Mapping[str, object]],
               hparams: Optional[Mapping[str, str]] = None):
    from tensorboardX import SummaryWriter
    self.directory = os.path.join(run_dir, DIRECTORY)
    records = list(records)
    present = bool(event_files(self.directory))
    if records and not present:
      log.warning('%s: no event files; writing them from metrics.jsonl (%d records)',
                  self.directory, len(records))
    elif present and not intact(self.directory):
      log.warning('%s: damaged event file; rebuilt from metrics.jsonl (%d records)',
                  self.directory, len(records))
    read_only = [path for path in (run_dir, self.directory)
                 if os.path.isdir(path) and not os.access(path, os.W_OK)]
    if read_only:   # else the removal below fails quietly and makedirs says 'File exists'
      raise EventDirectoryError(
          f'cannot write TensorBoard event files to {self.directory}: {read_only[0]} is '
          f'read-only; give it write access (or copy the workdir somewhere writable) and run '
          f'again')
    try:
      if os.path.lexists(self.directory) and not os.path.isdir(self.directory):
        raise NotADirectoryError(f'{self.directory} is not a directory')
      shutil.rmtree(self.directory, ignore_errors=True)
      os.makedirs(self.directory)
      probe = os.path.join(self.directory, '.writable')
      with open(probe, 'w'):
        pass
      os.remove(probe)
    except OSError as error:
      raise EventDirectoryError(
          f'cannot write TensorBoard event files to {self.directory} ({error}); make it a '
          f'writable directory (or remove what is in the way) and run again') from None
    self.writer = SummaryWriter(logdir=self.directory, flush_secs=3600)
    if hparams:   # the run's name first: the HParams view groups runs by it
      self._write_hparams({**run_identity(run_dir), **hparams}, records)
    for record in records:
      self._add(record)
    self.writer.flush()

  def _write_hparams(self, hparams: Mapping[str, str], records: List[Mapping]) -> None:
    """The run's session (its hyperparameters) without an experiment summary: the
    HParams view then lists as metrics every scalar the run writes, those of later
    rounds too (an experiment summary written now would fix them to the records')."""
    from tensorboardX.summary import hparams as hparams_summary
    tags = sorted({'loss'} | {tag for record in records for tag in scalars(record)})
    _, session_start, session_end = hparams_summary(
        {path: _hparam_value(value) for path, value in hparams.items()},
        {tag: 0.0 for tag in tags})
    for summary in (session_start, session_end):
      self.writer.file_writer.add_summary(summary)

  def _add(self, record: Mapping[str, object]) -> None:
    step = int(record['round'])
    for tag, value in scalars(record).items():
      self.writer.add_scalar(tag, value, global_step=step)

  def write(self, record: Mapping[str, object]) -> None:
    """Adds one metrics.jsonl record and flushes it to disk."""
    self._add(record)
    self.writer.flush()

  def close(self) -> None:
    self.writer.close()


def rebuild(run_dir: str, records: Iterable[Mapping[str, object]],
            hparams: Optional[Mapping[str, str]] = None) -> str:
  """Writes ``<run_dir>/tensorboard/`` anew from ``records``; returns the directory."""
  writer = EventWriter(run_dir, records, hparams)
  writer.close()
  return writer.directory


def ensure(run_dir: str, records: Iterable[Mapping[str, object]],
           hparams: Optional[Mapping[str, str]] = None) -> None:
  """Rebuilds the event files of a finished run only when missing or damaged."""
  if not intact(os.path.join(run_dir, DIRECTORY)):
    rebuild(run_dir, records, hparams)
