"""FedEvolve's table layouts ("Federated Learning under Evolving Distribution Shifts",
anonymous, under double-blind review, 2024): Tables 1–4 (a Client and a Server column
per Dirichlet level), Table 6 (straggler ratios) and Table 7 (parameters sent), with
the paper's numbers beside ours. Registered as the paper tables 'fedevolve' and
'fedevolve_straggler'.
"""
from __future__ import annotations

import os
from typing import Dict, List, Sequence, Tuple

import numpy as np

from fedjax_shift.benchmarks import data_view
from fedjax_shift.papers.fedevolve import numbers
from fedjax_shift.report import (PAPER_TABLES, PaperTable, cell_value, column_labels, load_runs,
                                 markdown, mean_std, paper_markdown, run_config, seeds_cell)
from fedjax_shift.report.figures import colours, new_plot, save_plot

# The paper's table that a benchmark's run is a column of (numbers.PAPER_NUMBERS keys).
TIMED_SOURCES = {'portraits': 'Portraits', 'caltran': 'Caltran'}


def paper_key(config) -> str:
  """The numbers.PAPER_NUMBERS key of the paper's table this run is a column of."""
  data = config.data
  if data.benchmark == 'rotated_digits':
    return 'Table 2 (REMNIST)' if 'emnist' in data.source else 'Table 1 (RMNIST)'
  if data.benchmark == 'circle':
    return 'Table 3 (Circle)'
  return f'Table 3 ({TIMED_SOURCES.get(data.source, data.source)})'


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
    ('FedTHE', 'fedthe', 'personalized+fedthe', 'global'),
    ('FedSR', 'fedsr', 'global', 'global'),
    ('FedEvolve', 'fedevolve', 'personalized', 'global'),
    ('FedEvp', 'fedevp', 'personalized', 'global'))


def evolving_rows(runs_by_column: Dict[str, List[Dict]], split: str = 'test',
                  server: bool = True):
  """(header, rows) of ``evolving_table``."""
  return _evolving(runs_by_column, split, server)


def evolving_table(runs_by_column: Dict[str, List[Dict]], split: str = 'test',
                   server: bool = True) -> str:
  """FedEvolve Table 1 layout: per column group (e.g. a Dirichlet level) a 'Client'
  column — the mean over clients of each client's accuracy on its target domain with
  the model named in EVOLVING_ROWS — and a 'Server' column — the global model's
  accuracy over every client's target data. ``runs_by_column``: label -> per
  (method, seed) result dicts as written to results.json. ``server=False`` keeps the
  Client columns alone (Table 6: one column per straggler ratio)."""
  return markdown(*_evolving(runs_by_column, split, server))


def _evolving(runs_by_column, split, server):
  header = ['Method']
  for label in runs_by_column:
    header += [f'{label} Client', f'{label} Server'] if server else [label]
  header.append('seeds')
  rows = []
  for row_label, method, client_model, server_model in EVOLVING_ROWS:
    row, seeds = [row_label], []
    for runs in runs_by_column.values():
      mine = [r for r in runs if r['algorithm'] == method]
      models = ((client_model, 'client_accuracy'), (server_model, 'accuracy'))
      for model, metric in (models if server else models[:1]):
        values = [r['metrics'].get(f'{model}/{split}/{metric}') for r in mine] if model else []
        row.append(mean_std(values))
      seeds.append(seeds_cell(mine) if mine else '0')
    if any(cell != 'n/a' for cell in row[1:]):
      # runs averaged per column group ('3', or '3 / 1' when the groups differ)
      rows.append(row + [seeds[0] if len(set(seeds)) == 1 else ' / '.join(seeds)])
  return header, rows


# Table 7's rows: what a client uploads per round, by entry of its update
# (pipelines/runs.uploaded_by_part): the model's trained parameters (the paper's
# "Parameters"), FedEvolve's prototype sums and counts of S_M, and anything else
# (BatchNorm running statistics, control variates, ...).
UPLOAD_ROWS = (('Model parameters', ('params',)),
               ('Prototype sums and counts', ('proto_sums', 'proto_counts')))


def parameters_table(results: List[Dict]) -> str:
  """FedEvolve Table 7 layout, one column per method: the numbers each client uploads
  per round by kind (UPLOAD_ROWS, then 'Other uploads'; read off the update pytrees)
  and the seconds per training round on this machine (mean over seeds; the paper's
  row is MPI transmission time, which a single-process run has no counterpart for)."""
  labels = {}   # a method's own row (FedAvg-FT, not MEMO(G)), else its only row (FedTHE)
  for label, method, client_model, _ in sorted(EVOLVING_ROWS, key=lambda r: '+' in r[2]):
    labels.setdefault(method, label)
  methods = list(dict.fromkeys(r['algorithm'] for r in results))
  first = {m: next(r for r in results if r['algorithm'] == m) for m in methods}

  def parts(method):
    return first[method].get('uploaded_by_part') or {
        'params': first[method].get('uploaded_parameters', 0)}

  rows = []
  named = set()
  for label, keys in UPLOAD_ROWS:
    named.update(keys)
    rows.append([label] + [f'{sum(parts(m).get(k, 0) for k in keys):,}' for m in methods])
  rows.append(['Other uploads'] + [
      f'{sum(v for k, v in parts(m).items() if k not in named):,}' for m in methods])

  def seconds(method):
    runs = [r for r in results if r['algorithm'] == method and r.get('rounds')]
    values = [r['train_seconds'] / r['rounds'] for r in runs
              if np.isfinite(r.get('train_seconds', float('nan')))]
    return f'{np.mean(values):.3f}' if values else 'n/a'

  rows.append(['Seconds per round'] + [seconds(m) for m in methods])
  return markdown([''] + [labels.get(m, m) for m in methods], rows)


def fedevolve_tables(config, results: List[Dict]) -> str:
  """What launch/train.py prints for a configs/fedevolve.py run: its column of the
  paper's Table 1 (RMNIST), Table 2 (REMNIST) or Table 3 (Circle, Portraits,
  Caltran) — labelled with the straggler ratio r when there is one — then Table 7.
  launch/report.py merges runs into the wider tables (--kind=fedevolve_straggler: Table 6)."""
  label = f'Dir={config.data.dirichlet_alpha}'
  if config.straggler_prob:
    label += f', r={config.straggler_prob}'
  table = 'Table 3'
  if config.data.benchmark == 'rotated_digits':
    table = 'Table 2' if 'emnist' in config.data.source else 'Table 1'
  return (f'FedEvolve {table} layout: accuracy (%) on the target domain, mean ± std over '
          f'seeds; Client = personalised model, mean over clients; Server = global '
          f'model over all target data\n\n' +
          paper_markdown(*evolving_rows({label: results}),
                         numbers.PAPER_NUMBERS.get(paper_key(config)), numbers.CLAIMS) +
          '\n\nFedEvolve Table 7 layout: numbers uploaded per client per round, and '
          'seconds per training round on this machine\n\n' +
          parameters_table(results))




def from_workdirs(workdirs: Sequence[str], labels: Sequence[str] = ()) -> str:
  """Table 1 / 2 / 3 / 4 of finished configs/fedevolve.py runs: one Client/Server
  column pair per workdir (labels: e.g. 'Dir=inf,Dir=1.0,Dir=0.1', which match the
  paper's columns)."""
  key = paper_key(run_config(workdirs[0]))
  return (f'FedEvolve {key.split(" (")[0]} layout\n\n' +
          paper_markdown(*evolving_rows(load_runs(workdirs, labels)),
                         numbers.PAPER_NUMBERS.get(key), numbers.CLAIMS))


def papers_rows_only(header: List[str], rows: List[List[str]], paper: Dict
                     ) -> Tuple[List[str], List[List[str]]]:
  """The rows the paper's table has; a workdir shared with Table 1 (r=0, 12 domains)
  holds every baseline too."""
  return header, [row for row in rows if row[0] in paper['rows']]


def straggler_from_workdirs(workdirs: Sequence[str], labels: Sequence[str] = ()) -> str:
  """Table 6: one Client column per workdir (labels: the straggler ratios, e.g.
  '0,0.1,0.9', which match the paper's columns); the rows are the paper's (FedEvolve,
  FedEvp)."""
  paper = numbers.PAPER_NUMBERS['Table 6']
  rows = papers_rows_only(*evolving_rows(load_runs(workdirs, labels), server=False), paper)
  return paper_markdown(*rows, paper, numbers.CLAIMS)


def domains_column(config) -> str:
  """Table 5's column of a rotated_digits run: its Dirichlet level and number of
  domains, e.g. 'Dir=inf 7' (the paper's blocks Dir -> inf / 1.0 / 0.1, columns 7 / 10
  / 12)."""
  alpha = float(config.data.dirichlet_alpha)
  return f"Dir={'inf' if np.isinf(alpha) else alpha} {int(data_view(config.data).num_domains)}"


def domains_from_workdirs(workdirs: Sequence[str], labels: Sequence[str] = ()) -> str:
  """Tables 5 and 9: one Client column per workdir, a ``rmnist_dir<α>`` run with
  ``rmnist_domains<D>`` (or the 12-domain Table 1 run), labelled by its Dirichlet level
  and number of domains read off its config unless ``labels`` name them ('Dir=inf 7',
  …, as the paper's columns); the rows are the paper's (FedAvg, FedEvolve, FedEvp)."""
  labels = list(labels) or [domains_column(run_config(w)) for w in workdirs]
  if len(set(labels)) != len(labels):
    raise ValueError(f'two workdirs give the same Table 5 column: {labels} (one run per '
                     'Dirichlet level and number of domains)')
  paper = numbers.PAPER_NUMBERS['Table 5']
  rows = papers_rows_only(*evolving_rows(load_runs(workdirs, labels), server=False), paper)
  return ('FedEvolve Table 5 layout: accuracy (%) on the 165° target domain by number of '
          'domains\n\n' + paper_markdown(*rows, paper, numbers.DOMAINS_CLAIMS))


def runs_of(workdir: str) -> List[Dict]:
  """The per (method, seed) results of one finished workdir."""
  return next(iter(load_runs([workdir]).values()))


def personalization_from_workdirs(workdirs: Sequence[str], labels: Sequence[str] = ()) -> str:
  """Table 8: FedEvp's personalisation ablation, one row per workdir (a FedEvp run; the
  row is named by its ``fedevp.personalize``, so ``labels`` name the dataset column,
  'MNIST Acc' by default): the clients' mean accuracy on their target data."""
  column = (list(labels) or ['MNIST Acc'])[0]
  names = dict(numbers.PERSONALIZATION_ROWS)
  rows = []
  for workdir in workdirs:
    mode = run_config(workdir).fedevp.personalize
    runs = [r for r in runs_of(workdir) if r['algorithm'] == 'fedevp']
    if not runs:
      raise ValueError(f'{workdir!r} holds no fedevp run')
    rows.append([names[mode], mean_std([r['metrics'].get('personalized/test/client_accuracy')
                                        for r in runs]), seeds_cell(runs)])
  return paper_markdown(['Method', column, 'seeds'], rows, numbers.PAPER_NUMBERS['Table 8'],
                        numbers.PERSONALIZATION_CLAIMS)


def target_angle(config) -> float:
  """The target domain's rotation (degrees) of a rotated_digits config."""
  data = data_view(config.data)
  return data.rotation_start + (data.num_domains - 1) * data.rotation_step + data.target_offset


UNEXPECTED_METHODS = ('FedAvg', 'FedEvolve', 'FedEvp')   # rows of EVOLVING_ROWS


def unexpected_from_workdirs(workdirs: Sequence[str], labels: Sequence[str] = ()) -> str:
  """App. Table 13: one workdir per (Dirichlet level, target offset), i.e. configs
  ``rmnist_dir<α>,unexpected<offset>``; ``labels`` name each workdir's column group
  ('Dir=inf', 'Dir=1.0', 'Dir=0.1', repeated for its offsets); the rows are
  'Method (target angle)' read off each config, with Client and Server accuracy as in
  Table 1 (EVOLVING_ROWS: FedAvg's Client column is its global model per client)."""
  groups, cells = [], {}
  for workdir, label in zip(workdirs, column_labels(workdirs, labels)):
    results = runs_of(workdir)
    angle = target_angle(run_config(workdir))
    groups += [] if label in groups else [label]
    for name, method, client_model, server_model in EVOLVING_ROWS:
      mine = [r for r in results if r['algorithm'] == method]
      if name in UNEXPECTED_METHODS and mine:
        row = cells.setdefault(f'{name} ({angle:g}°)', {})
        row[f'{label} Client'] = mean_std([r['metrics'].get(
            f'{client_model}/test/client_accuracy') for r in mine])
        row[f'{label} Server'] = mean_std([r['metrics'].get(f'{server_model}/test/accuracy')
                                           for r in mine])
        row['seeds'] = sorted(set(row.get('seeds', [])) | {seeds_cell(mine)})
  header = ['Method'] + [f'{g} {kind}' for g in groups for kind in ('Client', 'Server')]
  order = sorted(cells, key=lambda row: (UNEXPECTED_METHODS.index(row.split(' (')[0]),
                                         float(row.split('(')[1].rstrip('°)'))))
  rows = [[row] + [cells[row].get(column, 'n/a') for column in header[1:]] +
          [' / '.join(cells[row]['seeds'])] for row in order]
  return ('FedEvolve App. Table 13 layout: the target rotated off the schedule\n\n' +
          paper_markdown(header + ['seeds'], rows, numbers.PAPER_NUMBERS['Table 13'],
                         numbers.UNEXPECTED_CLAIMS))


def increments_from_workdirs(workdirs: Sequence[str], labels: Sequence[str] = ()) -> str:
  """Figure 3: one Client/Server column pair per rotation increment (one workdir per
  ``increment<deg>`` run; labels: the increments in degrees, e.g. '0,5,10,15,20,25'),
  and the figure itself, accuracy vs increment per method, written beside the first
  workdir as figure3.png."""
  runs = load_runs(workdirs, labels)
  try:
    increments = [float(label) for label in runs]
  except ValueError as err:
    raise ValueError(f'--labels: the rotation increment of each workdir in degrees, e.g. '
                     f"'0,5,10' ({err})") from None
  header, rows = evolving_rows(runs)
  path = os.path.join(os.path.dirname(os.path.normpath(workdirs[0])), 'figure3.png')
  plot_increments(increments, header, rows, path)
  return (f'FedEvolve Figure 3 layout: accuracy (%) on the target domain vs the rotation '
          f'increment (degrees); the figure: {path}\n\n' + markdown(header, rows))


def plot_increments(increments: Sequence[float], header: Sequence[str],
                    rows: Sequence[Sequence[str]], path: str) -> str:
  """Figure 3's plot: for each method of ``rows``, its Client (solid) and Server
  (dashed) accuracy against the increments (the columns of ``evolving_rows``)."""
  order = np.argsort(increments)
  columns = [h[:-len(' Client')] for h in header if h.endswith(' Client')]
  fig, ax = new_plot((7, 4))
  for row, colour in zip(rows, colours(len(rows))):
    for kind, style in (('Client', '-'), ('Server', '--')):
      values = [cell_value(row[header.index(f'{column} {kind}')]) for column in columns]
      if any(v is not None for v in values):
        ax.plot(np.asarray(increments)[order],
                [np.nan if values[i] is None else values[i] for i in order], style,
                color=colour, marker='o', markersize=3, label=f'{row[0]} ({kind})')
  return save_plot(fig, ax, path, 'rotation increment (degrees)',
                   'accuracy on the target domain (%)', legend_columns=2)


PAPER_TABLES.register('fedevolve', pipelines=('federated',),
                       benchmarks=('rotated_digits', 'circle', 'timed_images'))(
    PaperTable(lambda config, records: fedevolve_tables(config, records['results']),
               from_workdirs, needs=('/client_accuracy',)))
PAPER_TABLES.register('fedevolve_straggler', pipelines=('federated',),
                       benchmarks=('rotated_digits',), methods=('fedevolve', 'fedevp'))(
    PaperTable(None, straggler_from_workdirs, needs=('/client_accuracy',)))
PAPER_TABLES.register('fedevolve_personalization', pipelines=('federated',),
                       benchmarks=('rotated_digits',), methods=('fedevp',))(
    PaperTable(None, personalization_from_workdirs, needs=('/client_accuracy',)))
PAPER_TABLES.register('fedevolve_unexpected', pipelines=('federated',),
                       benchmarks=('rotated_digits',), methods=('fedavg', 'fedevolve', 'fedevp'))(
    PaperTable(None, unexpected_from_workdirs, needs=('/client_accuracy',)))
PAPER_TABLES.register('fedevolve_domains', pipelines=('federated',),
                       benchmarks=('rotated_digits',), methods=('fedavg', 'fedevolve', 'fedevp'))(
    PaperTable(None, domains_from_workdirs, needs=('/client_accuracy',)))
PAPER_TABLES.register('fedevolve_increments', pipelines=('federated',),
                       benchmarks=('rotated_digits',))(
    PaperTable(None, increments_from_workdirs, needs=('/client_accuracy',)))
