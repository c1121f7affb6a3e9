"""The test-time adaptation benchmark: its label-shifted stream, its corrupted test
sets, its pipeline (tiny sizes) and its table."""
import json
import os
import time

import jax.numpy as jnp
import numpy as np
import pytest

from configs import tta_bench as configs
from fedjax_shift import models, pipelines
from fedjax_shift.benchmarks import build_benchmark
from fedjax_shift.core import evaluation
from fedjax_shift.data import corruptions, partitions
from fedjax_shift.report import tta_bench as table
from tests.helpers import launch_module

ROWS = ('no_adapt@episodic', 'tent@online', 'sar@online')


def tiny(**fields):
  config = configs.get_config('tiny')
  config.tta_bench.rows = ROWS
  config.tta_bench.iid_batch_sizes = (8,)
  for path, value in fields.items():
    section, field = path.split('__')
    config[section][field] = value
  return config


def test_label_shifted_order_with_one_slot_lists_each_class_whole_in_a_drawn_order():
  """One slot: the Dirichlet share is 1 for every class, so the stream is the classes
  one after another (in the order the slot's permutation draws), each class's examples
  in their given order."""
  labels = np.array([2, 0, 1, 2, 0, 1, 1])
  order = partitions.label_shifted_order(labels, 0.1, np.random.default_rng(0), num_slots=1)
  rng = np.random.default_rng(0)
  rng.dirichlet(np.ones(1) * 0.1, 3)                 # the draw the function makes first
  classes = rng.permutation(3)
  expected = np.concatenate([np.nonzero(labels == c)[0] for c in classes])
  np.testing.assert_array_equal(order, expected)


def test_label_shifted_order_is_a_permutation_in_class_runs_that_a_large_concentration_mixes():
  labels = np.random.default_rng(1).integers(0, 10, 2000)
  changes = {}
  for concentration in (0.1, 1e4):
    order = partitions.label_shifted_order(labels, concentration, np.random.default_rng(2))
    np.testing.assert_array_equal(np.sort(order), np.arange(len(labels)))
    changes[concentration] = int(np.sum(np.diff(labels[order]) != 0))
  # γ = 0.1: at most one run per (class, slot) share, 10 × 10; an i.i.d. order of
  # 10 classes changes class at about 90 % of its 1,999 steps.
  assert changes[0.1] < 100
  assert changes[1e4] >= 99    # balanced slots: every class in each of the 10 slots
  with pytest.raises(ValueError, match='concentration'):
    partitions.label_shifted_order(labels, 0.0, np.random.default_rng(0))


def test_every_corruption_sees_the_same_held_out_test_images():
  config = tiny()
  data = build_benchmark(config.data, 3)
  assert data.info['train_examples'] == 4000 and data.clean_x.shape[0] == 24
  train = data.source.splits['train']
  assert train.num_clients == 1 and int(train.num_examples[0]) == 4000
  for index, name in enumerate(config.data.tta_corruptions.corruptions):
    np.testing.assert_array_equal(
        data.corrupted[name], corruptions.corrupt(data.clean_x, name, 5, 3 * 1_000_003 + index))
  source = {x.tobytes() for x in np.asarray(train.x[0])}
  assert not source & {x.tobytes() for x in data.clean_x}   # disjoint from training
  again = build_benchmark(config.data, 3)
  np.testing.assert_array_equal(again.corrupted['fog'], data.corrupted['fog'])


@pytest.fixture(scope='module')
def finished(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('tta_bench'))
  out = pipelines.run(tiny(), workdir)
  return workdir, out


def test_pipeline_cells_are_the_corruptions_mean_and_minimum_and_no_adaptation_is_the_model(
    finished):
  workdir, out = finished
  cells = out.records['cells']
  assert list(cells) == list(ROWS)
  assert out.records['columns'] == ['iid@8', 'label_shift@8', 'time_limited@8']
  record = json.load(open(os.path.join(workdir, 'seed_0', 'test_time.json')))
  config = tiny()
  data = build_benchmark(config.data, 0)
  module = models.create(config.model, 10)
  loaded = pipelines.load_run(workdir, 'fedavg', 0)
  variables = loaded.global_variables
  assert loaded.extras['test_time'] == record
  # Loop reference: the source model on each corrupted test set, without adaptation.
  direct = []
  for name in config.data.tta_corruptions.corruptions:
    sums = evaluation.split_metrics(module, variables, jnp.asarray(data.corrupted[name]),
                                    jnp.asarray(data.y), jnp.ones(24, bool), 8)
    direct.append(float(sums['correct'] / sums['count']))
  for column in ('iid@8', 'label_shift@8'):   # a stateless row: the order changes nothing
    np.testing.assert_allclose(record['streams'][column]['no_adapt@episodic']['per_corruption'],
                               direct, atol=1e-6)
  for row in ROWS:
    for column, cell in cells[row].items():
      per = np.asarray(cell['per_corruption'][0])
      assert cell['mean'][0] == pytest.approx(per.mean()) and cell['worst'][0] == per.min()
      assert cell['ms_per_batch'][0] > 0
  assert 'adapted_batches' in cells['sar@online']['iid@8']     # SAR says what it skipped
  # time-limited: the online rows that can predict without adapting, each at its C, its
  # time per batch on the i.i.d. stream over no adaptation's (at least 1)
  timed = record['streams']['iid@8']
  limited = record['streams']['time_limited@8']
  assert sorted(limited) == ['sar@online', 'tent@online']
  for row, result in limited.items():
    expected = max(1.0, timed[row]['ms_per_batch'] / timed['no_adapt@episodic']['ms_per_batch'])
    assert result['stream_cost'] == pytest.approx(expected)
  assert 'Online (state carried over the stream)' in out.records['markdown']


def test_a_pinned_cost_of_one_adapts_every_batch_as_the_plain_online_row(tmp_path):
  """C = 1 pinned: the stream is as fast as the method, so the time-limited Tent is the
  online Tent of the i.i.d. column; without a no_adapt row, pinned costs need no
  forward-pass time."""
  config = tiny(tta_bench__rows=('tent@online',))
  config.tta_bench.stream_costs.tent = 1.0
  record = pipelines.run(config, str(tmp_path)).records['cells']['tent@online']
  assert record['time_limited@8']['stream_cost'] == {0: 1.0}
  assert record['time_limited@8']['per_corruption'] == record['iid@8']['per_corruption']


def test_report_rebuilds_the_table_and_merges_the_seeds_of_several_workdirs(finished, tmp_path):
  workdir, out = finished
  report_cli = launch_module('report')
  assert report_cli.build([workdir], 'tta_bench') == out.records['markdown']
  with pytest.raises(ValueError, match='seeds \\[0\\] are also in an earlier workdir'):
    table.load([workdir, workdir])
  other = str(tmp_path / 'seed1')
  config = tiny()
  config.seeds = (1,)
  pipelines.run(config, other)
  merged = report_cli.build([workdir, other], 'tta_bench')
  assert 'seeds (0, 1)' in merged and ' ± ' in merged


def test_table_cell_reads_mean_worst_and_time():
  records = {'cells': {'tent@online': {'iid@64': {'mean': {0: 0.5, 1: 0.7},
                                                  'worst': {0: 0.2, 1: 0.4},
                                                  'ms_per_batch': {0: 2.0, 1: 4.0}}}},
             'clean': {0: 0.9, 1: 0.95}, 'labels': {'tent@online': 'Tent'},
             'columns': ['iid@64'], 'corruptions': ['fog', 'snow']}
  text = table.tables(records)
  # mean 60 ± 10 over the seeds, worst 30 ± 10, 3 ms per batch on average
  assert '| Tent | 60.00 ± 10.00 (30.00 ± 10.00) · 3 ms |' in text
  assert 'i.i.d., batch 64' in text and 'Episodic' not in text


@pytest.mark.parametrize('fields, message', [
    ({'tta_bench__rows': ('tent@batch',)}, 'mode episodic or online'),
    ({'tta_bench__rows': ('nope@online',)}, "no adapter 'nope'"),
    ({'tta_bench__rows': ('fedtta@online',)}, 'adapts what a federated method trains'),
    ({'tta_bench__rows': ('atp@online',)}, 'adapts what a federated method trains'),
    ({'tta_bench__iid_batch_sizes': (8, 8)}, 'one column per batch size'),
    ({'tta_bench__iid_batch_sizes': (), 'tta_bench__label_shift_batch_sizes': ()},
     'at least one stream'),
    ({'tta_bench__label_shift_concentration': 0.0}, 'label_shift_concentration'),
    ({'tta_bench__time_limited_batch_sizes': (4,)}, 'is not one of iid_batch_sizes'),
    ({'tta_bench__rows': ('tent@online',)}, 'add a no_adapt row or pin their costs'),
    ({'tta_bench__rows': ('no_adapt@episodic', 'tent@episodic')},
     'no online row can predict without adapting'),
    ({'tta_bench__stream_costs': {'tent': 0.5}}, 'stream_costs.tent: must be 0'),
])
def test_bad_rows_and_streams_are_refused_before_anything_runs(fields, message, tmp_path):
  config = tiny(**fields)
  with pytest.raises(ValueError, match=message):
    pipelines.run(config, str(tmp_path))
  assert not os.path.exists(tmp_path / 'seed_0')


@pytest.mark.parametrize('name, field, value, message', [
    ('rotta', 'memory_size', 4, 'less than one example of each'),     # < 10 classes
    ('note', 'memory_size', 32, 'longer than the test stream')])      # > 24 test images
def test_an_adapter_the_data_cannot_hold_is_refused_before_the_source_model_trains(
    name, field, value, message, tmp_path):
  config = tiny(tta_bench__rows=('no_adapt@episodic', f'{name}@online'))
  config.adapters[name][field] = value
  with pytest.raises(ValueError, match=f'{name}.*{field}.*{message}'):
    pipelines.run(config, str(tmp_path))
  assert not os.path.exists(tmp_path / 'seed_0' / 'pretrain')


@pytest.mark.parametrize('budget, expected_runs', [(0.0, 1), (60.0, 3)])
def test_a_short_scan_is_timed_by_its_fastest_of_three_runs(monkeypatch, budget,
                                                            expected_runs):
  """A scan whose runs total under TIMING_SECONDS runs again, up to TIMING_RUNS = 3, and
  its time is the fastest run's; one over the budget runs once. The fake scan's runs
  take 30, 10 and 20 ms, so three runs time 10 ms (at least) and one run 30 ms."""
  from fedjax_shift.pipelines import tta_bench as pipeline
  monkeypatch.setattr(pipeline, 'TIMING_SECONDS', budget)
  pauses = iter([0.03, 0.01, 0.02])

  def compiled(x):
    time.sleep(next(pauses))
    return {'correct': x + 1}

  sums, seconds = pipeline.timed_call(compiled, (jnp.arange(2),))
  assert 3 - len(list(pauses)) == expected_runs
  np.testing.assert_array_equal(sums['correct'], [1, 2])
  assert isinstance(sums['correct'], np.ndarray)
  assert (0.01 if expected_runs == 3 else 0.03) <= seconds < (0.025 if expected_runs == 3 else 1.0)
