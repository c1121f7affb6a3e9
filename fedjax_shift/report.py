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


def seeds_cell(runs: List[Dict]) -> str:
  """'3', or '3 (1 diverged)': accuracies are means over the runs that did not."""
  diverged = sum('diverged' in r for r in runs)
  return f'{len(runs)} ({diverged} diverged)' if diverged else str(len(runs))


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
  header = ['method'] + columns + ['seeds', 'rounds', 'seconds/seed', 'uploaded/client/round']
  rows = []
  for method in methods:
    runs = [r for r in results if r['algorithm'] == method]
    row = [method]
    for column in columns:
      row.append(mean_std([r['metrics'].get(column + '/accuracy') for r in runs]))
    row.append(seeds_cell(runs))
    row.append(str(runs[0]['rounds']))
    seconds = [r['train_seconds'] for r in runs if 'diverged' not in r]
    row.append(f"{np.mean(seconds):.1f}" if seconds else 'n/a')
    row.append(f"{max(r.get('uploaded_parameters', 0) for r in runs):,}")
    rows.append(row)
  lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
  lines += ['| ' + ' | '.join(row) + ' |' for row in rows]
  return {'header': header, 'rows': rows, 'markdown': '\n'.join(lines)}


def write_csv(table: Dict[str, object], path: str) -> str:
  """The results table (header + rows) as CSV; returns ``path``."""
  with open(path, 'w', newline='') as f:
    writer = csv.writer(f)
    writer.writerow(table['header'])
    writer.writerows(table['rows'])
  return path


def plot_curves(run_dirs: Dict[str, List[str]], path: str, metric_suffix: str = 'accuracy'
                ) -> str:
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
  return path


def _markdown(header: List[str], rows: List[List[str]]) -> str:
  lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
  return '\n'.join(lines + ['| ' + ' | '.join(row) + ' |' for row in rows])


def tta_tables(table1: Dict[str, Dict[str, Dict[int, float]]],
               table3: Dict[tuple, Dict[str, Dict[int, float]]], labels: Dict[str, str],
               shifts: Sequence[str], seeds: Sequence[int]) -> str:
  """ATP Table 1 (rows = methods, columns = shifts, plus the average rank) and,
  with several shifts, Table 3 (rows = the shift α was trained on, columns = the
  shift tested; ATP-batch and ATP-online). Accuracies in %, mean ± std over seeds."""
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
  text = 'Table 1 (ATP layout): accuracy on target clients\n\n' + _markdown(header, rows)
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
               f'({labels.get(key, key)})\n\n' + _markdown(header, rows))
  return text


def plot_alpha(alpha_by_shift: Dict[str, np.ndarray], names: Sequence[str], path: str,
               ylabel: str = 'adaptation rate α') -> str:
  """ATP Figure 4: learned α per module, one bar group per module, one colour per shift
  (any per-module rates: the learned-rates rows' plots)."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  shifts = list(alpha_by_shift)
  width = 0.8 / max(len(shifts), 1)
  positions = np.arange(len(names))
  fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(names) + 2), 4))
  for i, shift in enumerate(shifts):
    ax.bar(positions + i * width, alpha_by_shift[shift], width, label=f'{shift} shift')
  short = [n.replace('params/', '').replace('batch_stats/', 'stats/').replace('encoder/', '')
           for n in names]
  ax.set_xticks(positions + 0.4 - width / 2)
  ax.set_xticklabels(short, rotation=90, fontsize=6)
  ax.set_ylabel(ylabel)
  ax.axhline(0, color='black', linewidth=0.5)
  ax.legend(fontsize=7)
  ax.grid(axis='y', alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


# FedEvolve Table 1 rows: (label, method, model for Client, model for Server).
EVOLVING_ROWS = (
    ('FedAvg', 'fedavg', 'global', 'global'),
    ('GMA', 'gma', 'global', 'global'),
    ('MEMO(G)', 'fedavg_ft', 'global+memo', 'global+memo'),
    ('FedAvg-FT', 'fedavg_ft', 'personalized', 'global'),
    ('APFL', 'apfl', 'personalized', 'global'),
    ('FedRep', 'fedrep', 'personalized', None),
    ('Ditto', 'ditto', 'personalized', 'global'),
    ('FedRoD', 'fedrod', 'personalized', 'global'),
    ('MEMO(P)', 'fedavg_ft', 'personalized+memo', None),
    ('T3A', 'fedavg_ft', 'personalized+t3a', None),
    ('FedSR', 'fedsr', 'global', 'global'),
    ('FedEvolve', 'fedevolve', 'personalized', 'global'),
    ('FedEvp', 'fedevp', 'personalized', 'global'))


def evolving_table(runs_by_column: Dict[str, List[Dict]], split: str = 'test',
                   server: bool = True) -> str:
  """FedEvolve Table 1 layout: per column group (e.g. a Dirichlet level) a 'Client'
  column — the mean over clients of each client's accuracy on its target domain with
  the model named in EVOLVING_ROWS — and a 'Server' column — the global model's
  accuracy over every client's target data. ``runs_by_column``: label -> per
  (method, seed) result dicts as written to results.json. ``server=False`` keeps the
  Client columns alone (Table 6: one column per straggler ratio)."""
  header = ['Method']
  for label in runs_by_column:
    header += [f'{label} Client', f'{label} Server'] if server else [label]
  rows = []
  for row_label, method, client_model, server_model in EVOLVING_ROWS:
    row = [row_label]
    for runs in runs_by_column.values():
      mine = [r for r in runs if r['algorithm'] == method]
      models = ((client_model, 'client_accuracy'), (server_model, 'accuracy'))
      for model, metric in (models if server else models[:1]):
        values = [r['metrics'].get(f'{model}/{split}/{metric}') for r in mine] if model else []
        row.append(mean_std(values))
    if any(cell != 'n/a' for cell in row[1:]):
      rows.append(row)
  return _markdown(header, rows)


def parameters_table(results: List[Dict]) -> str:
  """FedEvolve Table 7 layout: parameters each client uploads per round, per
  method (read off the update pytrees by experiment.uploaded_parameters)."""
  labels = {method: label for label, method, _, _ in reversed(EVOLVING_ROWS)}
  methods = list(dict.fromkeys(r['algorithm'] for r in results))
  header = [''] + [labels.get(m, m) for m in methods]
  uploads = {r['algorithm']: r.get('uploaded_parameters', 0) for r in results}
  return _markdown(header, [['Parameters'] + [f'{uploads[m]:,}' for m in methods]])


def fedevolve_tables(config, results: List[Dict]) -> str:
  """What launch/train.py prints for a configs/fedevolve.py run: its column of the
  paper's Table 1 (RMNIST), Table 2 (REMNIST) or Table 3 (Circle, Portraits,
  Caltran) — labelled with the straggler ratio r when there is one — then Table 7.
  launch/report.py merges runs into the wider tables (--kind=straggler: Table 6)."""
  label = f'Dir={config.data.dirichlet_alpha}'
  if config.straggler_prob:
    label += f', r={config.straggler_prob}'
  table = 'Table 3'
  if config.data.benchmark == 'rotated_digits':
    table = 'Table 2' if 'emnist' in config.data.source else 'Table 1'
  return (f'FedEvolve {table} layout: accuracy (%) on the target domain, mean ± std over '
          f'seeds; Client = personalised model, mean over clients; Server = global '
          f'model over all target data\n\n' + evolving_table({label: results}) +
          '\n\nFedEvolve Table 7 layout: parameters uploaded per client per round\n\n' +
          parameters_table(results))


# FedTTA Table 1 rows (fedtta_upfl.txt): (label, method, validation model, test model).
# Validation: the training clients' held-out 15 %; test: the new clients. A personalised
# method (FedPer) is validated with each training client's own model and tested as
# PFL-Sampled / PFL-Ensemble; TENT is FedAvg on a BatchNorm model (configs/fedtta.py:tent)
# adapted by Tent; the adapted rows adapt on the validation data too
# (config.eval_adapter_splits).
UPFL_ROWS = (
    ('FedAvg', 'fedavg', 'global', 'global'),
    ('FedProx', 'fedprox', 'global', 'global'),
    ('SCAFFOLD', 'scaffold', 'global', 'global'),
    ('AFL', 'afl', 'global', 'global'),
    ('FedGMA', 'gma', 'global', 'global'),
    ('FedADG', 'fedadg', 'global', 'global'),
    ('FedSR', 'fedsr', 'global', 'global'),
    ('PFL-Sampled', 'fedper', 'personalized', 'pfl_sampled'),
    ('PFL-Ensemble', 'fedper', 'personalized', 'pfl_ensemble'),
    ('ODPFL-HN', 'odpfl_hn', 'global+odpfl_hn', 'global+odpfl_hn'),
    ('TENT', 'fedavg', 'global+tent', 'global+tent'),
    ('FedTTA', 'fedtta', 'global+fedtta', 'global+fedtta'),
    ('FedTTA-Prox', 'fedtta_prox', 'global+fedtta', 'global+fedtta'),
    ('FedTTA++', 'fedtta_prox', 'global+fedtta_pp', 'global+fedtta_pp'))


def at_best_validation(run: Dict, val_key: str, test_key: str):
  """(validation, test) accuracy of ``run`` at its evaluated round of highest
  ``val_key`` (the earliest such round), from results.json's 'evaluations'; the last
  round's when the run has none."""
  evaluations = [e for e in run.get('evaluations', ()) if val_key in e and test_key in e]
  if not evaluations:
    return run['metrics'].get(val_key), run['metrics'].get(test_key)
  best = max(evaluations, key=lambda e: (e[val_key], -e['round']))
  return best[val_key], best[test_key]


def upfl_cells(runs_by_workdir: Dict[str, List[Dict]], method: str, val_key: str,
               test_key: str, best_validation: bool = False):
  """(Validation, Test) cells of one FedTTA table row from the first workdir whose runs
  of ``method`` have ``test_key`` (or diverged), or None when none does."""
  for runs in runs_by_workdir.values():
    mine = [r for r in runs if r['algorithm'] == method and test_key in r['metrics']]
    diverged = [r for r in runs if r['algorithm'] == method and 'diverged' in r]
    if mine or diverged:
      pairs = [at_best_validation(r, val_key, test_key) if best_validation else
               (r['metrics'].get(val_key), r['metrics'][test_key]) for r in mine]
      note = f' ({len(diverged)} of {len(mine) + len(diverged)} diverged)' if diverged else ''
      return mean_std([v for v, _ in pairs]), mean_std([t for _, t in pairs]) + note
  return None


def upfl_table(runs_by_workdir: Dict[str, List[Dict]], column: str = '',
               best_validation: bool = False) -> str:
  """FedTTA Table 1 layout for one dataset: Validation and Test accuracy (%), mean ± std
  over seeds, at the last round or (``best_validation``, the paper's protocol) at each
  run's evaluated round of best validation accuracy of that row's model.
  ``runs_by_workdir``: workdir -> per (method, seed) results dicts; a row is read from
  the first workdir whose runs of its method have its test column (so FedAvg comes
  from the main run, TENT from the BatchNorm run). Rows no run has are left out."""
  header = ['Method', f'{column} Validation'.strip(), f'{column} Test'.strip()]
  rows = []
  for label, method, val_model, test_model in UPFL_ROWS:
    cells = upfl_cells(runs_by_workdir, method, f'{val_model}/val/accuracy',
                       f'{test_model}/test/accuracy', best_validation)
    if cells:
      rows.append([label, *cells])
  return _markdown(header, rows)


def upfl_shift_table(groups: Dict[str, Dict[str, List[Dict]]],
                     best_validation: bool = False) -> str:
  """FedTTA Table 2 layout (degrees of shift): per row the Validation accuracy (of the
  first group that has the row) and one Test column per group — e.g. the new clients'
  Dirichlet α of configs/fedtta.py:shift<α> runs. ``groups``: column label -> the
  {workdir: runs} merged for it (as ``upfl_table``'s argument)."""
  header = ['Method', 'Validation'] + [f'Test ({label})' for label in groups]
  rows = []
  for label, method, val_model, test_model in UPFL_ROWS:
    cells = [upfl_cells(runs, method, f'{val_model}/val/accuracy',
                        f'{test_model}/test/accuracy', best_validation)
             for runs in groups.values()]
    if any(cells):
      validation = next(c[0] for c in cells if c)
      rows.append([label, validation] + [c[1] if c else 'n/a' for c in cells])
  return _markdown(header, rows)


def fedtta_tables(config, results: List[Dict]) -> str:
  """What launch/train.py prints for a configs/fedtta.py run: the rows of FedTTA's
  Table 1 it has (launch/report.py --kind=fedtta merges the TENT run into it)."""
  return ('FedTTA Table 1 layout: accuracy (%) mean ± std over seeds; Validation = the '
          'training clients\' held-out data, Test = the new clients; last round\n\n' +
          upfl_table({'run': results}, config.data.source) +
          '\n\nThe same at each run\'s evaluated round of best validation accuracy (the '
          'paper\'s protocol; every config.eval_every rounds)\n\n' +
          upfl_table({'run': results}, config.data.source, best_validation=True))


# FedICON Tables 1–4 rows (fedicon.txt Sec. 5.1): (label, method, model key). Tent, EATA
# and T3A adapt FedAvg's global model ("we implement these TTA methods with the FedAvg
# framework"); FedTHE / FedTHE+ ensemble FedTHE's two heads; FedICON adapts each
# client's personalised model by Eq. 7.
FEDICON_ROWS = (
    ('Local', 'local', 'personalized'),
    ('FedAvg', 'fedavg', 'global'),
    ('FedAvg-FT', 'fedavg_ft', 'personalized'),
    ('FedProx', 'fedprox', 'global'),
    ('FedRep', 'fedrep', 'personalized'),
    ('FedBN', 'fedbn', 'personalized'),
    ('FedTHE', 'fedthe', 'personalized+fedthe'),
    ('FedTHE+', 'fedthe', 'personalized+fedthe_plus'),
    ('Tent', 'fedavg', 'global+tent'),
    ('EATA', 'fedavg', 'global+eata'),
    ('T3A', 'fedavg', 'global+t3a'),
    ('FedICON', 'fedicon', 'personalized+fedicon'),
    ('FedICON-us', 'fedicon_us', 'personalized+fedicon'),
)
# The FedTHE-style test sets (benchmarks/label_skew.py), in the papers' column order.
FEDICON_COLUMNS = (('test', 'In-distribution'), ('test_corrupted', 'Corrupted'),
                   ('test_ooc', 'Out-of-client'), ('test_natural', 'Natural shift'),
                   ('test_mixture', 'Mixture'))


def fedicon_columns(data_config) -> tuple:
  """(split, label) columns of FedICON's table for ``config.data``: FedTHE's five test
  sets (label_skew_corrupted); Table 1's corrupted test per domain and their average
  (digit_domains, covariate shift); Table 2's held-out domain (leave-one-domain-out)."""
  if data_config.benchmark != 'digit_domains':
    return FEDICON_COLUMNS
  if data_config.held_out_domain:
    return (('test', f'Held-out domain: {data_config.held_out_domain}'),
            ('test_own', 'Own domain'))
  return tuple((f'test_corrupted_{d}', d) for d in data_config.domains) + (
      ('test_corrupted', 'Average (corrupted)'), ('test', 'Clean'))


def fedicon_table(results: List[Dict], online: bool = False,
                  columns: Sequence[tuple] = FEDICON_COLUMNS) -> str:
  """FedICON's layout: rows = FEDICON_ROWS that were run, columns = those of the
  (split, label) ``columns`` the runs have; accuracy (%) over each test set's examples,
  mean ± std over seeds. ``online``: FedICON's adapter ran in its online variant (the
  rows say so)."""
  columns = [(split, label) for split, label in columns
             if any(f'{model}/{split}/accuracy' in r['metrics']
                    for r in results for _, _, model in FEDICON_ROWS)]
  rows = []
  for label, method, model in FEDICON_ROWS:
    runs = [r for r in results if r['algorithm'] == method]
    if not runs or not any(k.startswith(model + '/') for r in runs for k in r['metrics']):
      continue
    if online and model.endswith('+fedicon'):
      label += ' (online)'
    rows.append([label] + [mean_std([r['metrics'].get(f'{model}/{split}/accuracy')
                                     for r in runs]) for split, _ in columns] +
                [seeds_cell(runs)])
  return _markdown(['Method'] + [label for _, label in columns] + ['seeds'], rows)


# FedICON Table 5: (method, local invariance extraction, global invariance sharing); each
# with and without test-time adaptation ('personalized+fedicon' / 'personalized').
FEDICON_ABLATION = (('fedicon_ce_no_sharing', False, False), ('fedicon_ce', False, True),
                    ('fedicon_no_sharing', True, False), ('fedicon', True, True))


def fedicon_ablation_table(results: List[Dict], split: str = 'test_corrupted') -> str:
  """FedICON Table 5 layout: one row per component combination that was run, accuracy
  (%) on ``split`` (the covariate-shift test sets), mean ± std over seeds."""
  mark = lambda on: '✓' if on else ''
  rows = []
  for method, extraction, sharing in FEDICON_ABLATION:
    runs = [r for r in results if r['algorithm'] == method]
    if not runs:
      continue
    for tta, model in ((False, 'personalized'), (True, 'personalized+fedicon')):
      values = [r['metrics'].get(f'{model}/{split}/accuracy') for r in runs]
      if any(v is not None for v in values):
        rows.append([mark(extraction), mark(sharing), mark(tta), mean_std(values)])
  return _markdown(['Local invariance extraction', 'Global invariance sharing',
                    'Test-time adaptation', f'Accuracy ({split})'], rows)


def fedicon_tables(config, results: List[Dict]) -> str:
  """What launch/train.py prints for a configs/fedicon.py run (and Table 5's layout when
  it ran the ablations)."""
  text = ('FedICON layout (the rows of its Tables 1–4): accuracy (%) on each client\'s test '
          'sets (all examples pooled), mean ± std over seeds; last round\n\n' +
          fedicon_table(results, online='fedicon:online' in tuple(config.eval_adapters),
                        columns=fedicon_columns(config.data)))
  ablations = {method for method, _, _ in FEDICON_ABLATION} - {'fedicon'}
  if any(r['algorithm'] in ablations for r in results):
    text += ('\n\nFedICON Table 5 layout: the components (test-time adaptation = the '
             'fedicon adapter on the personalised model)\n\n' + fedicon_ablation_table(results))
  return text


def fedicon_lodo_table(runs_by_domain: Dict[str, List[Dict]]) -> str:
  """FedICON Table 2 layout: one column per held-out domain (each a leave-one-domain-out
  run of configs/fedicon.py:lodo_<domain>), its 'test' split (the held-out domain dealt
  to the clients); rows = FEDICON_ROWS; mean ± std over seeds."""
  domains = list(runs_by_domain)
  rows = []
  for label, method, model in FEDICON_ROWS:
    cells, found = [], False
    for domain in domains:
      values = [r['metrics'].get(f'{model}/test/accuracy') for r in runs_by_domain[domain]
                if r['algorithm'] == method]
      found |= any(v is not None for v in values)
      cells.append(mean_std(values))
    if found:
      rows.append([label] + cells)
  return _markdown(['Method'] + [f'Held out: {d}' for d in domains], rows)


# FedIns Table 1 rows (fedins.txt): (label, method, model). SOLO and FedBN are scored with
# each client's own model; FedBN on a ViT keeps its LayerNorms local (fedbn.local_norms).
FEDINS_ROWS = (
    ('SOLO', 'local', 'personalized'),
    ('FedAvg (w.Full)', 'fedavg', 'global'),
    ('FedProx', 'fedprox', 'global'),
    ('SCAFFOLD', 'scaffold', 'global'),
    ('FedBN', 'fedbn', 'personalized'),
    ('MOON', 'moon', 'global'),
    ('FedDC', 'feddc', 'global'),
    ('Federated SSF (Table 2: SSF)', 'fedins_ssf', 'global'),
    ('FedIns (SSF pool, batch query)', 'fedins_batch_query', 'global'),
    ('FedIns', 'fedins', 'global'),
)


def parameters_cell(count: int) -> str:
  """Parameters in the paper's unit: '85.80 M', '5.35 M'; small counts in full."""
  return f'{count / 1e6:.2f} M' if count >= 1e5 else f'{count:,}'


def fedins_table(results: List[Dict], domains: Sequence[str] = ()) -> str:
  """FedIns Table 1 layout: rows = FEDINS_ROWS that were run; '# Com.cost' = the
  parameters a client uploads per round (from the update pytrees); accuracy (%) on the
  clients' test sets (all examples pooled) and per domain ('test_<domain>'), mean ± std
  over seeds; last round."""
  columns = [('test', 'Test (all domains)')] + [(f'test_{d}', d) for d in domains]
  rows = []
  for label, method, model in FEDINS_ROWS:
    runs = [r for r in results if r['algorithm'] == method]
    if not runs:
      continue
    uploads = {r.get('uploaded_parameters', 0) for r in runs}
    cost = '—' if uploads == {0} else ' / '.join(parameters_cell(u) for u in sorted(uploads))
    rows.append([label, cost] + [mean_std([r['metrics'].get(f'{model}/{split}/accuracy')
                                           for r in runs]) for split, _ in columns] +
                [seeds_cell(runs)])
  return _markdown(['Method', '# Com.cost'] + [label for _, label in columns] + ['seeds'], rows)


def fedins_tables(config, results: List[Dict]) -> str:
  """What launch/train.py prints for a configs/fedins.py run."""
  from fedjax_shift.benchmarks.mixed_domains import domain_label
  domains = (tuple(domain_label(d) for d in config.data.domains)
             if config.data.benchmark == 'mixed_domains' else ())
  return ('FedIns Table 1 layout: accuracy (%) on the clients\' test sets (pooled; then per '
          'domain), mean ± std over seeds, last round; # Com.cost = parameters a client '
          'uploads per round\n\n' + fedins_table(results, domains))
