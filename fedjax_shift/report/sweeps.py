"""Tables of a hyperparameter sweep (``config.sweep``): the grid of every point's
validation and test accuracy, the selected point marked (and flagged when it lies on
the grid's edge), and what a workdir holds of points outside the grid.
"""
from __future__ import annotations

import glob
import os
from typing import Any, Dict, List, Mapping, Sequence

from fedjax_shift.report import markdown, mean_std, read_result, read_sweep


def with_selected_points(table: Dict[str, object], points: Mapping[str, str]
                         ) -> Dict[str, object]:
  """``results_table``'s table with a 'selected (sweep)' column after the method: the
  hyperparameter values each swept method is reported at ('—' for one not swept)."""
  header = [table['header'][0], 'selected (sweep)'] + list(table['header'][1:])
  rows = [[row[0], points.get(row[0], '—')] + list(row[1:]) for row in table['rows']]
  return {'header': header, 'rows': rows, 'markdown': markdown(header, rows)}


def sweep_state(workdir: str) -> str:
  """Why ``workdir`` has no sweep.json: it does not exist, its sweep has not finished
  (how many of its points' runs have), or it ran no sweep."""
  if not os.path.isdir(workdir):
    return f'{workdir} does not exist'
  runs = glob.glob(os.path.join(glob.escape(workdir), '*', '*=*', 'seed_*'))
  if runs:
    done = sum(os.path.exists(os.path.join(run, 'results.json')) for run in runs)
    return (f'{workdir} holds a sweep not finished yet: {done} of the {len(runs)} runs '
            f'begun have results.json; sweep.json is written when every point has trained '
            f'(re-run the same launch/train.py command to resume it)')
  return f'{workdir} holds no sweep.json (it ran no config.sweep)'


def workdir_notes(workdir: str) -> List[str]:
  """What a table over ``workdir`` leaves out: a run still training in it (its .lock),
  the seeds its config.json names that have no results.json yet."""
  notes = []
  if os.path.exists(os.path.join(workdir, '.lock')):
    notes.append(f'{workdir} is in use by a run (its .lock): the table holds the runs '
                 f'finished so far')
  path = os.path.join(workdir, 'config.json')
  if not os.path.exists(path) or read_sweep(workdir) is not None:
    return notes
  config = read_result(path)
  if config.get('pipeline', 'federated') != 'federated':
    return notes
  for method in config.get('algorithms', ()):
    missing = [seed for seed in config.get('seeds', ()) if not os.path.exists(
        os.path.join(workdir, method, f'seed_{seed}', 'results.json'))]
    if missing:
      notes.append(f'{workdir}: {method} has no results of seeds {missing} (config.seeds '
                   f'{list(config["seeds"])}): not trained yet, or still training')
  return notes


def grid_edges(points: Sequence[Mapping[str, Any]], chosen: Mapping[str, Any]) -> List[str]:
  """The swept fields (two or more values in ``points``) whose value at ``chosen`` is
  the grid's smallest or largest, e.g. 'client.learning_rate=0.1 is the largest of
  0.01, 0.03, 0.1': the best value may lie outside the grid."""
  edges = []
  for field, value in chosen.items():
    values = sorted({point[field] for point in points if field in point})
    if len(values) >= 2 and value in (values[0], values[-1]):
      edges.append(f'{field}={value:g} is the {"largest" if value == values[-1] else "smallest"}'
                   f' of {", ".join(f"{v:g}" for v in values)}')
  return edges


def edge_note(method: str, edges: Sequence[str]) -> str:
  return (f"{method}'s selected point is on the grid's edge ({'; '.join(edges)}): a better "
          f"value may lie outside the grid; extend config.sweep past it")


def sweep_grid_table(record: Dict, test_suffix: str = '/test/accuracy') -> str:
  """The whole grid of a sweep (``read_sweep``): one row per method × point with its
  validation accuracy (the selection's metric and rule) and, at the same rounds, every
  test accuracy of the model the method's metric names, a column per test split; the
  selected point marked, and a note under the table for a selected point on the grid's
  edge (``grid_edges``). Methods selected on different metrics get a column naming
  each one's."""
  def metric_of(method: Dict) -> str:
    return method.get('metric', record['metric'])   # sweep.json before per-method metrics

  def split_keys(method: Dict) -> Dict[str, str]:   # test split -> metric key
    model = metric_of(method).split('/')[0]
    keys = {k for point in method['grid'] for m in point['metrics'] for k in m
            if k.startswith(model + '/') and k.endswith(test_suffix)}
    return {k.split('/')[1]: k for k in keys}

  methods = record['methods']
  per_method = len({metric_of(m) for m in methods.values()}) > 1
  keys = {name: split_keys(method) for name, method in methods.items()}
  splits = sorted({split for k in keys.values() for split in k})
  if per_method:
    header = (['method', 'metric', 'point', f'validation ({record["select"]})'] + splits +
              ['seeds'])
  else:   # one model: its full keys name the columns
    full = {split: key for k in keys.values() for split, key in k.items()}
    header = (['method', 'point', f'{record["metric"]} ({record["select"]})'] +
              [full[split] for split in splits] + ['seeds'])
  rows, notes = [], []
  for name, method in methods.items():
    edges = grid_edges([point['point'] for point in method['grid']], method['values'])
    if edges:
      notes.append(f'\n\nNote: {edge_note(name, edges)}.')
    for point in method['grid']:
      mark = ((' (selected, grid edge)' if edges else ' (selected)')
              if point['name'] == method['selected'] else '')
      seeds = str(len(point['seeds'])) + (f' ({len(point["diverged"])} diverged)'
                                          if point['diverged'] else '')
      tests = [mean_std([m.get(keys[name][split]) for m in point['metrics']])
               if split in keys[name] else 'n/a' for split in splits]
      rows.append([name] + ([metric_of(method)] if per_method else []) +
                  [point['name'] + mark, mean_std(point['validation'])] + tests + [seeds])
  return markdown(header, rows) + ''.join(notes)
