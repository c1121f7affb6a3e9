"""metrics.jsonl: one JSON object per round, each append flushed to disk, and the
TensorBoard event files derived from it (``events.py``).

On resume the records after the checkpoint's round are recomputed, so they are
removed from the file — with a warning naming them, after the whole file is copied
to ``metrics.jsonl.before_resume_<round>``. A line that is not JSON is an error
naming it, unless it is the last line (a write cut by a kill), which is dropped
with a warning.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
from typing import Dict, Iterable, List, Optional, Tuple

from fedjax_shift import events

log = logging.getLogger('fedjax_shift')


# Record fields that measure the machine rather than the run (two identical runs
# differ in them).
TIMING_FIELDS = ('round_seconds', 'examples_per_second', 'compile_seconds')


def without_timing(records: Iterable[Dict]) -> List[Dict]:
  """``records`` without their ``TIMING_FIELDS``: what a repeated run must reproduce."""
  return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in records]


def _clean(value):
  if isinstance(value, float) and not math.isfinite(value):
    return None if math.isnan(value) else ('inf' if value > 0 else '-inf')
  return value


class MetricsWriter:
  """Appends per-round metrics to ``<directory>/metrics.jsonl``, keeping the records
  of rounds <= ``resume_round`` (None: a new run), and to its TensorBoard event file,
  written anew from the kept records (``hparams``: the run's fingerprint fields;
  ``tensorboard`` False: no event file)."""

  def __init__(self, directory: str, resume_round: int | None,
               hparams: Optional[Dict[str, str]] = None, tensorboard: bool = True):
    self.path = os.path.join(directory, 'metrics.jsonl')
    text = ''
    if os.path.exists(self.path):
      with open(self.path) as f:
        text = f.read()
    records = parse_metrics(text, self.path)
    kept = [r for r in records if resume_round is not None and r['round'] <= resume_round]
    self.events = events.EventWriter(directory, kept, hparams) if tensorboard else None
    lines = sum(1 for line in text.splitlines() if line.strip())
    if text and len(kept) == lines and text.endswith('\n'):
      return  # nothing to drop: append after the existing records
    if len(kept) < len(records):
      backup = f'{self.path}.before_resume_{resume_round or 0}'
      shutil.copyfile(self.path, backup)
      dropped = sorted({r['round'] for r in records if r not in kept})
      log.warning('%s: records of rounds %s come after the checkpoint of round %s and are '
                  'recomputed; the previous file is kept as %s', self.path,
                  _ranges(dropped), resume_round or 0, backup)
    tmp = self.path + '.tmp'
    with open(tmp, 'w') as f:
      for record in kept:
        f.write(json.dumps(record) + '\n')
    os.replace(tmp, self.path)

  def write(self, record: Dict) -> None:
    cleaned = {k: _clean(v) for k, v in record.items()}
    with open(self.path, 'a') as f:
      f.write(json.dumps(cleaned) + '\n')
      f.flush()
      os.fsync(f.fileno())
    if self.events is not None:
      self.events.write(cleaned)

  def close(self) -> None:
    if self.events is not None:
      self.events.close()


class NullWriter:
  """A MetricsWriter that writes nothing: a process other than process 0 of a
  multi-process run (fedjax_shift/distributed.py)."""

  def write(self, record: Dict) -> None:
    del record

  def close(self) -> None:
    pass


def _ranges(values: List[int]) -> str:
  if not values:
    return ''
  out, start, prev = [], values[0], values[0]
  for v in values[1:] + [None]:
    if v is not None and v == prev + 1:
      prev = v
      continue
    out.append(f'{start}' if start == prev else f'{start}–{prev}')
    if v is not None:
      start = prev = v
  return ', '.join(out)


def read_json(path: str, advice: str) -> Dict:
  """A run's JSON file (results.json, run.json, config.json); one that does not parse
  is a ValueError naming it, followed by ``advice``."""
  try:
    with open(path) as f:
      return json.load(f)
  except json.JSONDecodeError as err:
    raise ValueError(f'{path} is not valid JSON ({err}); {advice}') from None


def drop_cut_line(path: str) -> bool:
  """Rewrites metrics.jsonl ``path`` without its last line when that line was cut short
  (a kill while writing it; ``parse_metrics`` warns), the line kept in ``<path>.cut``;
  returns whether it did. A finished run's file is repaired this way, as a resumed
  run's is by ``MetricsWriter``."""
  if not os.path.exists(path):
    return False
  with open(path) as f:
    text = f.read()
  records = parse_metrics(text, path)
  lines = [line for line in text.splitlines() if line.strip()]
  if len(records) == len(lines):
    return False
  with open(path + '.cut', 'a') as f:
    f.write(lines[-1] + '\n')
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    f.writelines(json.dumps(record) + '\n' for record in records)
  os.replace(tmp, path)
  log.warning('%s: its cut last line is moved to %s.cut', path, path)
  return True


def read_metrics(path: str) -> List[Dict]:
  """The records of ``path`` ([] if absent); see ``parse_metrics``."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return parse_metrics(f.read(), path)


def parse_metrics(text: str, path: str) -> List[Dict]:
  """The records of metrics.jsonl ``text`` read from ``path``. A malformed last line
  (cut by a kill) is dropped with a warning; a malformed line before it is a
  ValueError naming it."""
  lines = [(number, line.strip()) for number, line in enumerate(text.splitlines(), 1)
           if line.strip()]
  records = []
  for i, (number, line) in enumerate(lines):
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError as err:
      if i == len(lines) - 1:
        log.warning('%s: dropping its last line %d, cut short (%s)', path, number, err.msg)
        break
      raise ValueError(f'{path}, line {number}: not a JSON record ({err.msg}); the lines '
                       f'after it hold {len(lines) - i - 1} more records. Repair or remove '
                       f'the line, then re-run') from None
  return records


# Fields added to the configuration after runs were recorded, each with the (JSON) value
# that trains as those runs trained: a run.json without the field matches a configuration
# that sets it to that value, so a workdir survives an upgrade that adds an option.
FIELDS_ADDED_AT = {'client.augmentation': '[]'}
# Fields added later still, left out of a run's recorded fields (and so of its
# fingerprint) while at the value that trains as the runs before them: a workdir's
# fingerprint survives the upgrade, and a run that sets the field records it.
FIELDS_OMITTED_AT = {'client.clip_norm': '0.0', 'gma.global_learning_rate': '1.0',
                     'data.min_examples_rule': '"redraw"'}


# How run.json records a method's client overrides: its learning rate and batch size
# under the names runs have always been recorded with (each method's section had them,
# 0 for the shared value), any other field as client_overrides.<method>.<field>.
RECORDED_OVERRIDES = {'learning_rate': ('client_learning_rate', 0.0),
                      'batch_size': ('client_batch_size', 0)}
OVERRIDES = 'client_overrides.'


def _overrides_as_written(fields: Dict[str, str]) -> Dict[str, str]:
  """``fields`` with each method's recorded learning rate and batch size under the name
  a config gives them, 'client_overrides.<method>.<field>', and left out where the
  record holds the shared value (no override)."""
  recorded_as = {recorded: (field, json.dumps(shared))
                 for field, (recorded, shared) in RECORDED_OVERRIDES.items()}
  out = {}
  for key, value in fields.items():
    method, _, name = key.partition('.')
    if name in recorded_as:
      field, shared = recorded_as[name]
      if value != shared:
        out[f'{OVERRIDES}{method}.{field}'] = value
    else:
      out[key] = value
  return out


def _effective(fields: Dict[str, str], key: str) -> Tuple[Optional[str], str]:
  """(the value ``key`` trains with, how to show it): an override that is not set
  trains with the shared ``client.<field>``."""
  if key in fields:
    return fields[key], fields[key]
  if key.startswith(OVERRIDES):
    shared = 'client.' + key.rsplit('.', 1)[1]
    if shared in fields:
      return fields[shared], f'{fields[shared]} (none: the shared {shared})'
  return None, '(absent)'


def changed_fields(recorded: Dict[str, str], fields: Dict[str, str],
                   ignored: Iterable[str] = (), added: Optional[Dict[str, str]] = None
                   ) -> list:
  """'field: old → new' for every field a recorded run and ``fields`` disagree on
  (recorded fields in ``ignored`` are not compared; a field of FIELDS_ADDED_AT or
  ``added`` that the record lacks counts as recorded at its value), sorted. A method's
  client overrides are compared by the values they train with (an override equal to the
  shared value changes nothing, nor does the shared value under an override) and named
  as a config writes them."""
  ignored = set(ignored)
  old = {k: v for k, v in recorded.items() if k not in ignored}
  old.update({k: v for k, v in {**FIELDS_ADDED_AT, **(added or {})}.items()
              if k not in old and k in fields})
  old, new = _overrides_as_written(old), _overrides_as_written(fields)
  # A shared client field that the run's method overrides in both does not train it.
  overridden = {'client.' + key.rsplit('.', 1)[1] for key in set(old) & set(new)
                if key.startswith(OVERRIDES)}
  changed = []
  for key in sorted((set(old) | set(new)) - overridden):
    (before, shown_before), (after, shown_after) = _effective(old, key), _effective(new, key)
    if before != after:
      changed.append(f'{key}: {shown_before} → {shown_after}')
  return changed


def record_changes(recorded: dict, fields: Dict[str, str], rounds: int,
                   ignored: Iterable[str] = (), added: Optional[Dict[str, str]] = None
                   ) -> list:
  """``changed_fields`` of a run.json record (``{'fields', 'rounds'}``) against
  ``fields``, plus 'rounds: old → new' when the round targets differ."""
  changed = changed_fields(recorded['fields'], fields, ignored, added)
  if recorded['rounds'] != rounds:
    changed.append(f'rounds: {recorded["rounds"]} → {rounds}')
  return changed
