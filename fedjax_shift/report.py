"""Results tables (markdown + CSV) and accuracy-vs-round plots from run results."""
from __future__ import annotations

import csv
import os
from typing import Dict, List, Sequence

import numpy as np

from fedjax_shift.metrics import read_metrics


def mean_std(values: Sequence[float]) -> str:
  values = [v for v in values if v is not None and np.isfinite(v)]
  if not values:
    return 'n/a'
  if len(values) == 1:
    return f'{100 * values[0]:.2f}'
  return f'{100 * np.mean(values):.2f} ± {100 * np.std(values):.2f}'


def results_table(results: List[Dict]) -> Dict[str, object]:
  """Rows: method; columns: '<model>/<split>' accuracy (%) mean ± std over seeds.

  ``results`` are per (method, seed) dicts with keys 'algorithm', 'seed',
  'metrics' (flat '<model>/<split>/accuracy'), 'rounds', 'train_seconds'.
  Returns {'header': [...], 'rows': [[...]], 'markdown': str}.
  """
  methods = list(dict.fromkeys(r['algorithm'] for r in results))
  columns = []
  for r in results:
    for key in r['metrics']:
      if key.endswith('/accuracy') and key[:-len('/accuracy')] not in columns:
        columns.append(key[:-len('/accuracy')])
  columns.sort(key=lambda c: (not c.startswith('global'), c))
  header = ['method'] + columns + ['seeds', 'rounds', 'seconds/seed']
  rows = []
  for method in methods:
    runs = [r for r in results if r['algorithm'] == method]
    row = [method]
    for column in columns:
      row.append(mean_std([r['metrics'].get(column + '/accuracy') for r in runs]))
    row.append(str(len(runs)))
    row.append(str(runs[0]['rounds']))
    row.append(f"{np.mean([r['train_seconds'] for r in runs]):.1f}")
    rows.append(row)
  lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
  lines += ['| ' + ' | '.join(row) + ' |' for row in rows]
  return {'header': header, 'rows': rows, 'markdown': '\n'.join(lines)}


def write_table(table: Dict[str, object], workdir: str, preamble: str = '') -> None:
  with open(os.path.join(workdir, 'results.md'), 'w') as f:
    if preamble:
      f.write(preamble.rstrip() + '\n\n')
    f.write(table['markdown'] + '\n')
  with open(os.path.join(workdir, 'results.csv'), 'w', newline='') as f:
    writer = csv.writer(f)
    writer.writerow(table['header'])
    writer.writerows(table['rows'])


def plot_curves(run_dirs: Dict[str, List[str]], path: str, metric_suffix: str = 'accuracy'):
  """Accuracy vs round, one line per (method, model/split), mean over seeds."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4))
  for method, dirs in run_dirs.items():
    series: Dict[str, Dict[int, List[float]]] = {}
    for d in dirs:
      for record in read_metrics(os.path.join(d, 'metrics.jsonl')):
        for key, value in record.items():
          if key.endswith('/' + metric_suffix) and value is not None:
            series.setdefault(key, {}).setdefault(record['round'], []).append(value)
    for key, points in series.items():
      rounds = sorted(points)
      ax.plot(rounds, [100 * np.mean(points[r]) for r in rounds], marker='o', markersize=3,
              label=f'{method} {key[:-len(metric_suffix) - 1]}')
  ax.set_xlabel('round')
  ax.set_ylabel(f'{metric_suffix} (%)')
  ax.legend(fontsize=6)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
