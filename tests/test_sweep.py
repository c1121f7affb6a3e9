"""Hyperparameter sweeps (config.sweep): the points of a grid train as one program
with the results of the same hyperparameters run alone, selection as the papers
tuned, and bad grids refused before anything compiles."""
import ast
import json
import logging
import os
import subprocess
import sys

import chex
import numpy as np
import pytest

from fedjax_shift import pipelines, report
from fedjax_shift.report import sweeps
from fedjax_shift.pipelines import sweep
from fedjax_shift.pipelines.workdir import RunMismatchError
from tests.helpers import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A swept run and the same values run alone differ by float rounding only: a traced
# float32 rate against a Python float folded into the program, and the vmapped round's
# batched kernels (the seeds' test, tests/test_vmap_seeds.py, holds the same bound).
RTOL, ATOL = 1e-5, 1e-6

CASES = {   # method, swept field, values, extra config fields
    'fedavg': ('fedavg', 'client.learning_rate', (0.05, 0.1), {}),
    'fedprox': ('fedprox', 'fedprox.mu', (0.0, 0.1), {}),
    'ditto': ('ditto', 'ditto.lam', (0.1, 1.0), {}),   # per-client state
    # a method's own client rate (config.client_overrides), traced as the shared one is
    'override': ('fedprox', 'client_overrides.fedprox.learning_rate', (0.05, 0.1),
                 {'client_overrides': {'fedprox': {'learning_rate': 0.02}}}),
    # the cohort sorted by size in groups of one, cut to two padded sizes
    'grouped': ('fedavg', 'client.learning_rate', (0.05, 0.1),
                {'engine.client_chunk': 1, 'engine.example_buckets': (256, 700, 100_000)}),
    'tent': ('fedavg', 'adapters.tent.learning_rate', (0.001, 0.01),
             {'model.name': 'bn_mlp', 'eval_adapters': ('tent:online',),
              'eval_adapter_algorithms': ('fedavg',), 'eval_adapter_splits': ('test', 'val'),
              'sweep_metric': {'*': 'global+tent/val/accuracy'}}),
}


def case_config(case: str, **fields):
  method, _, _, extra = CASES[case]
  return tiny_config(**{'algorithms': (method,), 'rounds': 2, 'eval_every': 2, **extra,
                        **fields})


@pytest.mark.parametrize('case', sorted(CASES))
def test_swept_points_equal_the_same_values_run_alone(tmp_path, case, caplog):
  method, field, values, _ = CASES[case]
  config = case_config(case, sweep=sweep.grid({field: values}))
  with caplog.at_level(logging.INFO, logger='fedjax_shift'):
    grid = pipelines.run(config, str(tmp_path / 'grid'))
  runs = {r['sweep_point'][field]: r for r in grid.records['all_results']}
  assert sorted(runs) == sorted(values)
  # the second value alone: equal metric by metric and state leaf by leaf
  alone = pipelines.run(sweep.with_values(case_config(case), {field: values[1]}),
                        str(tmp_path / 'alone')).records['results'][0]
  swept = runs[values[1]]
  assert swept['metrics'].keys() == alone['metrics'].keys()
  for name, value in alone['metrics'].items():
    np.testing.assert_allclose(swept['metrics'][name], value, rtol=RTOL, atol=ATOL,
                               err_msg=name)
  chex.assert_trees_all_close(swept['server_state'], alone['server_state'], rtol=RTOL,
                              atol=ATOL)
  # ... and the points trained with their own values, not one value broadcast
  differs = [name for name in alone['metrics'] if name.endswith('/loss') and
             runs[values[0]]['metrics'][name] != swept['metrics'][name]]
  assert differs, 'both points have the same metrics'
  # every point in its own run directory, named by its values
  for value in values:
    run_dir = tmp_path / 'grid' / method / f'{field}={value!r}' / 'seed_0'
    assert json.loads((run_dir / 'results.json').read_text())['sweep_point'] == {field: value}
  # floats used only as numbers: the points are one vmapped program
  assert all(r['vmapped_points'] == 2 for r in runs.values())
  assert 'one program per value' not in caplog.text


def test_a_shape_changing_field_compiles_once_per_value_and_says_so(tmp_path, caplog):
  config = tiny_config(rounds=1, sweep=sweep.grid({'client.local_epochs': (1, 2)}))
  with caplog.at_level(logging.INFO, logger='fedjax_shift'):
    out = pipelines.run(config, str(tmp_path))
  points = [r['sweep_point'] for r in out.records['all_results']]
  assert points == [{'client.local_epochs': 1}, {'client.local_epochs': 2}]
  assert caplog.text.count("changes fedavg's shapes or loop bounds") == 2
  steps = [r['metrics'] for r in out.records['all_results']]
  assert steps[0] != steps[1]


def test_a_float_in_python_control_flow_falls_back_to_one_program_per_value(tmp_path,
                                                                            caplog):
  # q-FFL converts q to a Python float while building its loss: tracing fails, and the
  # points train one after another with their own programs, as alone.
  config = tiny_config(algorithms=('qffl',), rounds=1, sweep=sweep.grid({'qffl.q': (0.5, 2.0)}))
  with caplog.at_level(logging.INFO, logger='fedjax_shift'):
    out = pipelines.run(config, str(tmp_path / 'grid'))
  assert 'qffl uses qffl.q in Python (ConcretizationTypeError); one program per value' in \
      caplog.text
  runs = {r['sweep_point']['qffl.q']: r for r in out.records['all_results']}
  assert 'vmapped_points' not in runs[2.0]
  alone = pipelines.run(tiny_config(algorithms=('qffl',), rounds=1, **{'qffl.q': 2.0}),
                        str(tmp_path / 'alone')).records['results'][0]
  assert runs[2.0]['metrics'] == alone['metrics']   # the same program: equal to the bit


def result(seed, point, val, test=0.5, rounds=None, diverged=False):
  run = {'seed': seed, 'sweep_point': point, 'metrics': {'global/val/accuracy': val,
                                                         'global/test/accuracy': test}}
  if rounds:
    run['evaluations'] = [{'round': r, 'global/val/accuracy': v, 'global/test/accuracy': t}
                          for r, v, t in rounds]
  if diverged:
    run = {'seed': seed, 'sweep_point': point, 'metrics': {}, 'diverged': 'NaN'}
  return run


def test_selection_takes_the_best_validation_mean_first_in_grid_order_on_ties():
  points = [{'lr': 0.01}, {'lr': 0.1}, {'lr': 0.3}, {'lr': 1.0}]
  results = [result(0, points[0], 0.50), result(1, points[0], 0.60),   # mean 0.55
             result(0, points[1], 0.70), result(1, points[1], 0.60),   # mean 0.65
             result(0, points[2], 0.60), result(1, points[2], 0.70),   # mean 0.65 (tie)
             result(0, points[3], 0.99), result(1, points[3], 0, diverged=True)]
  index, summaries = sweep.select(results, points, 'global/val/accuracy', 'last')
  assert index == 1   # 0.65 ties with lr=0.3: the first in grid order; lr=1.0 diverged
  assert summaries[1]['validation_mean'] == pytest.approx(0.65)
  assert summaries[3]['diverged'] == [1]


def test_best_round_selection_scores_each_run_at_its_best_validation_round():
  points = [{'lr': 0.1}, {'lr': 0.3}]
  results = [result(0, points[0], 0.60, rounds=[(5, 0.70, 0.40), (10, 0.60, 0.50)]),
             result(0, points[1], 0.65, rounds=[(5, 0.50, 0.40), (10, 0.65, 0.60)])]
  assert sweep.select(results, points, 'global/val/accuracy', 'last')[0] == 1
  index, summaries = sweep.select(results, points, 'global/val/accuracy', 'best_round')
  assert index == 0   # 0.70 at round 5 beats 0.65
  assert summaries[0]['metrics'][0]['global/test/accuracy'] == 0.40


@pytest.mark.parametrize('grid,message', [
    ("{'client.learning_rat': (0.1,)}", 'client.learning_rat is not a field'),
    ("{'client.optimizer': (1.0,)}", 'client.optimizer is not a numeric field'),
    ("{'client.learning_rate': ()}", 'client.learning_rate: the tuple of values is empty'),
    ("{'client.learning_rate': (0.1, -0.1)}", r'client.learning_rate=-0.1 is refused'),
    ("{'client.learning_rate': (0.1, 0.1)}", 'client.learning_rate: a value appears twice'),
    ("{'client.learning_rate': ('a',)}", 'client.learning_rate: values must be numbers'),
    ("{'fedprox.mu': (0.1,)}", 'fedprox is not in config.algorithms'),
    ("{'data.num_clients': (4, 6)}", 'a sweep sets fields of'),
    ("{'client.batch_size': (1.5,)}", 'client.batch_size is an integer field'),
    ("{'adapters.tent.learning_rate': (0.1,)}", 'config.eval_adapters runs no tent'),
    ("{'client.learning_rate': 0.1}", 'client.learning_rate: values are a tuple'),
])
def test_bad_grids_are_refused_before_anything_compiles(tmp_path, grid, message):
  config = tiny_config(sweep=sweep.grid(ast.literal_eval(grid)))
  with pytest.raises(ValueError, match=message.replace('.', r'\.').replace('(', r'\(')
                     if '\\' not in message else message) as error:
    pipelines.run(config, str(tmp_path))
  assert 'config.sweep' in str(error.value)
  assert not os.path.exists(tmp_path / 'fedavg')


def test_the_command_line_reads_the_string_forms_as_sections():
  """launch/train.py passes each argument through legacy_flag: the dotted dict literal
  that config.sweep was as a string is its nested section, a bare metric key is every
  method's, '' is the empty section; other arguments pass as they are."""
  assert sweep.legacy_flag("--config.sweep={'client.learning_rate': (0.01, 0.1), "
                           "'fedprox.mu': (0.001,)}") == (
      "--config.sweep={'client': {'learning_rate': (0.01, 0.1)}, 'fedprox': {'mu': (0.001,)}}")
  assert sweep.legacy_flag('--config.sweep_metric=global+tent/val/accuracy') == (
      "--config.sweep_metric={'*': 'global+tent/val/accuracy'}")
  assert sweep.legacy_flag('--config.sweep=') == '--config.sweep={}'
  for kept in ("--config.sweep={'client': {'learning_rate': (0.1,)}}",
               "--config.sweep_metric={'fedper': 'personalized/val/accuracy'}",
               '--config.rounds=3', '--workdir=/tmp/a=b'):
    assert sweep.legacy_flag(kept) == kept
  assert sweep.parse(sweep.grid({'fedprox.mu': (0.1,), 'client.learning_rate': (0.2,)})) == {
      'client.learning_rate': (0.2,), 'fedprox.mu': (0.1,)}   # fields in path order
  with pytest.raises(ValueError, match='config.sweep: client.learning_rate: client is swept as'):
    sweep.grid({'client': (0.1,), 'client.learning_rate': (0.2,)})
  # A field given as a section and dotted, in either order: refused, nothing dropped; a
  # section beside other dotted fields merges.
  for order in [lambda a, b: {**a, **b}, lambda a, b: {**b, **a}]:
    fields = order({'client': {'learning_rate': (0.1, 0.2)}}, {'client.learning_rate': (0.3,)})
    with pytest.raises(ValueError, match='client.learning_rate is swept twice'):
      sweep.legacy_flag(f'--config.sweep={fields!r}')
  assert sweep.parse(sweep.grid({'client': {'learning_rate': (0.1, 0.2)},
                                 'fedprox.mu': (0.01,)})) == {
      'client.learning_rate': (0.1, 0.2), 'fedprox.mu': (0.01,)}


def test_unknown_selection_and_a_sweep_outside_the_federated_pipeline_are_refused(tmp_path):
  with pytest.raises(ValueError, match='config.sweep_select: unknown'):
    pipelines.validate(tiny_config(sweep_select='best'))
  with pytest.raises(ValueError, match='config.sweep: hyperparameter sweeps run in the '
                                       'federated pipeline'):
    pipelines.validate(tiny_config(pipeline='hetero',
                                   sweep=sweep.grid({'client.learning_rate': (1.,)})))


def test_a_sweep_resumes_per_point_and_reports_the_selected_point(tmp_path):
  config = tiny_config(rounds=2, eval_every=2,
                       sweep=sweep.grid({'client.learning_rate': (0.05, 0.1)}))
  first = pipelines.run(config, str(tmp_path))
  again = pipelines.run(config, str(tmp_path))   # every point resumes at its last round
  for a, b in zip(first.records['all_results'], again.records['all_results']):
    assert a['metrics'] == b['metrics']
  record = report.read_sweep(str(tmp_path))
  chosen = record['methods']['fedavg']['selected']
  assert first.records['table']['rows'][0][1] == f'{chosen} (grid edge)'
  # a paper table over this workdir reads the selected point's runs
  runs = report.load_runs([str(tmp_path)])[os.path.basename(str(tmp_path))]
  assert [r['sweep_point'] for r in runs] == [record['methods']['fedavg']['values']]
  out = subprocess.run([sys.executable, os.path.join(ROOT, 'launch', 'report.py'),
                        f'--sweep={tmp_path}'], capture_output=True, text=True, check=True)
  # a two-value grid: either selection is on its edge, marked and explained
  assert f'{chosen} (selected, grid edge)' in out.stdout and 'client.learning_rate=' in out.stdout
  assert "fedavg's selected point is on the grid's edge" in out.stdout


def test_a_plain_run_and_a_sweep_of_one_method_never_share_a_workdir(tmp_path):
  # A plain fedavg run into a swept workdir (and a sweep into a plain one) is refused
  # before anything is written; the report refuses a workdir that already mixes them
  # (one trained before this check), instead of averaging the two as seeds.
  swept = tiny_config(rounds=1, eval_every=1,
                      sweep=sweep.grid({'client.learning_rate': (0.05, 0.1)}))
  plain = tiny_config(rounds=1, eval_every=1, **{'client.learning_rate': 0.1})
  pipelines.run(swept, str(tmp_path / 'swept'))
  with pytest.raises(RunMismatchError, match=r'swept/fedavg holds points of a config.sweep '
                                             r'\(client.learning_rate=0.05, client.learning_'
                                             r'rate=0.1\); this run trains fedavg without'):
    pipelines.run(plain, str(tmp_path / 'swept'))
  assert not os.path.exists(tmp_path / 'swept' / 'fedavg' / 'seed_0')
  pipelines.run(plain, str(tmp_path / 'plain'))
  with pytest.raises(RunMismatchError, match=r'plain/fedavg holds plain runs \(seed_0\); this '
                                             r'run trains fedavg a point of a config.sweep'):
    pipelines.run(swept, str(tmp_path / 'plain'))
  assert sorted(os.listdir(tmp_path / 'plain' / 'fedavg')) == ['seed_0']
  import shutil
  shutil.copytree(tmp_path / 'plain' / 'fedavg' / 'seed_0',
                  tmp_path / 'swept' / 'fedavg' / 'seed_0')
  with pytest.raises(ValueError, match=r'fedavg holds plain runs \(fedavg/seed_0/results.json\) '
                                       r'and a config.sweep whose selected point is'):
    report.load_runs([str(tmp_path / 'swept')])


def test_an_integer_swept_over_a_float_field_is_the_floats_point():
  # (1, 1.0) over client.learning_rate: one point, one run directory, not two.
  config = tiny_config(sweep=sweep.grid({'client.learning_rate': (1, 0.5)}))
  points = sweep.method_points(config, 'fedavg')
  assert points == [{'client.learning_rate': 1.0}, {'client.learning_rate': 0.5}]
  assert [type(p['client.learning_rate']) for p in points] == [float, float]
  assert sweep.point_name(points[0]) == 'client.learning_rate=1.0'
  # an integer field keeps its integers
  config = tiny_config(sweep=sweep.grid({'client.batch_size': (8, 16)}))
  assert sweep.point_name(sweep.method_points(config, 'fedavg')[0]) == 'client.batch_size=8'


def test_a_methods_own_rate_sweeps_without_an_override_set_first():
  # Before: sweeping client_overrides.fedprox.learning_rate was 'not a field of the
  # config' unless the override was set too. Unset, it reads the shared rate the method
  # trains with; each point sets it, the shared rate and FedAvg untouched.
  from fedjax_shift.pipelines.federated import check
  config = tiny_config(algorithms=('fedavg', 'fedprox'), sweep=sweep.grid(
      {'client_overrides.fedprox.learning_rate': (0.3, 0.5)}))
  assert 'fedprox' not in config.client_overrides
  check(config)
  assert sweep.field_value(config, 'client_overrides.fedprox.learning_rate') == \
      config.client.learning_rate
  assert sweep.method_points(config, 'fedavg') == [{}]
  points = sweep.method_points(config, 'fedprox')
  assert points == [{'client_overrides.fedprox.learning_rate': 0.3},
                    {'client_overrides.fedprox.learning_rate': 0.5}]
  point = sweep.with_values(config, points[1])
  assert point.client_overrides.fedprox.learning_rate == 0.5
  assert point.client.learning_rate == config.client.learning_rate


def test_entries_for_methods_not_run_are_listed():
  config = tiny_config(algorithms=('fedavg',))
  config.client_overrides.fedprox = {'learning_rate': 0.3}
  config.sweep_metric = {'*': 'global/val/accuracy', 'moon': 'global/val/accuracy'}
  assert sweep.entries_not_run(config) == {
      'client_overrides.fedprox': {'learning_rate': 0.3},
      'sweep_metric.moon': 'global/val/accuracy'}
  config.algorithms = ('fedavg', 'fedprox', 'moon')
  assert sweep.entries_not_run(config) == {}


def test_points_times_vmapped_seeds_equal_the_points_seed_by_seed(tmp_path):
  from fedjax_shift.pipelines.runs import build_data

  def config_for(**fields):
    config = tiny_config(seeds=(0, 1), rounds=1,
                         sweep=sweep.grid({'client.learning_rate': (0.05, 0.1)}),
                         **fields)
    config.data.pad_to = max(int(split.num_examples.max()) for seed in config.seeds
                             for split in build_data(config, seed).splits.values())
    return config

  by_seed = pipelines.run(config_for(), str(tmp_path / 'by_seed')).records['all_results']
  lockstep = pipelines.run(config_for(**{'engine.vmap_seeds': True}),
                           str(tmp_path / 'lockstep')).records['all_results']
  key = lambda r: (r['sweep_point']['client.learning_rate'], r['seed'])  # noqa: E731
  assert sorted(map(key, lockstep)) == sorted(map(key, by_seed)) == [
      (0.05, 0), (0.05, 1), (0.1, 0), (0.1, 1)]
  expected = {key(r): r for r in by_seed}
  for run in lockstep:
    assert run['vmapped_seeds'] == [0, 1] and run['vmapped_points'] == 2
    for name, value in expected[key(run)]['metrics'].items():
      np.testing.assert_allclose(run['metrics'][name], value, rtol=RTOL, atol=ATOL,
                                 err_msg=f'{key(run)} {name}')


def test_sweep_metric_names_each_methods_validation_metric():
  keys = ['global/val/accuracy', 'personalized/val/accuracy', 'global+tent/val/accuracy']
  config = tiny_config(sweep_metric={'fedper': 'personalized/val/accuracy'})
  assert sweep.validation_metric(config, keys, 'fedper') == 'personalized/val/accuracy'
  assert sweep.validation_metric(config, keys, 'fedavg') == 'global/val/accuracy'  # default
  config = tiny_config(sweep_metric={'fedper': 'personalized/val/accuracy',
                                    '*': 'global+tent/val/accuracy'})
  assert sweep.validation_metric(config, keys, 'fedavg') == 'global+tent/val/accuracy'
  config = tiny_config(sweep_metric={'*': 'global+tent/val/accuracy'})   # every method
  assert sweep.validation_metric(config, keys, 'fedper') == 'global+tent/val/accuracy'
  with pytest.raises(ValueError, match="config.sweep_metric: 'global/val2/accuracy' \\(fedavg\\) "
                                       "is not among the runs' metrics \\['global\\+tent/val/"
                                       "accuracy', 'global/val/accuracy', 'personalized"):
    sweep.validation_metric(tiny_config(sweep_metric={'fedavg': 'global/val2/accuracy'}),
                            keys * 2, 'fedavg')   # each key once in the message


@pytest.mark.parametrize('text,message', [
    ("{'fedpr': 'global/val/accuracy'}", "names 'fedpr', which is not a registered method"),
    ("{'fedavg': 0.5}", 'maps method names to metric keys'),
    ('global/val/acc', "'global/val/acc' is not an accuracy key"),
    ("{'fedavg': 'global/val/loss'}", "'global/val/loss' is not an accuracy key"),
    # a typo in the split: refused against the benchmark's splits, before training
    ("{'*': 'global/vall/accuracy'}", "selects on split 'vall', which the benchmark does not "
                                      "build .its splits: \\['test', 'test_corrupted', 'train', 'val'\\]"),
])
def test_bad_sweep_metrics_are_refused_before_anything_compiles(tmp_path, text, message):
  metric = ast.literal_eval(text) if text.startswith('{') else {'*': text}
  config = tiny_config(sweep=sweep.grid({'client.learning_rate': (0.05, 0.1)}), sweep_metric=metric)
  with pytest.raises(ValueError, match='config.sweep_metric: .*' + message.replace(
      '(', r'\(')):
    pipelines.run(config, str(tmp_path))
  assert not os.path.exists(tmp_path / 'fedavg')


def test_methods_selected_on_their_own_metrics_are_recorded_and_tabled_each():
  # two methods, each validated on its own model (FedTTA Table 1: FedPer's personalised
  # models, FedAvg's global one); a point's test column is its method's model's
  points = [{'client.learning_rate': 0.1}, {'client.learning_rate': 0.3}]

  def runs(model, vals):
    return [{'seed': 0, 'sweep_point': p, 'metrics': {'global/val/accuracy': 1 - v,
                                                       f'{model}/val/accuracy': v,
                                                       f'{model}/test/accuracy': v / 2}}
            for p, v in zip(points, vals)]

  chosen = {'fedavg': sweep.select(runs('global', (0.8, 0.6)), points,
                                   'global/val/accuracy', 'last'),
            'fedper': sweep.select(runs('personalized', (0.6, 0.9)), points,
                                   'personalized/val/accuracy', 'last')}
  assert chosen['fedavg'][0] == 0   # 0.8 > 0.6
  assert chosen['fedper'][0] == 1   # personalized 0.9 > 0.6 (its global says otherwise)
  record = sweep.grid_record({'fedavg': 'global/val/accuracy',
                              'fedper': 'personalized/val/accuracy'}, 'last', chosen)
  assert record['metric'] == 'per method'
  assert record['methods']['fedper']['metric'] == 'personalized/val/accuracy'
  table = sweeps.sweep_grid_table(record)
  assert '| method | metric | point | validation (last) | test | seeds |' in table
  assert ('| fedper | personalized/val/accuracy | client.learning_rate=0.3 (selected, grid '
          'edge) | 90.00 | 45.00 | 1 |') in table
  assert ('| fedavg | global/val/accuracy | client.learning_rate=0.1 (selected, grid edge) | '
          '80.00 | 40.00') in table
  one = sweep.grid_record({'fedavg': 'global/val/accuracy'}, 'last',
                          {'fedavg': chosen['fedavg']})
  assert one['metric'] == 'global/val/accuracy'
  assert ('| method | point | global/val/accuracy (last) | global/test/accuracy | seeds |'
          in sweeps.sweep_grid_table(one))


def test_fedtta_tuned_variant_searches_every_rate_on_each_rows_validation():
  from configs import fedtta
  config = fedtta.get_config('tuned')
  assert sweep.parse(config.sweep) == {'client.learning_rate': fedtta.PAPER_RATES}
  assert config.sweep_select == 'best_round'
  assert not any('learning_rate' in config.client_overrides.get(name, {})   # the swept rate
                 for name in config.algorithms)
  assert fedtta.get_config('').client_overrides.fedprox.learning_rate == 0.3  # untuned: own
  metrics = sweep.parse_metric(config.sweep_metric)
  assert set(metrics) == set(config.algorithms)
  assert metrics['fedper'] == 'personalized/val/accuracy'
  assert metrics['fedtta_prox'] == metrics['fedtta'] == 'global+fedtta/val/accuracy'
  assert metrics['odpfl_hn'] == 'global+odpfl_hn/val/accuracy'
  assert metrics['fedavg'] == 'global/val/accuracy'
  pipelines.validate(config)
  with pytest.raises(ValueError, match="'tuned' does not combine with 'tent'"):
    fedtta.get_config('tent,tuned')


def test_fedicon_tuned_variant_searches_the_baselines_rates_on_each_rows_validation():
  from configs import fedicon
  config = fedicon.get_config('tuned')
  assert sweep.parse(config.sweep) == {'client.learning_rate': fedicon.TUNED_RATES}
  assert 0.01 in fedicon.TUNED_RATES   # Sec. 5.1's one rate is a point of the grid
  assert not any(name.startswith('fedicon') for name in config.algorithms)
  assert not any('learning_rate' in config.client_overrides.get(name, {})
                 for name in config.algorithms)
  assert 'val' in config.eval_adapter_splits   # FedTHE's row validates its adapted model
  metrics = sweep.parse_metric(config.sweep_metric)
  assert set(metrics) == set(config.algorithms)
  assert metrics['local'] == metrics['fedrep'] == 'personalized/val/accuracy'
  assert metrics['fedthe'] == 'personalized+fedthe/val/accuracy'
  assert metrics['fedavg'] == 'global/val/accuracy'
  pipelines.validate(config)


def test_a_diverged_point_of_a_vmapped_grid_is_recorded_and_ranked_last(tmp_path):
  # lr 1e8 overflows in the first round; with on_divergence='continue' its run is kept
  # as diverged, named by its point, so that selection and the grid table see it
  config = tiny_config(rounds=2, eval_every=2, on_divergence='continue',
                       sweep=sweep.grid({'client.learning_rate': (100000000.0, 0.05)}))
  out = pipelines.run(config, str(tmp_path))
  runs = {r['sweep_point']['client.learning_rate']: r for r in out.records['all_results']}
  assert 'diverged' in runs[1e8] and 'diverged' not in runs[0.05]
  record = report.read_sweep(str(tmp_path))['methods']['fedavg']
  assert record['selected'] == 'client.learning_rate=0.05'   # first in grid order, but NaN
  assert record['grid'][0]['diverged'] == [0]
  assert '| client.learning_rate=100000000.0 | n/a | n/a | 1 (1 diverged) |' in \
      sweeps.sweep_grid_table(report.read_sweep(str(tmp_path)))


def test_a_resumed_grid_does_not_rewind_to_a_diverged_points_last_checkpoint(tmp_path):
  # The 1e8 point diverges in round 1 and keeps no checkpoint. Resuming the grid once
  # took the newest round every point has, round 0, and retrained the 0.05 point from
  # scratch; now the diverged point is recorded again from its diverged.json and the
  # 0.05 point resumes at its own round 2, ending where the uninterrupted grid did.
  import shutil
  config = tiny_config(rounds=4, eval_every=2, checkpoint_every=2, on_divergence='continue',
                       sweep=sweep.grid({'client.learning_rate': (100000000.0, 0.05)}))
  straight = pipelines.run(config, str(tmp_path / 'straight')).records['all_results']
  live = sweep.run_dir(str(tmp_path / 'cut'), 'fedavg', {'client.learning_rate': 0.05}, 0)
  dead = sweep.run_dir(str(tmp_path / 'cut'), 'fedavg', {'client.learning_rate': 1e8}, 0)
  shutil.copytree(tmp_path / 'straight', tmp_path / 'cut')
  with open(os.path.join(dead, 'diverged.json')) as f:
    assert json.load(f)['round'] == 1
  shutil.rmtree(os.path.join(live, 'checkpoints', '4'))
  os.remove(os.path.join(live, 'results.json'))
  resumed = pipelines.run(config, str(tmp_path / 'cut')).records['all_results']
  assert sorted(os.listdir(live)).count('metrics.jsonl.before_resume_2') == 1
  assert not [f for f in os.listdir(live) if f.startswith('metrics.jsonl.before_resume_0')]
  by_rate = {r['sweep_point']['client.learning_rate']: r for r in resumed}
  assert by_rate[1e8]['diverged'] == {r['sweep_point']['client.learning_rate']: r
                                      for r in straight}[1e8]['diverged']
  expected = {r['sweep_point']['client.learning_rate']: r for r in straight}[0.05]
  np.testing.assert_array_equal(by_rate[0.05]['metrics']['global/test/accuracy'],
                                expected['metrics']['global/test/accuracy'])


def test_a_grid_extended_by_a_value_does_not_retrain_its_finished_points(tmp_path):
  # The new point starts at round 0; the finished one used to rewind with it (one
  # program resumes at the newest round all its runs have) and be trained again.
  config = tiny_config(rounds=2, eval_every=2, sweep=sweep.grid({'client.learning_rate': (0.05,)}))
  first = pipelines.run(config, str(tmp_path)).records['all_results'][0]
  config.sweep = sweep.grid({'client.learning_rate': (0.05, 0.1)})
  grid = pipelines.run(config, str(tmp_path)).records['all_results']
  old = sweep.run_dir(str(tmp_path), 'fedavg', {'client.learning_rate': 0.05}, 0)
  assert not [f for f in os.listdir(old) if 'before_resume' in f]   # nothing recomputed
  by_rate = {r['sweep_point']['client.learning_rate']: r for r in grid}
  assert by_rate[0.05]['metrics'] == first['metrics']
  assert by_rate[0.1]['metrics']['global/test/accuracy'] != first['metrics'][
      'global/test/accuracy']   # trained at its own rate


def test_a_swept_workdir_of_several_methods_reports_each_at_its_point(tmp_path):
  # two methods at the same point are not seeds of one configuration: the report reads
  # both (it once took the point's directory for the method and refused the pair)
  config = tiny_config(rounds=1, eval_every=1, algorithms=('fedavg', 'fedprox'),
                       sweep=sweep.grid({'client.learning_rate': (0.05, 0.1)}))
  pipelines.run(config, str(tmp_path))
  runs = report.load_runs([str(tmp_path)])[os.path.basename(str(tmp_path))]
  assert sorted(r['algorithm'] for r in runs) == ['fedavg', 'fedprox']


def test_a_narrowed_grid_names_a_better_point_it_left_on_disk(tmp_path, caplog):
  # Two points trained, then the grid narrowed to the worse one: the better point is
  # still on disk, and the results say so instead of hiding it.
  config = tiny_config(rounds=1, eval_every=1,
                       sweep=sweep.grid({'client.learning_rate': (0.05, 0.1)}))
  first = pipelines.run(config, str(tmp_path)).records['all_results']
  record = report.read_sweep(str(tmp_path))['methods']['fedavg']
  better = record['selected']
  worse = next(p for p in record['grid'] if p['name'] != better)
  assert worse['validation_mean'] < record['grid'][[p['name'] for p in record['grid']].index(
      better)]['validation_mean']
  config.sweep = sweep.grid({'client.learning_rate': (worse['point']['client.learning_rate'],)})
  with caplog.at_level(logging.WARNING, logger='fedjax_shift'):
    narrowed = pipelines.run(config, str(tmp_path))
  note = (f'fedavg: {better}, trained in this workdir outside this grid, has validation')
  assert note in caplog.text and note in narrowed.records['sweep_grid']
  assert len(first) == 2


def test_a_selected_point_on_the_grids_edge_is_flagged():
  """The best of a grid at its smallest or largest value of a swept field may lie
  outside it: flagged (table mark and note); a point inside the grid, or a field swept
  at one value, is not."""
  points = [{'client.learning_rate': lr, 'fedprox.mu': mu} for lr in (0.01, 0.03, 0.1)
            for mu in (0.001,)]
  assert sweeps.grid_edges(points, points[1]) == []
  assert sweeps.grid_edges(points, points[2]) == [
      'client.learning_rate=0.1 is the largest of 0.01, 0.03, 0.1']
  assert sweeps.grid_edges(points, points[0]) == [
      'client.learning_rate=0.01 is the smallest of 0.01, 0.03, 0.1']
  runs = [{'seed': 0, 'sweep_point': p, 'metrics': {'global/val/accuracy': v,
                                                     'global/test/accuracy': v}}
          for p, v in zip(points, (0.5, 0.9, 0.7))]
  inside = sweeps.sweep_grid_table(sweep.grid_record(
      {'fedprox': 'global/val/accuracy'}, 'last',
      {'fedprox': sweep.select(runs, points, 'global/val/accuracy', 'last')}))
  assert 'client.learning_rate=0.03' in next(line for line in inside.splitlines()
                                              if '(selected) |' in line)
  assert 'grid edge' not in inside and 'Note' not in inside
  runs[2]['metrics'] = {'global/val/accuracy': 0.95, 'global/test/accuracy': 0.95}
  edge = sweeps.sweep_grid_table(sweep.grid_record(
      {'fedprox': 'global/val/accuracy'}, 'last',
      {'fedprox': sweep.select(runs, points, 'global/val/accuracy', 'last')}))
  assert '(selected, grid edge) |' in edge
  assert edge.endswith("Note: fedprox's selected point is on the grid's edge "
                       "(client.learning_rate=0.1 is the largest of 0.01, 0.03, 0.1): a better "
                       "value may lie outside the grid; extend config.sweep past it.")
