"""Results tables (markdown + CSV) and the registry of paper table layouts; the
figures are in ``report.figures``.

A paper's table layout is a ``PaperTable`` registered by name in ``PAPER_TABLES``
(the papers' own folders, ``fedjax_shift/papers/<paper>/``, register theirs);
``config.paper_tables`` names the one a run prints and ``launch/report.py --kind``
the one it rebuilds from finished workdirs. ``beside_paper`` sets a paper's own
numbers beside ours, row by row, with a last column saying which of the paper's
orderings our numbers reproduce.
"""
from __future__ import annotations

import csv
import glob
import logging
import math
import os
import re
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import ml_collections
import numpy as np

from fedjax_shift import events, metrics
from fedjax_shift.benchmarks import data_view, nested_data
from fedjax_shift.metrics import read_metrics
from fedjax_shift.registry import Registry

log = logging.getLogger('fedjax_shift')


def mean_std(values: Sequence[float], scale: float = 100.0, digits: int = 2) -> str:
  """'mean ± std' of ``scale``·values over the finite ones ('n/a' if none; the value
  alone if one), ``digits`` decimals: accuracies as percentages by default. When some
  runs have no finite value (a diverged seed), the cell says over how many it is:
  '9.23 ± 3.05 (3 of 4 runs)', and 'n/a (not finite in 2 of 2 runs)' where every
  recorded value is NaN or inf; no run is dropped without a word."""
  count = len(values)
  present = [v for v in values if v is not None]
  values = [scale * v for v in present if np.isfinite(v)]
  if not values:   # none recorded, or every recorded one NaN or inf: said so
    return 'n/a' if not present else f'n/a (not finite in {len(present)} of {count} runs)'
  cell = (f'{values[0]:.{digits}f}' if len(values) == 1 else
          f'{np.mean(values):.{digits}f} ± {np.std(values):.{digits}f}')
  return cell if len(values) == count else f'{cell} ({len(values)} of {count} runs)'


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
  return {'header': header, 'rows': rows, 'markdown': markdown(header, rows)}


def run_result(path: str) -> Dict:
  """A run's results.json whose accuracies are numbers in [0, 1] (or NaN); a hand-edited
  or damaged one is a ValueError naming the file and the key."""
  record = read_result(path)
  for key, value in record.get('metrics', {}).items():
    if key.endswith('accuracy'):
      check_accuracy(path, key, value)
  return record


def check_accuracy(path: str, key: str, value) -> None:
  """Refuses an accuracy of a results file ``path`` that is not a number in [0, 1] (or
  NaN), naming the file and ``key``."""
  if not (isinstance(value, (int, float)) and not isinstance(value, bool) and
          (math.isnan(value) or 0.0 <= value <= 1.0)):
    raise ValueError(f'{path}: {key} is {value!r}, not an accuracy in [0, 1]; the file was '
                     f'edited or damaged: re-run that workdir to rewrite it')


def read_sweep(workdir: str) -> Optional[Dict]:
  """``<workdir>/sweep.json`` (a hyperparameter sweep's grid and selections), or None
  for a workdir that ran no sweep."""
  path = os.path.join(workdir, 'sweep.json')
  return read_result(path) if os.path.exists(path) else None


def write_csv(table: Dict[str, object], path: str) -> str:
  """The results table (header + rows) as CSV; returns ``path``."""
  with open(path, 'w', newline='') as f:
    writer = csv.writer(f)
    writer.writerow(table['header'])
    writer.writerows(table['rows'])
  return path


def markdown(header: List[str], rows: List[List[str]]) -> str:
  lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
  return '\n'.join(lines + ['| ' + ' | '.join(row) + ' |' for row in rows])



def grid_table(cells: Mapping[str, Mapping[str, Mapping[int, float]]],
               labels: Mapping[str, str], columns: Sequence[str], seeds: Sequence[int]) -> str:
  """Rows = ``cells``' keys (labelled by ``labels``), columns = ``columns``; each cell
  mean ± std over ``seeds`` of {row: {column: {seed: accuracy}}}."""
  rows = [[labels.get(key, key)] + [mean_std([by_column.get(c, {}).get(s) for s in seeds])
                                    for c in columns] for key, by_column in cells.items()]
  return markdown(['Method'] + list(columns), rows)


class PaperTable(NamedTuple):
  """A paper's table layout.

  Attributes:
    from_run: (config, the pipeline's ``Results.records``) -> markdown that
      ``launch/train.py`` prints after a run with ``config.paper_tables`` = its name;
      None when the layout merges several runs only.
    from_workdirs: (workdirs, column labels) -> markdown, for ``launch/report.py
      --kind=<name>``; None when it is printed after a run only.
    needs: the metric columns (suffixes of results.json 'metrics' keys, e.g.
      '/val/accuracy') that some run must have, or, for a pipeline without per-run
      results, the ``Results.records`` keys it reads (e.g. 'table1').
  """
  from_run: Optional[Callable[[Any, Dict[str, Any]], str]] = None
  from_workdirs: Optional[Callable[[Sequence[str], Sequence[str]], str]] = None
  needs: Tuple[str, ...] = ()


# name -> PaperTable; meta, what the workdirs a layout reads must be (``check_workdirs``):
# ``pipelines``, the pipelines whose runs it reads; ``benchmarks``, the config.data.benchmark
# values its rows describe (absent: any); ``methods``, of which a workdir must have run one
# (absent: any); ``fields``, {dotted config field: what it must be set to, in words}, each
# set (non-empty, non-zero).
PAPER_TABLES: Registry = Registry('paper table')
# The pipelines whose workdir's results.json holds the records a layout reads (the
# others: one results.json per run).
RECORDS_PIPELINES = ('atp', 'tta_bench')


def missing_columns(table: PaperTable, records: Dict[str, Any]) -> List[str]:
  """The entries of ``table.needs`` that ``records`` lack: record keys, or metric
  columns that no run's metrics end with (none when every run diverged: the layout
  then shows them as diverged)."""
  runs = [run for run in records.get('results', ()) if 'diverged' not in run]
  if records.get('results') and not runs:
    return []
  columns = {key for run in runs for key in run.get('metrics', {})}
  return [need for need in table.needs
          if need not in records and not any(c.endswith(need) for c in columns)]


def config_field(tree: Mapping[str, Any], path: str):
  """The value of dotted ``path`` in a nested dict (None when absent)."""
  for part in path.split('.'):
    if not isinstance(tree, Mapping) or part not in tree:
      return None
    tree = tree[part]
  return tree


def check_workdirs(kind: str, workdirs: Sequence[str]) -> None:
  """Raises ValueError (one paragraph naming the workdir and what it lacks) unless each
  of ``workdirs`` is a finished run that paper table ``kind`` lays out: its
  config.json's pipeline and benchmark among the table's, its declared fields set, one
  of its methods run, and the table's columns among its runs' metrics."""
  table, meta = PAPER_TABLES.get(kind, '--kind'), PAPER_TABLES.meta(kind)
  pipelines, benchmarks = meta.get('pipelines', ()), meta.get('benchmarks', ())
  methods, fields = meta.get('methods', ()), meta.get('fields', {})
  want = (f'--kind={kind} lays out runs of the {" or ".join(pipelines)} pipeline' +
          (f' on the {" or ".join(benchmarks)} benchmark' if benchmarks else '') +
          ''.join(f', with {field} set ({what})' for field, what in fields.items()) +
          (f', of {" or ".join(methods)}' if methods else '') +
          (f', with the columns {list(table.needs)}' if table.needs else ''))
  for workdir in workdirs:
    path = os.path.join(workdir, 'config.json')
    if not os.path.exists(path):
      raise FileNotFoundError(f'{want}; {workdir} has no config.json: not a finished '
                              f'launch/train.py workdir')
    config = recorded_fields(workdir)
    pipeline = config.get('pipeline', 'federated')
    benchmark = config_field(config, 'data.benchmark')
    problem = ''
    if pipelines and pipeline not in pipelines:
      problem = f'it is a run of the {pipeline!r} pipeline (config.pipeline)'
    elif benchmarks and benchmark not in benchmarks:
      problem = f'it ran config.data.benchmark={benchmark!r}'
    else:
      unset = [field for field in fields if not config_field(config, field)]
      problem = f'it leaves {", ".join(unset)} unset' if unset else ''
    if not problem:
      records = (read_result(os.path.join(workdir, 'results.json'))
                 if pipeline in RECORDS_PIPELINES else
                 {'results': next(iter(load_runs([workdir]).values()))})
      ran = sorted({run.get('algorithm') for run in records.get('results', ())})
      lacking = missing_columns(table, records)
      if lacking:
        problem = f'its runs lack the columns {lacking}'
      elif methods and not set(ran) & set(methods):
        problem = f'it ran {ran} only'
    if problem:
      raise ValueError(f'{want}; {workdir} does not: {problem} (its config.json). Pass the '
                       f'workdirs of the runs the table\'s page names.')


def paper_table(config, records: Dict[str, Any]) -> str:
  """The markdown of ``config.paper_tables`` for a finished run's ``records`` ('' when
  it names none). Raises ValueError when the run lacks the columns the layout needs."""
  name = config.paper_tables
  if not name:
    return ''
  table = PAPER_TABLES.get(name, 'config.paper_tables')
  if table.from_run is None:
    raise ValueError(f'config.paper_tables: {name!r} merges finished runs; build it with '
                     f'launch/report.py --kind={name}')
  missing = missing_columns(table, records)
  if missing:
    have = sorted({k for run in records.get('results', ()) for k in run.get('metrics', {})})
    raise ValueError(f'config.paper_tables: {name!r} needs the columns {missing}, which this '
                     f'run lacks (its columns: {have or sorted(records)})')
  return mark_unjudged(table.from_run(config, records), unjudged_reason([config.to_dict()]))


def read_result(path: str):
  """A results / config JSON file; an unreadable one is an error naming it."""
  return metrics.read_json(path, 'was its run interrupted while writing it? Re-run that '
                                 'workdir to rewrite it')


class ParsedTable(NamedTuple):
  """A markdown table of ours: row labels, our numeric columns with each cell's mean
  and spread (NaN where the cell has none), the paper's value beside each column, and
  its title: the last line of text above it that is not one of ``TABLE_NOTES`` (a
  heading or a caption; '' when none)."""
  rows: List[str]
  columns: List[str]
  means: np.ndarray        # [rows, columns]
  spreads: np.ndarray      # [rows, columns] (± part; 0 for one seed)
  paper: np.ndarray        # [rows, columns] the 'paper: <column>' cell, NaN if none
  title: str = ''


def parse_tables(markdown: str) -> List[ParsedTable]:
  """Every markdown table in ``markdown`` that has a numeric column of ours (a column
  not named 'paper: …', with '12.34' or '12.34 ± 0.56' cells)."""
  blocks, current, titles, text = [], [], [], ''
  for line in markdown.splitlines() + ['']:
    if line.strip().startswith('|'):
      if not current:
        titles.append(text)
      current.append([cell.strip() for cell in line.strip().strip('|').split('|')])
    else:
      if current:
        blocks.append(current)
        current, text = [], ''
      line = line.strip().lstrip('#').strip().strip('*').strip()
      if line and not line.startswith(TABLE_NOTES):   # the table's caption: the last
        text = line                                   # line of text above it, not a note
  out = []
  number = re.compile(r'^\**(-?\d+(?:\.\d+)?)\**(?:\s*±\s*(\d+(?:\.\d+)?))?')
  for (header, _, *body), title in ((b, t) for b, t in zip(blocks, titles) if len(b) >= 3):
    rows = [row[0] for row in body]
    columns, means, spreads, paper = [], [], [], []
    for j, name in enumerate(header[1:], start=1):
      if name.startswith('paper') or name == 'seeds':
        continue
      cells = [number.match(row[j]) if j < len(row) else None for row in body]
      if not any(cells):
        continue
      columns.append(name)
      means.append([float(m.group(1)) if m else np.nan for m in cells])
      spreads.append([float(m.group(2) or 0.0) if m else np.nan for m in cells])
      k = header.index(f'paper: {name}') if f'paper: {name}' in header else None
      values = [cell_value(row[k]) if k is not None and k < len(row) else None for row in body]
      paper.append([np.nan if value is None else value for value in values])
    if columns:
      out.append(ParsedTable(rows, columns, np.array(means).T, np.array(spreads).T,
                             np.array(paper, dtype=float).T, title))
  return out


def rebuild_event_files(workdir: str) -> List[str]:
  """Writes anew the TensorBoard event files of every run under ``workdir`` (each
  directory holding a metrics.jsonl) from its records, with the fingerprint fields of
  its run.json as hyperparameters; returns the event directories."""
  paths = sorted(glob.glob(os.path.join(workdir, '**', 'metrics.jsonl'), recursive=True))
  if not paths:
    raise FileNotFoundError(f'no metrics.jsonl under {workdir!r}')
  written = []
  for path in paths:
    run_dir = os.path.dirname(path)
    run_json = os.path.join(run_dir, 'run.json')
    fields = read_result(run_json)['fields'] if os.path.exists(run_json) else None
    written.append(events.rebuild(run_dir, read_metrics(path), fields))
  return written


def column_labels(workdirs: Sequence[str], labels: Sequence[str]) -> List[str]:
  """One column label per workdir (default: the workdir's name)."""
  labels = list(labels) or [os.path.basename(os.path.normpath(w)) for w in workdirs]
  if len(labels) != len(workdirs):
    raise ValueError(f'--labels names {len(labels)} columns for {len(workdirs)} workdirs')
  return labels


def load_runs(workdirs: Sequence[str], labels: Sequence[str] = ()) -> Dict[str, List[Dict]]:
  """{label: [per (method, seed) results.json dicts]} of finished federated or hetero
  runs, one entry per workdir (a swept method: its selected point's runs); labels
  default to the workdir names."""
  out = {}
  for label, workdir in zip(column_labels(workdirs, labels), workdirs):
    paths = sorted(glob.glob(os.path.join(workdir, '*', 'seed_*', 'results.json')))
    swept = read_sweep(workdir)
    for name, method in (swept or {}).get('methods', {}).items():   # its selected point
      plain = sorted(os.path.relpath(path, workdir) for path in paths
                     if path.split(os.sep)[-3] == name)
      if plain:
        raise ValueError(
            f'{workdir}: {name} holds plain runs ({", ".join(plain)}) and a config.sweep '
            f'whose selected point is {method["selected"]}: they are not seeds of one '
            f'configuration. Move one of them to a workdir of its own.')
      paths += sorted(glob.glob(os.path.join(glob.escape(workdir), name,
                                             glob.escape(method['selected']), 'seed_*',
                                             'results.json')))
    if not paths:
      raise FileNotFoundError(f'no <method>/seed_<s>/results.json under {workdir!r}')
    check_seeds_agree(paths)
    out[label] = [run_result(path) for path in paths]
  return out


def check_seeds_agree(paths: Sequence[str]) -> None:
  """Raises ValueError when two seeds of one method (``<method>/seed_<s>/results.json``
  paths, each beside its run.json) were trained with fingerprinted fields or a round
  target that differ: their mean would mix two configurations. Names the field."""
  by_method = {}   # <method> (or a swept <method>/<point>) -> its seeds' runs
  for path in paths:
    run_json = os.path.join(os.path.dirname(path), 'run.json')
    if os.path.exists(run_json):
      parent = os.path.dirname(os.path.dirname(path))
      method = os.path.basename(parent)
      if '=' in method:   # a sweep point's directory: name it with its method's
        method = f'{os.path.basename(os.path.dirname(parent))} at {method}'
      by_method.setdefault(parent, []).append((os.path.dirname(path), read_result(run_json),
                                               method))
  for (first_dir, first, method), *others in by_method.values():
    for other_dir, other, _ in others:
      changed = metrics.record_changes(first, other['fields'], other['rounds'])
      if changed:
        raise ValueError(
            f'{first_dir} and {other_dir} are seeds of {method} trained with different '
            f'configurations; their mean would mix them. Changed:\n  ' + '\n  '.join(changed) +
            '\nRe-run the seeds with one configuration (or report them from separate '
            'workdirs).')


def recorded_fields(workdir: str) -> dict:
  """The config a finished workdir ran with as a dict, its ``data`` as its benchmark
  read it (``data_view``: the shared fields and its section's, flat: 'data.<field>', as
  run.json records them and paper tables name them)."""
  config = run_config(workdir).to_dict()
  if isinstance(config.get('data'), dict) and 'benchmark' in config['data']:
    config['data'] = data_view(ml_collections.ConfigDict(config['data'])).to_dict()
  return config


def run_config(workdir: str):
  """The ConfigDict a finished workdir ran with (its config.json; one recorded before
  the benchmarks' data sections with its benchmark's fields in that section:
  ``benchmarks.nested_data``)."""
  recorded = read_result(os.path.join(workdir, 'config.json'))
  if isinstance(recorded.get('data'), dict):
    recorded['data'] = nested_data(recorded['data'])
  return ml_collections.ConfigDict(recorded)


def cell_value(cell: str) -> Optional[float]:
  """The mean of a table cell ('85.38 ± 1.99', '13.25', '**94.04**'), None for 'n/a'."""
  match = re.search(r'-?\d+(?:\.\d+)?', str(cell))
  return float(match.group()) if match and 'n/a' not in str(cell) else None


def _paper_cell(value) -> str:
  return f'{value:.2f}' if isinstance(value, (int, float)) else str(value)


def beside_paper(header: Sequence[str], rows: Sequence[Sequence[str]],
                 numbers: Optional[Mapping[str, Any]], claims: Sequence[tuple] = (),
                 paper_column: Callable[[str], str] = lambda label: label
                 ) -> Tuple[List[str], List[List[str]]]:
  """``header`` and ``rows`` (first cell: the row label) with the paper's numbers
  beside ours and its claims checked.

  ``numbers``: {'source': where in the paper, 'rows': {row label: {paper column: value}}}
  (None: the paper reports nothing for this layout; the rows come back unchanged).
  Every column of ours whose ``paper_column(label)`` the paper reports gets a
  'paper: <label>' column right after it. ``claims``: (better row, worse row, paper
  columns; () = every column both have), each shown in the better row's last column
  as '> <worse> ✓' when our means order the two rows as the paper does in every such
  column, '✗ (k of n)' otherwise; claims on a row we did not run are left out.
  """
  if not numbers:
    return list(header), [list(row) for row in rows]
  paper_rows = numbers['rows']
  reported = {column for values in paper_rows.values() for column in values}
  ours = {row[0]: row for row in rows}
  new_header, positions = [header[0]], []
  for i, label in enumerate(header[1:], 1):
    new_header.append(label)
    if paper_column(label) in reported:
      new_header.append(f'paper: {label}')
      positions.append(i)
  checked = {}
  for better, worse, columns in claims:
    if better not in ours or worse not in ours:
      continue
    wins, total = 0, 0
    for i, label in enumerate(header[1:], 1):
      column = paper_column(label)
      if columns and column not in columns or not columns and column not in reported:
        continue
      a, b = cell_value(ours[better][i]), cell_value(ours[worse][i])
      if a is None or b is None:
        continue
      total += 1
      wins += a > b
    if total:
      mark = '✓' if wins == total else f'✗ ({wins} of {total})'
      checked.setdefault(better, []).append(f'> {worse} {mark}')
  if claims:
    new_header.append(CLAIMS_HEADER)
  new_rows = []
  for row in rows:
    new = [row[0]]
    for i, cell in enumerate(row[1:], 1):
      new.append(cell)
      if i in positions:
        value = paper_rows.get(row[0], {}).get(paper_column(header[i]))
        new.append(_paper_cell(value) if value is not None else '—')
    if claims:
      new.append('; '.join(checked.get(row[0], [])) or '—')
    new_rows.append(new)
  return new_header, new_rows


CLAIMS_HEADER = "paper's claims, on our numbers"


def unjudged_reason(configs: Sequence[Mapping[str, Any]]) -> str:
  """Why runs of these configs cannot judge a paper's claims ('' when they can): fewer
  rounds than the protocol their config follows (``paper_rounds``), or one seed."""
  reasons = []
  short = [c for c in configs if int(c.get('paper_rounds') or 0) > int(c['rounds'])]
  if short:
    reasons.append(f"{min(int(c['rounds']) for c in short)} rounds of the protocol's "
                   f"{max(int(c['paper_rounds']) for c in short)}")
  if any(len(c['seeds']) < 2 for c in configs):
    reasons.append('1 seed')
  return ', '.join(reasons)


def mark_unjudged(markdown: str, reason: str) -> str:
  """``markdown`` whose claims columns (``CLAIMS_HEADER``) keep each claim but say
  'too short to judge (<reason>)' in place of its ✓ / ✗ (unchanged when ``reason`` is
  '')."""
  if not reason:
    return markdown
  lines, column = [], None
  for line in markdown.split('\n'):
    cells = line.split('|')
    if not line.startswith('|'):
      column = None
    elif CLAIMS_HEADER in (cell.strip() for cell in cells):
      column = [cell.strip() for cell in cells].index(CLAIMS_HEADER)
    elif column is not None and column < len(cells) and cells[column].strip() not in ('', '—') \
        and set(line) - set('|-: '):
      claims = re.sub(r' (✓|✗ \(\d+ of \d+\))', '', cells[column].strip())
      cells[column] = f' {claims}: too short to judge ({reason}) '
      line = '|'.join(cells)
    lines.append(line)
  return '\n'.join(lines)


def fit_width(markdown: str, width: int) -> str:
  """``markdown`` for a terminal ``width`` characters wide: each table with a line
  wider is printed in parts of the columns that fit, every part led by the row labels
  (the first column) and headed 'columns i–j of n'; text and narrow tables unchanged."""
  out, block = [], []

  def flush():
    if block and max(len(line) for line in block) > width:
      out.extend(_column_parts(block, width))
    else:
      out.extend(block)
    block.clear()

  for line in markdown.split('\n'):
    if line.startswith('|'):
      block.append(line)
    else:
      flush()
      out.append(line)
  flush()
  return '\n'.join(out)


def _column_parts(table: List[str], width: int) -> List[str]:
  rows = [[cell.strip() for cell in line.strip().strip('|').split('|')] for line in table]
  count = len(rows[0])
  widths = [max(len(row[i]) if i < len(row) else 0 for row in rows) for i in range(count)]
  parts, start = [], 1
  while start < count:
    stop, used = start, widths[0] + 7
    while stop < count and (stop == start or used + widths[stop] + 3 <= width):
      used += widths[stop] + 3
      stop += 1
    parts.append((start, stop))
    start = stop
  out = []
  for start, stop in parts:
    out.append(f'(columns {start + 1}–{stop} of {count})')
    for row in rows:
      picked = [row[0]] + row[start:stop]
      out.append('| ' + ' | '.join(picked) + ' |')
    out.append('')
  return out[:-1]


# The lines ``paper_markdown`` writes beside a table (where the paper's numbers come
# from, the rows they have that a run lacks): notes, not the table's caption.
PAPER_SOURCE, NO_PAPER_NUMBERS = "Paper's numbers:", 'The paper reports no numbers'
UNFILLED_ROWS = 'Rows the paper reports that these runs do not fill:'
TABLE_NOTES = (PAPER_SOURCE, NO_PAPER_NUMBERS, UNFILLED_ROWS)


def paper_markdown(header, rows, numbers: Optional[Mapping[str, Any]], claims=(),
                   paper_column: Callable[[str], str] = lambda label: label) -> str:
  """``beside_paper``'s table as markdown, under a line naming where the paper's
  numbers come from."""
  unfilled = unfilled_note(numbers, rows)
  header, rows = beside_paper(header, rows, numbers, claims, paper_column)
  source = (f"{PAPER_SOURCE} {numbers['source']}.\n\n" if numbers else
            f'{NO_PAPER_NUMBERS} for this layout.\n\n')
  return source + markdown(header, rows) + unfilled


def unfilled_note(numbers: Optional[Mapping[str, Any]], rows: Sequence[Sequence[str]]) -> str:
  """A line under a table naming the rows the paper reports that ``rows`` (first cell:
  the label) do not fill, e.g. a method whose workdir was not passed ('' when none)."""
  ours = {row[0] for row in rows}
  missing = [label for label in (numbers or {}).get('rows', {}) if label not in ours]
  return f"\n\n{UNFILLED_ROWS} {', '.join(missing)}." if missing else ''
