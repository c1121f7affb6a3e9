"""A run's fingerprint: the config fields that determine its trained state, recorded in
its ``run.json`` (``workdir.py`` checks and records them) and compared before it resumes.

``run_fields(config, section)`` is every field of ``config`` but ``NON_STATE_FIELDS``
(fields that change only outputs or speed: progress, evaluation and checkpoint cadence,
the engine, test-time adapters), other methods' sections and other benchmarks' data
sections (a variant's section whole: its method's fields with its changes; the run's
benchmark's fields flat, ``data.<field>``); a method's client overrides under their
recorded names; a backbone file by its
content (``content_digest``); what the run reads from another run
(``depends_on.<key>``). ``fingerprint(fields)`` is their sha256.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Dict, Iterable, Optional, Sequence

import ml_collections

from fedjax_shift.algorithms import ALGORITHMS, base
from fedjax_shift.benchmarks import BENCHMARKS, DATA_DEFAULTS, data_view
from fedjax_shift.benchmarks.label_skew import SPLIT_AND_CORRUPTION_DEFAULTS
from fedjax_shift.metrics import FIELDS_OMITTED_AT, RECORDED_OVERRIDES
from fedjax_shift.pipelines.base import PIPELINES

log = logging.getLogger('fedjax_shift')


# Top-level fields (and dotted paths) that do not change a run's trained state.
NON_STATE_FIELDS = ('progress', 'eval_every', 'checkpoint_every', 'keep_checkpoints', 'seeds',
                    'algorithms', 'rounds', 'resume', 'eval_adapters', 'eval_adapter_algorithms',
                    'eval_adapter_batch_size', 'eval_adapter_splits', 'paper_tables', 'paper_rounds',
                    'engine', 'adapters', 'tta',
                    'pipeline', 'data.store', 'data.store_dir', 'data.pad_to', 'on_divergence', 'log_every',
                    'tensorboard', 'sweep', 'sweep_select', 'sweep_metric', 'early_stopping',
                    'log_to', 'log_project')


# Runs recorded before the benchmarks had data sections of their own recorded the
# label-skew benchmark's split fractions whatever their benchmark, at these values: a
# benchmark without split fractions of its own records them still, so the fingerprints
# of those runs stay.
FIELDS_KEPT_AT = {f'data.split_fractions.{split}': json.dumps(fraction) for split, fraction
                  in SPLIT_AND_CORRUPTION_DEFAULTS['split_fractions'].items()}
# The digit domains read the corrupted test split's fields of the label-skew benchmark,
# unrecorded then: a digit-domains run.json without them ran at these values
# (``metrics.changed_fields``' ``added``).
DATA_FIELDS_ADDED_AT = {
    'data.corruptions': json.dumps(list(SPLIT_AND_CORRUPTION_DEFAULTS['corruptions'])),
    'data.severity': json.dumps(SPLIT_AND_CORRUPTION_DEFAULTS['severity'])}


def _flatten(tree, prefix: str = '') -> Dict[str, object]:
  out = {}
  for key, value in tree.items():
    path = f'{prefix}{key}'
    if isinstance(value, dict):
      out.update(_flatten(value, path + '.'))
    else:
      out[path] = value
  return out


def _config_fields(config: ml_collections.ConfigDict, own_sections: Iterable[str]
                   ) -> Dict[str, str]:
  """{dotted field: JSON value} of all of ``config`` but ``NON_STATE_FIELDS`` and the
  method sections (``method_sections``) other than ``own_sections``; a variant's own
  section whole, as its builder reads it (the fields it shares with its method too);
  of ``config.data`` what its benchmark reads (``data_view``: the shared fields and its
  own section's, flat, as runs have always recorded them; ``FIELDS_KEPT_AT`` where it
  has no split fractions)."""
  skip = method_sections() - set(own_sections)
  tree = config.to_dict()
  tree['data'] = data_view(config.data).to_dict()   # data.<field>, as runs record them
  for name in own_sections:
    if name in ALGORITHMS and ALGORITHMS.variant_of(name):
      tree[name] = ALGORITHMS.section(name, config).to_dict()
  out = {}
  for path, value in _flatten(tree).items():
    top = path.split('.')[0]
    if top in skip or any(path == f or path.startswith(f + '.') for f in NON_STATE_FIELDS):
      continue
    recorded = json.dumps(value, sort_keys=True, default=repr)
    if FIELDS_OMITTED_AT.get(path) != recorded:
      out[path] = recorded
  if 'split_fractions' not in tree['data']:
    out.update(FIELDS_KEPT_AT)
  return out


# Where content digests of large input files are cached, keyed by path, size,
# modification time, inode and status-change time, so that a re-run reads the digest
# instead of hashing the file again.
DIGEST_CACHE = os.path.join(os.path.expanduser('~'), '.cache', 'fedjax_shift', 'digests.json')


def _hash_file(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      digest.update(block)
  return digest.hexdigest()


def content_digest(path: str, cache: Optional[str] = None) -> str:
  """sha256 of a file's bytes, or of a directory's files (relative names and digests, in
  order): what a run reads from ``path`` (e.g. ``backbone.weights``), so rewriting the
  file in place changes the run's fingerprint. Each file is hashed once per (path,
  size, modification time, inode, status-change time: an edit that restores the size
  and the modification time still changes the last, which no user can set); later
  calls read the digest from ``cache``."""
  if not os.path.exists(path):
    raise FileNotFoundError(f'{path} does not exist')
  cache = cache or DIGEST_CACHE
  files = ([path] if os.path.isfile(path) else
           sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names))
  try:
    with open(cache) as f:
      known = json.load(f)
  except (OSError, ValueError):
    known = {}
  parts, changed = [], False
  for name in files:
    stat = os.stat(name)
    key = '|'.join(str(part) for part in (os.path.abspath(name), stat.st_size, stat.st_mtime_ns,
                                           stat.st_ino, stat.st_ctime_ns))
    if key not in known:
      known[key] = _hash_file(name)
      changed = True
    parts.append(f'{os.path.relpath(name, path) if name != path else ""}:{known[key]}')
  if changed:
    try:
      os.makedirs(os.path.dirname(cache), exist_ok=True)
      tmp = f'{cache}.{os.getpid()}.tmp'
      with open(tmp, 'w') as f:
        json.dump(known, f)
      os.replace(tmp, cache)
    except OSError as err:   # a read-only home: digests are recomputed next time
      log.warning('could not cache content digests in %s (%s)', cache, err)
  return parts[0].split(':', 1)[1] if os.path.isfile(path) else hashlib.sha256(
      '\n'.join(parts).encode()).hexdigest()


def fingerprint(fields: Dict[str, str]) -> str:
  """The sha256 of a run's fields (``run_fields``), as run.json records it."""
  return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def method_sections() -> set:
  """Top-level config sections that belong to one method or pipeline stage."""
  return set(ALGORITHMS.names()) | {section for name in PIPELINES.names()
                                    for section in PIPELINES.defaults(name)}


def other_benchmark_fields(benchmark: str) -> set:
  """'data.<field>' of the fields only other benchmarks read: runs recorded before the
  benchmarks had sections of their own recorded some, which cannot change this
  benchmark's runs (the resume checks do not compare them)."""
  own = set(DATA_DEFAULTS) | set(BENCHMARKS.defaults(benchmark) if benchmark in
                                 BENCHMARKS.names() else ())
  return {f'data.{field}' for name in BENCHMARKS.names()
          for field in BENCHMARKS.defaults(name) if field not in own}


def override_fields(config: ml_collections.ConfigDict, names: Sequence[str]) -> dict:
  """The fingerprinted fields of the client overrides of ``names``' methods."""
  fields = {}
  for name in names:
    if name not in ALGORITHMS:
      continue
    overrides = base.client_overrides(config, name)
    for field, (recorded, shared) in RECORDED_OVERRIDES.items():
      fields[f'{name}.{recorded}'] = json.dumps(overrides.pop(field, shared))
    fields.update({f'client_overrides.{name}.{field}': json.dumps(value, default=repr)
                   for field, value in overrides.items()})
  return fields


def run_fields(config: ml_collections.ConfigDict, section: str,
               depends_on: Optional[dict] = None) -> Dict[str, str]:
  """The fingerprinted fields of a run trained by ``section``'s method (not those of
  other methods' sections, nor other benchmarks' sections of ``config.data``), with
  ``depends_on.<key>`` for what it reads from another run (``depends_on``)."""
  # The pretrained backbone (pipelines/pretrain.py) belongs to a run that starts from it.
  own = (section,) + (('backbone',) if 'backbone' in config and config.backbone.weights else ())
  fields = {path: value for path, value in _config_fields(config, own).items()
            if not path.startswith('client_overrides.')}
  fields.update(override_fields(config, own))
  weights = config.backbone.weights if 'backbone' in config else ''
  if weights and weights != 'pretrain' and os.path.exists(weights):
    # a path is not an identity: the same file may be rewritten with other weights
    fields['backbone.content'] = json.dumps(content_digest(weights))
  fields.update({f'depends_on.{key}': json.dumps(value, sort_keys=True)
                 for key, value in (depends_on or {}).items()})
  return fields
