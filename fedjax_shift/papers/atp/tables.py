"""ATP's table layouts (Bao, Wei, Wang & He, "Adaptive Test-Time Personalization for
Federated Learning", NeurIPS 2023): Table 1 (methods × shifts with the average rank)
and Table 3 (α trained on one shift, tested on another), with the paper's numbers
beside ours. Registered as the paper table 'atp' (records of the 'atp' pipeline).
"""
from __future__ import annotations

import os
from typing import Dict, Sequence

import numpy as np

from fedjax_shift.papers.atp import numbers
from fedjax_shift.pipelines.atp import stream_table
from fedjax_shift.report import (PAPER_TABLES, PaperTable, beside_paper, check_accuracy,
                                 markdown, mean_std, paper_markdown, read_result,
                                 unfilled_note)

SHIFT_ORDER = ('feature', 'label', 'hybrid')


def tta_tables(table1: Dict[str, Dict[str, Dict[int, float]]],
               table3: Dict[tuple, Dict[str, Dict[int, float]]], labels: Dict[str, str],
               shifts: Sequence[str], seeds: Sequence[int], paper: bool = False) -> str:
  """ATP Table 1 (rows = methods, columns = shifts, plus the average rank) and,
  with several shifts, Table 3 (rows = the shift α was trained on, columns = the
  shift tested; ATP-batch and ATP-online). Accuracies in %, mean ± std over seeds.
  ``paper``: the paper's CIFAR-10 numbers beside ours, and its claims checked."""
  cell = lambda per_seed: mean_std([per_seed.get(s) for s in seeds])
  means = {key: {shift: np.nanmean([v for v in cols.get(shift, {}).values()] or [np.nan])
                 for shift in shifts} for key, cols in table1.items()}
  from scipy.stats import rankdata
  keys = list(table1)
  ranks = {key: [] for key in keys}
  for shift in shifts:  # rank 1 = best; ties share the mean of their ranks
    for key, rank in zip(keys, rankdata([-means[k][shift] for k in keys], method='average')):
      ranks[key].append(float(rank))
  header = ['Method'] + [f'{s.capitalize()} shift' for s in shifts] + ['Avg. rank']
  rows = [[labels.get(key, key)] + [cell(table1[key].get(shift, {})) for shift in shifts] +
          [f'{np.mean(ranks[key]):.1f}'] for key in table1]
  source = ''
  unfilled = ''
  if paper:
    unfilled = unfilled_note(numbers.PAPER_NUMBERS['Table 1 (CIFAR-10)'], rows)
    header, rows = beside_paper(header, rows, numbers.PAPER_NUMBERS['Table 1 (CIFAR-10)'],
                                numbers.CLAIMS)
    source = (f"; the paper's numbers: "
              f"{numbers.PAPER_NUMBERS['Table 1 (CIFAR-10)']['source']}")
  text = (f'Table 1 (ATP layout): accuracy on target clients{source}\n\n' +
          markdown(header, rows) + unfilled)
  if table3:
    for key in ('atp_batch', 'atp_online'):
      header = ['Train \\ Test'] + [f'{s.capitalize()} shift' for s in shifts]
      rows = [['No adaptation'] + [cell(table1.get('no_adapt', {}).get(s, {})) for s in shifts]]
      for train in shifts:
        row = [f'{train.capitalize()} shift']
        for test in shifts:
          per_seed = (table1.get(key, {}).get(test, {}) if train == test
                      else table3.get((train, test), {}).get(key, {}))
          row.append(cell(per_seed))
        rows.append(row)
      text += (f'\n\nTable 3 (ATP layout): α trained on one shift, tested on another '
               f'({labels.get(key, key)})\n\n' + markdown(header, rows))
  return text




def load(workdirs: Sequence[str]):
  """(table1, table3, labels, shifts, seeds) merged over finished 'atp' pipeline
  workdirs' results.json (one shift per workdir, or several)."""
  table1, table3, labels, shifts, seeds = {}, {}, {}, [], []
  for workdir in workdirs:
    path = os.path.join(workdir, 'results.json')
    if not os.path.exists(path):
      raise FileNotFoundError(f'{path} not found: is {workdir!r} a finished atp-pipeline run?')
    results = read_result(path)
    config = read_result(os.path.join(workdir, 'config.json'))
    labels.update(config['tta']['label'])
    labels.update(results.get('labels', {}))   # with the learned-rates rows' labels
    for key, columns in results['table1'].items():
      for shift, per_seed in columns.items():
        if shift in table1.get(key, {}):
          raise ValueError(f'{workdir}: row {key!r} of the {shift} shift is also in an earlier '
                           f'workdir; pass each shift once')
        for s, value in per_seed.items():
          check_accuracy(path, f'table1.{key}.{shift}.{s}', value)
        table1.setdefault(key, {})[shift] = {int(s): v for s, v in per_seed.items()}
        shifts += [shift] if shift not in shifts else []
        seeds += [int(s) for s in per_seed if int(s) not in seeds]
    for pair, rows in results['table3'].items():
      train, test = pair.split('->')
      for k, r in rows.items():
        for s, value in r.items():
          check_accuracy(path, f'table3.{pair}.{k}.{s}', value)
      table3[(train, test)] = {k: {int(s): v for s, v in r.items()} for k, r in rows.items()}
  order = [s for s in SHIFT_ORDER if s in shifts]
  return table1, table3, labels, order, sorted(seeds)


def from_run(config, records) -> str:
  return tta_tables(records['table1'], records['table3'], records['labels'],
                    tuple(config.tta.shifts), tuple(config.seeds), paper=True)


def from_workdirs(workdirs: Sequence[str], labels: Sequence[str] = ()) -> str:
  """Tables 1 and 3 beside the paper's and, where the runs have time-limited rows
  (``config.tta.stream_rows``), their table beside Table 1."""
  del labels
  table1, table3, row_labels, shifts, seeds = load(workdirs)
  text = tta_tables(table1, table3, row_labels, shifts, seeds, paper=True)
  stream, rates = {}, set()
  for workdir in workdirs:
    results = read_result(os.path.join(workdir, 'results.json'))
    if results.get('stream'):
      rates.add(read_result(os.path.join(workdir, 'config.json'))['tta']['stream_rate'])
    for key, columns in results.get('stream', {}).items():
      for shift, per_seed in columns.items():
        stream.setdefault(key, {})[shift] = {int(s): v for s, v in per_seed.items()}
  if len(rates) > 1:
    raise ValueError(f'the workdirs ran the time-limited stream at several rates '
                     f'{sorted(rates)} (config.tta.stream_rate); pass runs of one rate')
  if stream:
    text += '\n\n' + stream_table(stream, row_labels, shifts, seeds, rates.pop())
  return text


# Table 7's columns: the pretraining method (config.algorithms) of each workdir.
PRETRAINING_LABELS = {'fedavg': 'FedAvg', 'fedprox': 'FedProx', 'qffl': 'q-FFL'}
TABLE7_ROWS = ('no_adapt', 'atp_batch', 'atp_online')


def table7_from_workdirs(workdirs: Sequence[str], labels: Sequence[str] = ()) -> str:
  """ATP Table 7: No adaptation, ATP-batch and ATP-online under hybrid shift (rows), one
  column per workdir named after its pretraining method (``--labels`` to rename); a
  workdir run with several shifts contributes its hybrid column."""
  header, columns = ['Method'], []
  for i, workdir in enumerate(workdirs):
    table1, _, row_labels, shifts, seeds = load([workdir])
    if 'hybrid' not in shifts:
      raise ValueError(f'{workdir}: ATP Table 7 is under hybrid shift; this run has '
                       f'{list(shifts)}')
    missing = [key for key in TABLE7_ROWS if key not in table1]
    if missing:
      raise ValueError(f'{workdir}: rows {missing} of ATP Table 7 were not run '
                       f'(config.tta.rows)')
    pretraining = read_result(os.path.join(workdir, 'config.json'))['algorithms'][0]
    header.append(labels[i] if labels else PRETRAINING_LABELS.get(pretraining, pretraining))
    columns.append({key: mean_std([table1[key]['hybrid'].get(s) for s in seeds])
                    for key in TABLE7_ROWS})
    column_labels = row_labels
  rows = [[column_labels.get(key, key)] + [column[key] for column in columns]
          for key in TABLE7_ROWS]
  return ('Table 7 (ATP layout): accuracy on target clients under hybrid shift, by the '
          'pretraining of the global model\n\n' +
          paper_markdown(header, rows, numbers.TABLE7, numbers.TABLE7_CLAIMS))


PAPER_TABLES.register('atp', pipelines=('atp',), benchmarks=('atp_shift',))(
    PaperTable(from_run, from_workdirs, needs=('table1', 'table3')))
PAPER_TABLES.register('atp_table7', pipelines=('atp',), benchmarks=('atp_shift',))(
    PaperTable(None, table7_from_workdirs, needs=('table1',)))
