"""The test-time adaptation benchmark's table (records of the ``tta_bench`` pipeline;
``launch/report.py --kind=tta_bench`` merges the seeds of several workdirs): one
table per test-time mode, a row per adapter, a column per test stream (i.i.d. at each
batch size, label-shifted, time-limited); each cell the accuracy (%) averaged over the corruptions
and on the worst one, mean ± std over seeds, and the milliseconds one test batch of
one target client took.
"""
from __future__ import annotations

import os
from typing import Dict, Mapping, Sequence

import numpy as np

from fedjax_shift.report import (PAPER_TABLES, PaperTable, check_accuracy, markdown, mean_std,
                                 read_result)

ORDER_LABELS = {'iid': 'i.i.d.', 'label_shift': 'label-shifted',
                'time_limited': 'time-limited i.i.d.'}
MODE_LABELS = {'episodic': 'Episodic (state reset before each batch)',
               'online': 'Online (state carried over the stream)'}


def column_key(order: str, batch_size: int) -> str:
  return f'{order}@{batch_size}'


def column_label(key: str) -> str:
  order, _, batch_size = key.partition('@')
  return f'{ORDER_LABELS[order]}, batch {batch_size}'


def records(per_seed: Mapping[int, Dict], labels: Mapping[str, str], rows: Sequence[str]
            ) -> Dict[str, object]:
  """The results.json records of a run from its seeds' test_time.json contents:
  {'cells': {row: {column: {'mean' | 'worst' | 'ms_per_batch' | 'compile_seconds':
  {seed: value}, 'per_corruption': {seed: [K]}}}}, 'clean': {seed: accuracy},
  'labels', 'columns', 'corruptions'}."""
  first = next(iter(per_seed.values()))
  columns = list(first['streams'])
  cells: Dict[str, Dict[str, Dict[str, Dict]]] = {}
  for seed, record in per_seed.items():
    for column, by_row in record['streams'].items():
      for row, result in by_row.items():
        cell = cells.setdefault(row, {}).setdefault(column, {})
        accuracy = np.asarray(result['per_corruption'], float)
        for field, value in (('mean', float(np.mean(accuracy))),
                             ('worst', float(np.min(accuracy))),
                             ('ms_per_batch', result['ms_per_batch']),
                             ('compile_seconds', result['compile_seconds']),
                             ('per_corruption', result['per_corruption']),
                             ('adapted_batches', result.get('adapted_batches')),
                             ('stream_cost', result.get('stream_cost'))):
          if value is not None:
            cell.setdefault(field, {})[int(seed)] = value
  return {'cells': {row: cells[row] for row in rows if row in cells},
          'clean': {int(s): r['clean_accuracy'] for s, r in per_seed.items()},
          'labels': dict(labels), 'columns': columns,
          'corruptions': first['info']['corruptions']}


def time_cell(values: Sequence[float]) -> str:
  ms = float(np.mean(values))
  return f'{ms:.3g} ms'


def tables(records: Mapping[str, object]) -> str:
  """One markdown table per mode: 'mean ± std (worst ± std) · ms per batch' cells."""
  cells, labels, columns = records['cells'], records['labels'], records['columns']
  seeds = sorted({s for by_column in cells.values() for cell in by_column.values()
                  for s in cell['mean']})
  text = [f'Accuracy (%) over {len(records["corruptions"])} corruptions: mean (worst '
          f'corruption), mean ± std over seeds {tuple(seeds)}, and the wall-clock time '
          f'of one test batch of one target client. The source model without '
          f'adaptation on the clean test images: '
          f'{mean_std([records["clean"].get(s) for s in seeds])} %.']
  if any(column.startswith('time_limited') for column in columns):
    text.append('Time-limited (Alfarra et al., ICML 2024): the stream reveals a batch per '
                'forward pass; a method of cost C (its time per batch over no '
                "adaptation's, mean over seeds) adapts on every ⌈C⌉-th batch and "
                'predicts the others with its current model.')
  for mode, title in MODE_LABELS.items():
    rows = [row for row in cells if row.partition('@')[2] == mode]
    if not rows:
      continue
    body = []
    for row in rows:
      line = [labels.get(row, row)]
      for column in columns:
        cell = cells[row].get(column)
        if cell is None:
          line.append('—')
          continue
        line.append(f"{mean_std([cell['mean'].get(s) for s in seeds])} "
                    f"({mean_std([cell['worst'].get(s) for s in seeds])}) · "
                    f"{time_cell(list(cell['ms_per_batch'].values()))}"
                    + (f" · C = {np.mean(list(cell['stream_cost'].values())):.3g}"
                       if 'stream_cost' in cell else ''))
      body.append(line)
    text.append(f'{title}\n\n' + markdown(['Method'] + [column_label(c) for c in columns],
                                          body))
  return '\n\n'.join(text)


def load(workdirs: Sequence[str]) -> Dict[str, object]:
  """The records of finished 'tta_bench' workdirs merged (their seeds together; the
  same rows, streams and corruptions)."""
  merged = None
  for workdir in workdirs:
    path = os.path.join(workdir, 'results.json')
    if not os.path.exists(path):
      raise FileNotFoundError(f'{path} not found: is {workdir!r} a finished tta_bench run?')
    result = read_result(path)
    result['clean'] = {int(s): v for s, v in result['clean'].items()}
    for row, by_column in result['cells'].items():
      for column, cell in by_column.items():
        by_column[column] = cell = {field: {int(s): v for s, v in per_seed.items()}
                                    for field, per_seed in cell.items()}
        for field in ('mean', 'worst'):
          for seed, value in cell[field].items():
            check_accuracy(path, f'cells.{row}.{column}.{field}.{seed}', value)
    if merged is None:
      merged = result
      continue
    for field in ('columns', 'corruptions'):
      if result[field] != merged[field]:
        raise ValueError(f'{workdir}: its {field} {result[field]} differ from the first '
                         f"workdir's {merged[field]}; merge runs of one configuration")
    overlap = set(result['clean']) & set(merged['clean'])
    if overlap:
      raise ValueError(f'{workdir}: seeds {sorted(overlap)} are also in an earlier workdir; '
                       f'pass each seed once')
    merged['clean'].update(result['clean'])
    merged['labels'].update(result['labels'])
    for row, by_column in result['cells'].items():
      for column, cell in by_column.items():
        target = merged['cells'].setdefault(row, {}).setdefault(column, {})
        for field, per_seed in cell.items():
          target.setdefault(field, {}).update(per_seed)
  return merged


def from_run(config, records) -> str:
  del config
  return tables(records)


def from_workdirs(workdirs: Sequence[str], labels: Sequence[str] = ()) -> str:
  del labels
  return tables(load(workdirs))


PAPER_TABLES.register('tta_bench', pipelines=('tta_bench',), benchmarks=('tta_corruptions',))(
    PaperTable(from_run, from_workdirs, needs=('cells',)))
