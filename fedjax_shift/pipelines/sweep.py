"""Hyperparameter sweeps (``config.sweep``): a grid of values of numeric fields, each
point × seed one run, the numbers traced so that a grid is one compiled program.

    --config.sweep="{'client': {'learning_rate': (0.01, 0.03, 0.1)},
                     'fedprox': {'mu': (0.001, 0.01)}}"

is a section shaped as the config: each leaf a tuple of values for the field at its path,
a field of ``client``, ``server``, ``adapters.<name>``, ``client_overrides.<method>`` or a
method's own section (``config.<method>``). The grid is their product, the fields in the
order of their dotted paths (``grid``: the same from {'client.learning_rate': (…)}; the
command line reads that dotted form too). A method runs the points of the fields it
reads (``fedprox.mu`` is not FedAvg's: FedAvg runs the learning rates alone) in
``<workdir>/<method>/<point>/seed_<s>``, where
``<point>`` is ``client.learning_rate=0.01,fedprox.mu=0.001``; each point keeps what a
run has (fingerprint, lock, checkpoints, metrics, results.json with its
``sweep_point``), and resuming works per point.

One program. A float field is a traced argument: the method, its round and its
evaluation are built inside ``jax.jit`` from a config whose swept floats are tracers
(optimizers too: ``optax.sgd(η)`` with a traced η scales by it, the closed-over
equivalent of ``optax.inject_hyperparams``), so every point shares one compilation,
and the federated pipeline trains the points (× the seeds, with ``engine.vmap_seeds``)
as one ``vmap``ped round. An integer field (epochs, steps, widths) changes shapes or
loop bounds: its values get one program each, as does a float that the method uses in
Python control flow (tracing fails); the log says which, once.

Selection (``config.sweep_select``), as the papers tuned: per method, the point with the
best mean over seeds of the validation accuracy ``config.sweep_metric`` (default: the
global model's on the first split named ``val…``; a dict names each method's, for a
method whose table validates another model), at the last round ('last') or at each
run's round of best validation accuracy ('best_round', FedTTA Sec. 4.1.3);
``config.sweep_metric`` is a section {method: metric key}, '*' naming every other
method's, e.g. {'*': 'global+tent/val/accuracy', 'fedper': 'personalized/val/accuracy'}. A point
with a diverged seed ranks below every point without; ties go to the point first in
grid order. The results table reports each method at its selected point;
``<workdir>/sweep.json`` keeps the whole grid (``launch/report.py --sweep=WORKDIR``).
"""
from __future__ import annotations

import ast
import glob
import itertools
import json
import math
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import ml_collections
import numpy as np

from fedjax_shift.algorithms import ALGORITHMS
from fedjax_shift.core.test_time import ADAPTERS
from fedjax_shift.metrics import changed_fields
from fedjax_shift.registry import leaf_paths, require

SWEPT_SECTIONS = ('client', 'server', 'adapters', 'client_overrides')   # and each method's own
SELECT = ('last', 'best_round')

Grid = Dict[str, Tuple[Any, ...]]   # dotted field path -> values, the paths in order
Point = Dict[str, Any]              # dotted field path -> one value


def grid(fields: Mapping[str, Sequence[Any]]) -> ml_collections.ConfigDict:
  """``config.sweep`` from {dotted field path: values}: {'client.learning_rate': (0.01,
  0.1)} is the section {'client': {'learning_rate': (0.01, 0.1)}}."""
  tree: Dict[str, Any] = {}
  flat: Dict[str, Any] = {}   # section-form entries ({'client': {...}}) as dotted paths
  for path, values in fields.items():
    require(isinstance(path, str) and path, 'sweep', f'field names are strings, got {path!r}')
    leaves = (leaf_paths(values, path + '.') if isinstance(values, Mapping) and values
              else [(path, values)])
    for leaf_path, leaf_values in leaves:
      require(leaf_path not in flat, 'sweep',
              f'{leaf_path} is swept twice (as a section and as a dotted field, values '
              f'{flat.get(leaf_path)!r} and {leaf_values!r}): give it once')
      flat[leaf_path] = leaf_values
  for path, values in flat.items():
    *parents, leaf = path.split('.')
    node = tree
    for part in parents:
      node = node.setdefault(part, {})
      require(isinstance(node, dict), 'sweep', f'{path}: {part} is swept as a field and a '
                                               f'section')
    require(not isinstance(node.get(leaf), dict), 'sweep',
            f'{path}: {leaf} is swept as a field and a section')
    node[leaf] = tuple(values) if isinstance(values, (tuple, list)) else values
  return ml_collections.ConfigDict(tree)


def parse(section: Mapping[str, Any]) -> Grid:
  """``config.sweep`` as {dotted field path: values}, the paths in order; an empty
  section is no sweep. Refuses what is not a section of non-empty tuples of distinct
  numbers, naming the field."""
  require(isinstance(section, (ml_collections.ConfigDict, Mapping)), 'sweep',
          f"is a section shaped as the config, each leaf a tuple of values, e.g. "
          f"{{'client': {{'learning_rate': (0.01, 0.1)}}}}; got {section!r}")
  tree = section.to_dict() if isinstance(section, ml_collections.ConfigDict) else dict(section)
  out = {}
  for path, values in sorted(leaf_paths(tree)):
    require(isinstance(values, (tuple, list)), 'sweep',
            f'{path}: values are a tuple, e.g. (0.01, 0.1), got {values!r}')
    require(len(values) > 0, 'sweep', f'{path}: the tuple of values is empty')
    for value in values:
      require(isinstance(value, (int, float)) and not isinstance(value, bool), 'sweep',
              f'{path}: values must be numbers, got {value!r}')
    require(len(set(values)) == len(values), 'sweep',
            f'{path}: a value appears twice in {tuple(values)}')
    out[path] = tuple(values)
  return out


def legacy_flag(arg: str) -> str:
  """A command-line ``--config.sweep=`` or ``--config.sweep_metric=`` in the form these
  fields had as strings, in their section form: a dict literal of dotted field paths
  ("{'client.learning_rate': (0.01, 0.1)}") as the nested section, a bare metric key
  ('global+tent/val/accuracy') as {'*': key}, '' as {}; any other argument as it is."""
  flag, equals, value = arg.partition('=')
  if not equals or flag not in ('--config.sweep', '--config.sweep_metric'):
    return arg
  if not value.strip():   # '' was no sweep, the default metric
    return f'{flag}={{}}'
  if flag == '--config.sweep':
    try:
      fields = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      return arg
    if isinstance(fields, dict) and any('.' in str(path) for path in fields):
      return f'{flag}={grid(fields).to_dict()!r}'
  if flag == '--config.sweep_metric' and not value.lstrip().startswith('{'):
    return f'{flag}={ {"*": value}!r}'
  return arg


def field_value(config: ml_collections.ConfigDict, path: str):
  """The value of dotted ``path`` in ``config``; KeyError naming it when absent. A
  method's client override that is not set (``client_overrides.<method>.<field>``) has
  the value the method trains with, the shared ``client.<field>``; a field a variant
  follows from its method's section (``Registry.section``), the method's."""
  parts = path.split('.')
  registry, entry = (ADAPTERS, parts[1:]) if parts[0] == 'adapters' else (ALGORITHMS, parts)
  if len(entry) == 2 and entry[0] in registry and registry.variant_of(entry[0]):
    section = registry.section(entry[0], config.adapters if registry is ADAPTERS else config)
    if entry[1] in section:
      return section[entry[1]]
  if (len(parts) == 3 and parts[0] == 'client_overrides' and parts[2] in config.client
      and parts[2] not in config.client_overrides.get(parts[1], {})):
    return config.client[parts[2]]
  node = config
  for part in parts:
    if not isinstance(node, (ml_collections.ConfigDict, dict)) or part not in node:
      raise KeyError(path)
    node = node[part]
  return node


def with_values(config: ml_collections.ConfigDict, point: Mapping[str, Any]
                ) -> ml_collections.ConfigDict:
  """A copy of ``config`` with each dotted path of ``point`` set (numbers converted to
  the field's type; tracers as they are) and no sweep."""
  tree = config.to_dict()
  tree['sweep'] = {}
  for path, value in point.items():
    *parents, leaf = path.split('.')
    node = tree
    for part in parents:
      node = node.setdefault(part, {})   # an override not set yet (``field_value``)
    old = field_value(config, path)
    node[leaf] = type(old)(value) if isinstance(value, (int, float)) else value
  return ml_collections.ConfigDict(tree)


def check_sweep(config: ml_collections.ConfigDict, validate) -> None:
  """``config.sweep``, ``sweep_select`` and ``sweep_metric``, before anything is built:
  each field exists in a section a sweep may set and is numeric (not bool), and every
  value passes ``validate`` (the pipeline's checks, declared ranges included) on the
  config with that value; errors name the field."""
  require(config.sweep_select in SELECT, 'sweep_select',
          f'unknown {config.sweep_select!r}; choose from {list(SELECT)}')
  for name in parse_metric(config.sweep_metric):   # a method not run is let be (a
    require(name == '*' or name in ALGORITHMS, 'sweep_metric',   # variant names its rows)
            f'names {name!r}, which is not a registered method ({sorted(ALGORITHMS.names())})')
  swept = parse(config.sweep)
  if not swept:
    return
  require(config.pipeline == 'federated', 'sweep',
          f'sweeps run in the federated pipeline, not config.pipeline={config.pipeline!r}')
  methods = tuple(config.algorithms)
  for path, values in swept.items():
    top = path.split('.')[0]
    require(top in SWEPT_SECTIONS or top in ALGORITHMS, 'sweep',
            f'{path}: a sweep sets fields of {list(SWEPT_SECTIONS)} or of a method\'s section '
            f'(config.<method>), not of config.{top}')
    method = path_method(path)
    require(not method or method in methods, 'sweep',
            f'{path}: {method} is not in config.algorithms {list(methods)}')
    if top == 'adapters':
      adapter = path.split('.')[1] if path.count('.') >= 2 else ''
      require(adapter in [spec.split(':')[0] for spec in config.eval_adapters], 'sweep',
              f'{path}: config.eval_adapters runs no {adapter or "adapter"} '
              f'({list(config.eval_adapters)})')
    try:
      default = field_value(config, path)
    except KeyError:
      raise ValueError(f'config.sweep: {path} is not a field of the config') from None
    require(isinstance(default, (int, float)) and not isinstance(default, bool), 'sweep',
            f'{path} is not a numeric field (its value {default!r}); sweeps take numbers')
    for value in values:
      require(isinstance(default, float) or float(value).is_integer(), 'sweep',
              f'{path} is an integer field, got {value!r}')
      try:
        validate(with_values(config, {path: value}))
      except ValueError as err:
        raise ValueError(f'config.sweep: {path}={value!r} is refused: {err}') from None


def tune_client_rates(config: ml_collections.ConfigDict, rates: Sequence[float],
                      row_models: Sequence[Tuple[str, str]]) -> None:
  """Sets ``config`` to sweep every method's client learning rate over ``rates`` (each
  method's own rate in ``config.client_overrides`` removed so that it reads the swept
  one) and to select each on the validation accuracy of the model its paper-table row
  reports: ``row_models`` = (method, model) per row, a method's first row counting."""
  for name in config.algorithms:
    if name in config.client_overrides and 'learning_rate' in config.client_overrides[name]:
      del config.client_overrides[name]['learning_rate']
      if not config.client_overrides[name]:
        del config.client_overrides[name]
  config.sweep = grid({'client.learning_rate': tuple(rates)})
  validated = {}
  for method, model in row_models:
    if method in config.algorithms:
      validated.setdefault(method, f'{model}/val/accuracy')
  config.sweep_metric = validated


def method_points(config: ml_collections.ConfigDict, name: str) -> List[Point]:
  """The grid points method ``name`` runs: the product of the swept fields it reads
  (those of other methods' sections left out), in grid order; [{}] when none."""
  fields = {path: [as_field_type(config, path, value) for value in values]
            for path, values in parse(config.sweep).items()
            if path_method(path) in ('', name)}
  return [dict(zip(fields, values)) for values in itertools.product(*fields.values())]


def path_method(path: str) -> str:
  """The method whose own field dotted ``path`` is (``fedprox.mu``,
  ``client_overrides.fedprox.learning_rate``: 'fedprox'); '' for a shared field."""
  parts = path.split('.')
  if parts[0] in ALGORITHMS:
    return parts[0]
  if parts[0] == 'client_overrides' and len(parts) > 1:
    return parts[1]
  return ''


def as_field_type(config: ml_collections.ConfigDict, path: str, value):
  """``value`` as the type of field ``path``: an integer swept over a float field is
  that float, so `1` and `1.0` are one point (one run directory)."""
  if isinstance(field_value(config, path), float) and isinstance(value, int) and \
      not isinstance(value, bool):
    return float(value)
  return value


def point_name(point: Point) -> str:
  """The run directory name of a point: 'client.learning_rate=0.01,fedprox.mu=0.001'."""
  return ','.join(f'{path}={value!r}' for path, value in point.items())


def run_dir(workdir: str, name: str, point: Point, seed: int) -> str:
  """``<workdir>/<method>[/<point>]/seed_<s>``."""
  parts = [workdir, name] + ([point_name(point)] if point else []) + [f'seed_{seed}']
  return os.path.join(*parts)


def traced_fields(config: ml_collections.ConfigDict, points: Sequence[Point]) -> List[str]:
  """The swept fields of ``points`` whose values can be traced: float fields."""
  return [path for path in (points[0] if points else {})
          if isinstance(field_value(config, path), float)]


def program_groups(config: ml_collections.ConfigDict, points: Sequence[Point]
                   ) -> List[List[int]]:
  """Indices of ``points`` that can share one program: equal values of every swept
  field that is not traced (integer fields), in grid order."""
  traced = set(traced_fields(config, points))
  groups: Dict[tuple, List[int]] = {}
  for index, point in enumerate(points):
    key = tuple((p, v) for p, v in point.items() if p not in traced)
    groups.setdefault(key, []).append(index)
  return list(groups.values())


def parse_metric(section: Mapping[str, str]) -> Dict[str, str]:
  """``config.sweep_metric`` as {method: metric}, '*' for every method not named: e.g.
  {'*': 'global+tent/val/accuracy'} for every method, {'fedper':
  'personalized/val/accuracy'} for a method whose table row is validated with another
  model than the global one; an empty section is {}."""
  require(isinstance(section, (ml_collections.ConfigDict, Mapping)), 'sweep_metric',
          f"is a section {{method or '*': metric key}}, e.g. {{'*': "
          f"'global+tent/val/accuracy'}}; got {section!r}")
  metrics = dict(section.items())
  for name, metric in metrics.items():
    require(isinstance(name, str) and isinstance(metric, str) and metric, 'sweep_metric',
            f'maps method names to metric keys, got {name!r}: {metric!r}')
  return {name: check_metric_key(metric) for name, metric in metrics.items()}


def method_entries(config: ml_collections.ConfigDict) -> Dict[str, Any]:
  """{'client_overrides.<method>' or 'sweep_metric.<method>': the entry} for each entry
  of those sections that names a method."""
  out = {}
  for name in config.client_overrides.keys():
    section = config.client_overrides[name]
    out[f'client_overrides.{name}'] = (section.to_dict() if isinstance(
        section, ml_collections.ConfigDict) else section)
  for name, metric in parse_metric(config.sweep_metric).items():
    if name != '*':
      out[f'sweep_metric.{name}'] = metric
  return out


def entries_not_run(config: ml_collections.ConfigDict) -> Dict[str, Any]:
  """The ``method_entries`` naming a method that ``config.algorithms`` does not run: they
  are unused (a paper's config may carry them for the rows a shorter list leaves out)."""
  run = set(config.algorithms)
  return {path: entry for path, entry in method_entries(config).items()
          if path.split('.')[1] not in run}


# What a selection metric's key ends with: '<model>/<split>/<statistic>'.
SELECTION_STATISTICS = ('accuracy', 'client_accuracy')


def check_metric_key(metric: str) -> str:
  """``metric`` when it has the form of an accuracy key, '<model>/<split>/accuracy'
  or '.../client_accuracy' (e.g. 'personalized/val/accuracy'), before anything trains;
  else ValueError naming config.sweep_metric."""
  parts = metric.split('/')
  require(len(parts) == 3 and all(parts) and parts[2] in SELECTION_STATISTICS,
          'sweep_metric', f'{metric!r} is not an accuracy key '
          f'<model>/<split>/{{{", ".join(SELECTION_STATISTICS)}}}, e.g. global/val/accuracy '
          f'or personalized/val/client_accuracy')
  return metric


def check_metric_splits(section: Mapping[str, str], splits: Sequence[str]) -> None:
  """Each ``config.sweep_metric`` key names a split of the benchmark (``splits``), before
  anything trains; else ValueError naming the field and the splits."""
  for name, metric in parse_metric(section).items():
    split = metric.split('/')[1]
    require(split in splits, 'sweep_metric',
            f'{metric!r} ({"every method" if name == "*" else name}) selects on split '
            f'{split!r}, which the benchmark does not build (its splits: {sorted(splits)})')


def validation_metric(config: ml_collections.ConfigDict, keys: Sequence[str],
                      name: str = '') -> str:
  """Method ``name``'s selection metric: its entry of ``config.sweep_metric`` (or the
  '*' entry), else the global model's accuracy on the first validation split among
  ``keys`` ('global/val/accuracy'); ValueError naming the field when the runs have no
  such metric."""
  metrics = parse_metric(config.sweep_metric)
  chosen = metrics.get(name, metrics.get('*'))
  if chosen:
    require(chosen in keys, 'sweep_metric',
            f'{chosen!r} ({name or "every method"}) is not among the runs\' metrics '
            f'{sorted(set(keys))}')
    return chosen
  candidates = sorted(k for k in keys if k.endswith('/accuracy') and
                      k.split('/')[1].startswith('val'))
  candidates.sort(key=lambda k: not k.startswith('global/'))
  require(candidates, 'sweep_select',
          f'selects on validation accuracy, and the benchmark has no split named val… '
          f'(metrics: {sorted(set(keys))}); give it one (e.g. config.data.split_fractions) or '
          f'name the metric with config.sweep_metric')
  return candidates[0]


def validation_score(run: Dict, metric: str, select: str) -> Tuple[float, Dict[str, float]]:
  """(validation accuracy, the metrics at that round) of one run: its last round's, or
  at its evaluated round of best ``metric`` (the earliest such round)."""
  if select == 'best_round':
    evaluations = [e for e in run.get('evaluations', ()) if metric in e]
    if evaluations:
      best = max(evaluations, key=lambda e: (e[metric], -e['round']))
      return best[metric], best
  return run['metrics'].get(metric, float('nan')), run['metrics']


def select(results: Sequence[Dict], points: Sequence[Point], metric: str, select_rule: str
           ) -> Tuple[int, List[Dict]]:
  """(index of the selected point, one summary per point) from a method's per-run
  ``results`` (each with its 'sweep_point'). A summary: the point, its validation
  accuracy per seed and mean, the test metrics at the same rounds, and 'diverged'
  seeds. Best mean validation wins; a point with a diverged seed or no finite
  validation ranks below every other; ties: the first in grid order."""
  summaries = []
  for point in points:
    runs = [r for r in results if r.get('sweep_point', {}) == point]
    scores, at_rounds = [], []
    for r in runs:
      if 'diverged' in r:
        continue
      score, metrics = validation_score(r, metric, select_rule)
      scores.append(score)
      at_rounds.append(metrics)
    finite = [s for s in scores if np.isfinite(s)]
    diverged = [r['seed'] for r in runs if 'diverged' in r]
    summaries.append({'point': point, 'name': point_name(point),
                      'seeds': [r['seed'] for r in runs], 'diverged': diverged,
                      'validation': scores,
                      'validation_mean': float(np.mean(finite)) if finite else float('nan'),
                      'metrics': at_rounds})

  def rank(index: int):
    s = summaries[index]
    eligible = not s['diverged'] and np.isfinite(s['validation_mean'])
    return (eligible, s['validation_mean'] if eligible else -math.inf, -index)

  return max(range(len(points)), key=rank), summaries


def better_off_grid(workdir: str, name: str, points: Sequence[Point], seeds: Sequence[int],
                    selected: Dict, metric: str, select_rule: str) -> List[Dict]:
  """The summaries (as ``select``'s) of points of method ``name`` trained in
  ``workdir`` before, outside ``points`` (a grid since narrowed), over every seed of
  ``seeds``, trained as the ``selected`` summary's runs but for the swept fields, whose
  mean validation accuracy is above the selected point's: a narrowed grid must not
  hide a better point it once had."""
  names = {point_name(point) for point in points}
  reference = os.path.join(workdir, name, selected['name'], f'seed_{seeds[0]}', 'run.json')
  if not os.path.exists(reference):
    return []
  with open(reference) as f:
    recorded = json.load(f)
  swept = set(selected['point'])
  unswept = {k: v for k, v in recorded['fields'].items() if k not in swept}
  found: Dict[str, List[Dict]] = {}
  for directory in sorted(glob.glob(os.path.join(glob.escape(workdir), glob.escape(name),
                                                 '*=*'))):
    if os.path.basename(directory) in names:
      continue
    runs = []
    for seed in seeds:
      paths = [os.path.join(directory, f'seed_{seed}', file)
               for file in ('results.json', 'run.json')]
      if not all(map(os.path.exists, paths)):
        break
      with open(paths[0]) as f:
        result = json.load(f)
      with open(paths[1]) as f:
        other = json.load(f)
      if set(result.get('sweep_point', {})) != swept or other['rounds'] != \
          recorded['rounds'] or changed_fields(other['fields'], unswept, swept):
        break
      runs.append(result)
    else:
      found[os.path.basename(directory)] = runs
  if not found:
    return []
  off_points = [runs[0]['sweep_point'] for runs in found.values()]
  _, summaries = select([r for runs in found.values() for r in runs], off_points, metric,
                        select_rule)
  return [s for s in summaries if not s['diverged'] and np.isfinite(s['validation_mean']) and
          s['validation_mean'] > selected['validation_mean']]


def grid_record(metrics: Mapping[str, str], select_rule: str,
                by_method: Mapping[str, Tuple[int, List[Dict]]]) -> Dict:
  """sweep.json's content: the rule, the metric ('per method' when the methods were
  selected on different ones), and per method its metric, its selected point and every
  point's summary. ``metrics``: method -> the metric it was selected on."""
  distinct = sorted(set(metrics.values()))
  return {'select': select_rule, 'metric': distinct[0] if len(distinct) == 1 else 'per method',
          'methods': {name: {'metric': metrics[name], 'selected': summaries[index]['name'],
                             'values': summaries[index]['point'], 'grid': summaries}
                      for name, (index, summaries) in by_method.items()}}


def write(workdir: str, record: Dict) -> str:
  path = os.path.join(workdir, 'sweep.json')
  with open(path, 'w') as f:
    json.dump(record, f, indent=1)
  return path


def read(workdir: str) -> Optional[Dict]:
  """``<workdir>/sweep.json``, or None for a workdir that ran no sweep."""
  path = os.path.join(workdir, 'sweep.json')
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)
