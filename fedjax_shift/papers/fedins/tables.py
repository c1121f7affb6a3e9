"""FedIns' table layout (Feng, Yu, Liu, Xu, Khan & Zuo, "Towards Instance-adaptive
Inference for Federated Learning", ICCV 2023): Table 1 with the parameters each client
sends, with the paper's numbers beside ours. Registered as the paper table 'fedins'.
"""
from __future__ import annotations

import os
from typing import Dict, List, Sequence

import numpy as np

from fedjax_shift.benchmarks import data_view
from fedjax_shift.benchmarks.mixed_domains import domain_label
from fedjax_shift.papers.fedins import numbers
from fedjax_shift.report import (PAPER_TABLES, PaperTable, load_runs, markdown, mean_std,
                                 paper_markdown, run_config, seeds_cell)
from fedjax_shift.report.figures import colours, new_plot, save_plot


# FedIns Table 1 rows: (label, method, model). SOLO and FedBN are scored with
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
  """``fedins_rows`` as markdown."""
  return markdown(*fedins_rows(results, domains))


BEST_ROUND = 'Test, best round (authors\' selection)'
# FedIns' key-selection diagnostics (algorithms/fedins.py:selection_diagnostics).
SELECTION_COLUMNS = (('fedins/test/keys_used', 'keys used'),
                     ('fedins/test/chosen_cosine', 'chosen cos'),
                     ('fedins/test/purity', 'key purity'))


def best_round(run: Dict, key: str):
  """The highest ``key`` accuracy over the run's evaluated rounds (the authors' code
  reports the best test accuracy seen during training), or None."""
  values = [e[key] for e in run.get('evaluations', ()) if key in e]
  return max(values) if values else None


def fedins_rows(results: List[Dict], domains: Sequence[str] = ()):
  """FedIns Table 1 layout: rows = FEDINS_ROWS that were run; '# Com.cost' = the
  parameters a client uploads per round (from the update pytrees); accuracy (%) on the
  clients' test sets (all examples pooled) and per domain ('test_<domain>'), mean ± std
  over seeds, at the last round (our protocol); the best test accuracy over the
  evaluated rounds (the authors' code's selection, on the test set); and, for the pool
  methods, the key selection at the last round (keys chosen at least once, the chosen
  keys' mean cosine, the pooled purity over domains; '—' for the others)."""
  columns = [('test', 'Test (all domains)')] + [(f'test_{d}', d) for d in domains]
  rows = []
  for label, method, model in FEDINS_ROWS:
    runs = [r for r in results if r['algorithm'] == method]
    if not runs:
      continue
    uploads = {r.get('uploaded_parameters', 0) for r in runs}
    cost = '—' if uploads == {0} else ' / '.join(parameters_cell(u) for u in sorted(uploads))
    selection = []
    for key, _ in SELECTION_COLUMNS:
      values = [r['metrics'].get(key) for r in runs]
      selection.append('—' if all(v is None for v in values) else
                       mean_std(values, scale=1.0, digits=1 if 'keys' in key else 3))
    rows.append([label, cost] + [mean_std([r['metrics'].get(f'{model}/{split}/accuracy')
                                           for r in runs]) for split, _ in columns] +
                [mean_std([best_round(r, f'{model}/test/accuracy') for r in runs])] +
                selection + [seeds_cell(runs)])
  return (['Method', '# Com.cost'] + [label for _, label in columns] + [BEST_ROUND] +
          [label for _, label in SELECTION_COLUMNS] + ['seeds'], rows)


def fedins_tables(config, results: List[Dict]) -> str:
  """What launch/train.py prints for a configs/fedins.py run."""
  domains = (tuple(domain_label(d) for d in data_view(config.data).domains)
             if config.data.benchmark == 'mixed_domains' else ())
  return ('Our protocol in FedIns Table 1\'s layout: accuracy (%) on the clients\' test sets '
          '(pooled; then per domain), mean ± std over seeds, last round, then the best round '
          'as the authors\' code selects it; # Com.cost = parameters a client uploads per '
          'round; the pool methods\' key selection at the last round\n\n' + paper_markdown(
              *fedins_rows(results, domains), numbers.PAPER_NUMBERS.get(paper_key(config.data)),
              numbers.CLAIMS))


def paper_key(data_config) -> str:
  """The numbers.PAPER_NUMBERS key of the paper's Table 1 column for ``config.data``."""
  source = data_config.source
  if data_config.benchmark == 'mixed_domains':
    return 'Table 1 (DomainNet)'
  return {'tfds:cifar100': 'Table 1 (CIFAR-100)'}.get(source, 'Table 1 (Tiny-ImageNet)')


def settings_from_workdirs(workdirs: Sequence[str], labels: Sequence[str] = ()) -> str:
  """The same rows under several settings side by side (e.g. the paper's batch-32
  schedule, the authors' one step per image, the head pool): one column per workdir
  (``labels`` name the settings) of the pooled test accuracy (%) at the last round, mean ±
  std over seeds, '—' where a workdir did not run the row's method; the paper's Table 1
  number last."""
  runs = load_runs(workdirs, labels)
  numbers_rows = numbers.PAPER_NUMBERS['Table 1 (DomainNet)']['rows']
  header = ['Method'] + list(runs) + ['paper: Test (all domains)', 'seeds']
  rows = []
  for label, method, model in FEDINS_ROWS:
    cells, seeds = [], set()
    for results in runs.values():
      mine = [r for r in results if r['algorithm'] == method]
      if mine:
        cells.append(mean_std([r['metrics'].get(f'{model}/test/accuracy') for r in mine]))
        seeds.add(len(mine))
      else:
        cells.append('—')
    if any(cell != '—' for cell in cells):
      paper = numbers_rows.get(label, {}).get('Test (all domains)')
      rows.append([label] + cells + ['—' if paper is None else f'{paper:.2f}',
                                     ' / '.join(str(n) for n in sorted(seeds))])
  return ('FedIns settings side by side: pooled test accuracy (%) at the last round, mean ± '
          'std over seeds, one column per workdir\n\n' + markdown(header, rows))


# The backbone study: FedIns against the methods it is compared with, per test domain.
BACKBONE_BASELINES = (('fedavg', 'FedAvg'), ('fedins_ssf', 'SSF'))


def seed_differences(runs: List[Dict], method: str, baseline: str, key: str) -> List[float]:
  """[method − baseline] of ``key`` per seed both ran (paired by seed)."""
  by_seed = lambda name: {r['seed']: r['metrics'].get(key) for r in runs
                          if r['algorithm'] == name}
  ours, theirs = by_seed(method), by_seed(baseline)
  return [ours[s] - theirs[s] for s in sorted(ours) if s in theirs and
          ours[s] is not None and theirs[s] is not None]


def backbones_from_workdirs(workdirs: Sequence[str], labels: Sequence[str] = ()) -> str:
  """The backbone study: one row per workdir (a run of configs/fedins.py whose backbone
  was pretrained on other domains' reserve: labels name the coverage, e.g.
  'mnist,mnist+uci,all four'); per test domain, FedIns − FedAvg and FedIns − SSF in
  points, mean ± std over the paired seeds; the figure of both against the coverage,
  written beside the first workdir as backbones.png."""
  runs = load_runs(workdirs, labels)
  domains = [domain_label(d) for d in data_view(run_config(workdirs[0]).data).domains]
  splits = [('test', 'all')] + [(f'test_{d}', d) for d in domains]
  header = ['Backbone pretrained on', 'backbone domains'] + [
      f'{split_label}: FedIns − {name}' for _, split_label in splits
      for _, name in BACKBONE_BASELINES] + ['seeds']
  rows, means = [], {}
  for (label, results), workdir in zip(runs.items(), workdirs):
    covered = tuple(run_config(workdir).backbone.domains)
    row = [label, ', '.join(domain_label(d) for d in covered)]
    for split, split_label in splits:
      for baseline, name in BACKBONE_BASELINES:
        diffs = seed_differences(results, 'fedins', baseline, f'global/{split}/accuracy')
        row.append(mean_std(diffs) if diffs else 'n/a')
        means[(label, split_label, name)] = 100 * np.mean(diffs) if diffs else np.nan
    row.append(str(len({r['seed'] for r in results if r['algorithm'] == 'fedins'})))
    rows.append(row)
  path = os.path.join(os.path.dirname(os.path.normpath(workdirs[0])), 'backbones.png')
  plot_backbones(list(runs), [s for _, s in splits], means, path)
  return ('FedIns backbone study: FedIns − baseline accuracy (points) on each test domain, '
          'against the domains the backbone was pretrained on (their reserve, never a '
          f'client\'s image); the figure: {path}\n\n' + markdown(header, rows))


def plot_backbones(coverages: Sequence[str], splits: Sequence[str], means: Dict, path: str):
  """FedIns − FedAvg (solid) and − SSF (dashed) per test domain against the coverage."""
  fig, ax = new_plot()
  positions = np.arange(len(coverages))
  for split, colour in zip(splits, colours(len(splits))):
    for (_, name), style in zip(BACKBONE_BASELINES, ('-', '--')):
      ax.plot(positions, [means[(c, split, name)] for c in coverages], style, color=colour,
              marker='o', markersize=3, label=f'{split}: − {name}')
  ax.axhline(0.0, color='k', linewidth=0.5)
  ax.set_xticks(positions, coverages, fontsize=7)
  return save_plot(fig, ax, path, 'backbone pretrained on', 'FedIns − baseline (points)',
                   legend_columns=2)


PAPER_TABLES.register('fedins_backbones', pipelines=('federated',),
                       benchmarks=('mixed_domains',), methods=('fedins',),
                       fields={'data.backbone_reserve': 'configs/fedins.py:backbone_<domains>'})(
    PaperTable(None, backbones_from_workdirs, needs=('/test/accuracy',)))
PAPER_TABLES.register('fedins_settings', pipelines=('federated',),
                       benchmarks=('mixed_domains',))(
    PaperTable(None, settings_from_workdirs, needs=('/test/accuracy',)))
PAPER_TABLES.register('fedins', pipelines=('federated',))(
    PaperTable(lambda config, records: fedins_tables(config, records['results']), None,
               needs=('/test/accuracy',)))
