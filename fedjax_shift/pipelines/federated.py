"""The federated pipeline (``config.pipeline = 'federated'``): ``run(config, workdir)``
trains every configured method over every seed, evaluates, checkpoints, resumes, and
returns the results table. A method's seeds train one after another
(pipelines/single_run.py) or, for the points of a sweep and vmapped seeds, as one
program (pipelines/lockstep.py); the data, run keys and records they share are in
pipelines/runs.py, the compiled programs in pipelines/programs.py.

Workdir layout::

    <workdir>/<method>/seed_<s>/checkpoints/   orbax, full state
    <workdir>/<method>/seed_<s>/metrics.jsonl  one line per round
    <workdir>/<method>/seed_<s>/partition.json partition statistics of every split
    <workdir>/<method>/seed_<s>/results.json   final metrics, rounds, seconds, hardware
    <workdir>/<method>/seed_<s>/diverged.json  the round and error of a diverged run
                                               (config.on_divergence='continue')
    <workdir>/results.md, results.csv, curves.png
"""
from __future__ import annotations

import json
import logging
import os
from typing import Dict, List, Optional, Sequence

import ml_collections

from fedjax_shift import distributed, report
from fedjax_shift.report import figures, sweeps
from fedjax_shift.benchmarks import BENCHMARKS
from fedjax_shift.pipelines import pretrain, sweep
from fedjax_shift.pipelines.base import PIPELINES, Results, hardware
from fedjax_shift.pipelines.run_config import algorithm_names, check_run
from fedjax_shift.pipelines.lockstep import NotTraceable, lockstep_problem, train_lockstep
from fedjax_shift.pipelines.runs import shared_data
from fedjax_shift.pipelines.single_run import RunInputs, train_and_evaluate

log = logging.getLogger('fedjax_shift')


def train_grid(config: ml_collections.ConfigDict, workdir: str, name: str,
               points: Sequence[sweep.Point], programs: Dict,
               backbone: Optional[dict] = None) -> List[Dict]:
  """Trains method ``name`` at every sweep point × seed of ``config``: the points
  that differ only in traced numbers (and, with ``engine.vmap_seeds``, the seeds) as
  one program; returns the per-run results (as ``train_and_evaluate`` does)."""
  keep_going = config.on_divergence == 'continue'
  problem = lockstep_problem(config)
  seed_groups = ([tuple(config.seeds)] if config.engine.vmap_seeds else
                 [(seed,) for seed in config.seeds])
  results = []
  for group in sweep.program_groups(config, points):
    group_points = [points[i] for i in group]
    fields = sweep.traced_fields(config, group_points)
    fixed = {p: v for p, v in group_points[0].items() if p not in fields}
    if fixed and len(points) > 1:
      log.info('config.sweep: %s changes %s\'s shapes or loop bounds: one program at %s',
               ', '.join(fixed), name, sweep.point_name(fixed))
    lockstep = problem is None and (len(group_points) > 1 or config.engine.vmap_seeds)
    if problem is not None and len(group_points) > 1:
      log.info('config.sweep: %s; the %d points of %s train one after another', problem,
               len(group_points), name)
    for seeds in seed_groups:
      try:
        if lockstep:
          results.extend(train_lockstep(config, workdir, name, group_points, fields, seeds,
                                        programs, backbone))
          continue
      except NotTraceable as err:
        log.info('config.sweep: %s; one program per value', err)
      for point in group_points:
        point_config = sweep.with_values(config, point)
        cache = programs.setdefault(('point', sweep.point_name(point)), {}) if point else \
            programs
        for seed in seeds:
          result = train_and_evaluate(point_config, sweep.run_dir(workdir, name, point, seed),
                                      name, seed, RunInputs(programs=cache, backbone=backbone),
                                      keep_going)
          results.append({**result, 'sweep_point': point} if point else result)
  return results


def run_dirs(config: ml_collections.ConfigDict, workdir: str):
  """[(run_dir, run config, own section)]: one run per method × sweep point × seed."""
  return [(sweep.run_dir(workdir, name, point, seed), sweep.with_values(config, point)
           if point else config, name)
          for name in algorithm_names(config) for point in sweep.method_points(config, name)
          for seed in config.seeds]


def check(config: ml_collections.ConfigDict) -> None:
  check_run(config)
  pretrain.check_backbone(config)
  sweep.check_sweep(config, check)


def data_summary(config: ml_collections.ConfigDict, run_dirs: Dict[str, List[str]]) -> str:
  """'<benchmark>: <clients> clients, <examples> train examples (<min>-<max> per
  client)' as the first run's partition.json recorded them (seed 0's data), preceded by
  the source and partition for a benchmark that deals a pooled source by
  ``data.partition``."""
  data = config.data
  parts = []
  if BENCHMARKS.meta(data.benchmark).get('partitioned'):
    alpha = f' α={data.dirichlet_alpha}' if data.partition == 'dirichlet' else ''
    parts += [data.source, f'partition {data.partition}{alpha}']
  first = next((dirs[0] for dirs in run_dirs.values() if dirs), None)
  path = first and os.path.join(first, 'partition.json')
  if path and os.path.exists(path):
    with open(path) as f:
      train = json.load(f)['statistics']['train']
    parts += [f"{train['clients']} clients", f"{train['examples']} train examples "
              f"({train['examples_per_client_min']}-{train['examples_per_client_max']} per "
              f"client, seed {config.seeds[0]})"]
  return f"{data.benchmark}: {', '.join(parts)}" if parts else data.benchmark


@PIPELINES.register('federated', check=check, run_dirs=run_dirs)
def run(config: ml_collections.ConfigDict, workdir: str) -> Results:
  """Every method × seed of ``config`` (validated by ``pipelines.run``); writes
  results.csv and curves.png. ``records``: 'results' (one dict per run), 'table'
  (the report table: header, rows, markdown), 'paper_tables' (markdown or '')."""
  info = hardware()
  results: List[Dict] = []       # per run; of a swept method, its selected point's
  all_results: List[Dict] = []   # per run, every point
  run_dirs: Dict[str, List[str]] = {}
  programs: Dict = {}  # compiled once per method and data shapes, reused across seeds
  backbone = pretrain.backbone_for(config, workdir)
  unused = sweep.entries_not_run(config)
  if unused:
    log.warning('config.algorithms %s does not run %s: those entries are unused',
                list(config.algorithms), ', '.join(f'config.{path}' for path in unused))
  if sweep.parse(config.sweep) and sweep.parse_metric(config.sweep_metric):
    # the selection metrics' splits, against the data (built once, kept for the runs)
    bench = shared_data(config, config.seeds[0], programs)
    sweep.check_metric_splits(config.sweep_metric, bench.splits)
  selected: Dict[str, tuple] = {}   # method -> (selected point index, per-point summaries)
  notes: List[str] = []   # points of a narrowed grid on disk that validate better
  selection_metrics: Dict[str, str] = {}   # method -> the validation metric it was selected on
  selected_cells: Dict[str, str] = {}   # method -> its selected point ('(grid edge)' marked)
  for name in algorithm_names(config):
    points = sweep.method_points(config, name)
    if points == [{}] and not config.engine.vmap_seeds:
      mine = [train_and_evaluate(config, os.path.join(workdir, name, f'seed_{seed}'), name,
                                 seed, RunInputs(programs=programs, backbone=backbone),
                                 config.on_divergence == 'continue')
              for seed in config.seeds]
    else:
      mine = train_grid(config, workdir, name, points, programs, backbone)
    if points != [{}]:
      metric = selection_metrics[name] = sweep.validation_metric(
          config, [k for r in mine for k in r['metrics']], name)
      selected[name] = sweep.select(mine, points, metric, config.sweep_select)
      best = points[selected[name][0]]
      log.info('config.sweep: %s selects %s (validation %s, %s)', name,
               sweep.point_name(best), metric, config.sweep_select)
      chosen = selected[name][1][selected[name][0]]
      edges = sweeps.grid_edges(points, best)
      selected_cells[name] = sweep.point_name(best) + (' (grid edge)' if edges else '')
      if edges:
        log.warning('config.sweep: %s', sweeps.edge_note(name, edges))
      for hidden in sweep.better_off_grid(workdir, name, points, config.seeds, chosen, metric,
                                          config.sweep_select):
        notes.append(f'{name}: {hidden["name"]}, trained in this workdir outside this grid, '
                     f'has validation {100 * hidden["validation_mean"]:.2f} > the selected '
                     f'{chosen["name"]}\'s {100 * chosen["validation_mean"]:.2f} ({metric}); '
                     f'add its values to config.sweep to select among them')
        log.warning('config.sweep: %s', notes[-1])
      mine_all, mine = mine, [r for r in mine if r.get('sweep_point') == best]
      all_results.extend(mine_all)
    else:
      all_results.extend(mine)
    results.extend(mine)
    run_dirs[name] = [sweep.run_dir(workdir, name, points[selected[name][0]] if name in selected
                                    else {}, seed) for seed in config.seeds]
  grid = None
  if selected:
    record = sweep.grid_record(selection_metrics, config.sweep_select, selected)
    if distributed.is_primary():
      sweep.write(workdir, record)
    grid = sweeps.sweep_grid_table(record) + ''.join(f'\n\nNote: {note}' for note in notes)
  table = report.results_table(results)
  if selected:
    table = sweeps.with_selected_points(table, selected_cells)
  preamble = (f"Benchmark {data_summary(config, run_dirs)}, {config.rounds} rounds, cohort "
              f"{config.cohort_size}; accuracy (%) mean ± std over seeds {tuple(config.seeds)}; "
              f"hardware: {info['device_kind']} ({info['backend']}).")
  files = ((report.write_csv(table, os.path.join(workdir, 'results.csv')),
            figures.plot_curves(run_dirs, os.path.join(workdir, 'curves.png'),
                               title=f'{config.data.benchmark}, {config.rounds} rounds, cohort '
                                     f'{config.cohort_size}, seeds {tuple(config.seeds)}'))
           if distributed.is_primary() else ())
  paper_tables = report.paper_table(config, {'results': results})
  tables = ((table['markdown'],) + ((grid,) if grid else ()) +
            ((paper_tables,) if paper_tables else ()))
  # the terminal's summary: the paper's layout where the run has one (with the sweep's grid)
  terminal = (((grid,) if grid else ()) + (paper_tables,)) if paper_tables else ()
  return Results(preamble, tables, files,
                 {'results': results, 'table': table, 'paper_tables': paper_tables,
                  'all_results': all_results, 'sweep_grid': grid or ''}, terminal)
