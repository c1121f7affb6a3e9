"""ATP's source/target protocol and the whole test-time pipeline (tiny sizes)."""
import json
import os

import ml_collections
import numpy as np
import pytest

from configs import atp as atp_configs
from fedjax_shift import config as config_lib
from fedjax_shift import pipelines
from fedjax_shift.benchmarks import build_benchmark
from fedjax_shift.benchmarks.atp_shift import class_counts
from fedjax_shift.data import corruptions
from fedjax_shift.metrics import read_metrics
from tests.helpers import override


def tiny(*parts):
  return atp_configs.get_config(','.join(('digits_hybrid', 'tiny') + parts))


def test_step_counts_follow_step_2_16_and_feature_shift_is_balanced():
  rng = np.random.default_rng(0)
  counts = class_counts(200, 10, 'label', 2, 80, 5, rng)
  assert sorted(counts.tolist()) == [5] * 8 + [80, 80]
  counts = class_counts(40, 10, 'hybrid', 2, 80, 5, rng)   # scaled to 40 examples
  assert counts.sum() == 40 and sorted(counts.tolist())[-2:] == [16, 16]
  assert class_counts(203, 10, 'feature', 2, 80, 5, rng).tolist().count(20) == 7


@pytest.mark.parametrize('shift', ['feature', 'label', 'hybrid'])
def test_protocol_shapes_corruptions_and_disjoint_pools(shift):
  config = tiny()
  config.data.atp_shift.shift = shift
  data = build_benchmark(config.data, 0)
  train, val = data.source.splits['train'], data.source.splits['val']
  assert train.x.shape[:2] == (12, 16) and val.x.shape[:2] == (12, 8)
  assert data.target.x.shape[:2] == (4, 12)
  if shift == 'label':
    assert set(data.info['target_corruptions']) == {None}
    # Clean images: no target image is one of the source images (disjoint pools).
    source = {x.tobytes() for x in np.asarray(train.x).reshape(-1, 28 * 28)}
    source |= {x.tobytes() for x in np.asarray(val.x).reshape(-1, 28 * 28)}
    target = {x.tobytes() for x in np.asarray(data.target.x).reshape(-1, 28 * 28)}
    assert not source & target
  else:
    assert set(data.info['source_corruptions']) <= set(corruptions.SOURCE_CORRUPTIONS)
    assert set(data.info['target_corruptions']) <= set(corruptions.HELDOUT_CORRUPTIONS)
  again = build_benchmark(config.data, 0)
  np.testing.assert_array_equal(again.target.x, data.target.x)
  assert not np.array_equal(build_benchmark(config.data, 1).target.y, data.target.y)


def test_source_heldout_images_come_from_base_images_no_source_client_trains_on():
  """Enough clients that base images recur (240 × 24 draws from 4,000 digits): still no
  held-out image is a training image of any source client, and the pools' sizes
  follow source_train : source_heldout."""
  config = tiny()
  config.data.atp_shift.shift = 'label'                      # clean images: compare pixels
  config.data.num_clients = 240
  data = build_benchmark(config.data, 0)
  flat = lambda split: {x.tobytes() for x in np.asarray(split.x).reshape(-1, 28 * 28)}
  assert not flat(data.source.splits['train']) & flat(data.source.splits['val'])
  info = data.info
  assert info['reused_examples']['source_train'] > 0          # the pools did run out
  assert info['source_train_pool'] + info['source_heldout_pool'] == info['source_pool']
  assert info['source_heldout_pool'] == round(info['source_pool'] * 8 / 24)


def test_protocol_bad_input_names_the_field():
  config = tiny()
  config.data.atp_shift.shift = 'covariate'
  with pytest.raises(ValueError, match='config.data.atp_shift.shift'):
    build_benchmark(config.data, 0)
  config = tiny()
  config.data.atp_shift.num_target_clients = 0
  with pytest.raises(ValueError, match='config.data.atp_shift.num_target_clients'):
    build_benchmark(config.data, 0)


def test_cifar10c_protocol_reads_tfds_mock_data():
  import tensorflow_datasets as tfds
  config = atp_configs.get_config('cifar10c_hybrid,tiny')
  config.model = ml_collections.ConfigDict({'name': 'bn_mlp', 'hidden': (8,)})
  with tfds.testing.mock_data(num_examples=200):
    data = build_benchmark(config.data, 0)
  assert data.source.example_shape == (32, 32, 3)
  assert data.target.x.shape == (4, 12, 32, 32, 3)
  assert data.info['target_pool'] == 200
  # A pool without some class is refused, naming the pool.
  with tfds.testing.mock_data(num_examples=6):
    with pytest.raises(ValueError, match='the source (training|held-out) pool .* has no image of class'):
      build_benchmark(config.data, 0)


@pytest.mark.parametrize('field, value, message', [
    ('tta.adapter.tent', 'tent2', "config.tta.adapter.tent: must be a registered adapter name"),
    ('tta.mode.tent', 'sometimes', 'config.tta.mode.tent'),
    ('tta.shifts', ('covariate',), 'config.tta.shifts'),
    ('tta.shifts', ('hybrid', 'hybrid'), "config.tta.shifts: names 'hybrid' more than once"),
    ('tta.rows', ('tent', 'em', 'tent'), "config.tta.rows: names 'tent' more than once"),
    ('seeds', (0, 0), 'config.seeds: names 0 more than once'),
    ('tta.batch_size', 0, 'config.tta.batch_size'),
    ('atp.scaling', 'log', 'config.atp.scaling'),
    ('atp.cohort_size', 99, 'config.atp.cohort_size'),
    ('algorithms', ('fedbn',), 'config.algorithms'),
    ('backbone.weights', 'pretrain', "config.backbone.weights: the atp pipeline starts"),
    ('backbone.weights', '/nowhere/resnet18.npz', 'config.backbone.weights: .* does not exist'),
])
def test_pipeline_config_errors_name_the_field(field, value, message, tmp_path):
  config = override(tiny(), **{field: value})
  with pytest.raises(ValueError, match=message):
    config_lib.validate(config, str(tmp_path))


def test_resnet18_variant_is_the_papers_table_1_model(tmp_path):
  from configs import atp as atp_configs
  config = atp_configs.get_config('cifar10c_feature,resnet18')
  assert (config.model.name, config.model.stem) == ('resnet18', 'imagenet')
  assert (config.client.learning_rate, config.atp.rounds) == (0.01, 200)
  config_lib.validate(config, str(tmp_path))


def test_pipeline_end_to_end_tables_alpha_and_resume(tmp_path):
  """Two shifts, four rows: Table 1 and Table 3 are written, α is logged every round
  and saved; a second run resumes from the checkpoints and reproduces the results."""
  config = tiny()
  config.tta.shifts = ('feature', 'label')
  config.tta.rows = ('no_adapt', 'bn_adapt', 'atp_batch', 'atp_online')
  config.atp.learning_rate = 5.0  # move α visibly in two tiny rounds
  workdir = str(tmp_path)
  out = pipelines.run(config, workdir)
  assert 'Table 1' in out.records['markdown'] and 'Table 3' in out.records['markdown']
  assert set(out.records['table1']) == set(config.tta.rows)
  assert set(out.records['table3']) == {('feature', 'label'), ('label', 'feature')}
  run_dir = os.path.join(workdir, 'label', 'seed_0')
  records = read_metrics(os.path.join(run_dir, 'alpha', 'metrics.jsonl'))
  assert [r['round'] for r in records] == [1, 2]
  alpha_keys = [k for k in records[-1] if k.startswith('alpha/')]
  assert len(alpha_keys) == 8  # bn_mlp (16,): Dense 2 + BN 4 + head 2 modules
  with open(os.path.join(run_dir, 'alpha.json')) as f:
    alpha = json.load(f)
  assert any(abs(v) > 0 for v in alpha.values())
  assert all(np.isclose(alpha[k[len('alpha/'):]], records[-1][k]) for k in alpha_keys)
  assert os.path.exists(os.path.join(workdir, 'alpha.png'))
  again = pipelines.run(config, workdir)
  assert again.records['table1'] == out.records['table1']
  # launch/report.py rebuilds the same tables from the workdir.
  from tests.helpers import launch_module
  launch_report = launch_module('report')
  from fedjax_shift.papers.atp import tables
  table1, table3, _, shifts, seeds = tables.load([workdir])
  assert table1 == out.records['table1'] and table3 == out.records['table3'] and seeds == [0]
  assert shifts == ['feature', 'label']
  with pytest.raises(ValueError, match='also in an earlier workdir'):
    tables.load([workdir, workdir])
  # Without --kind it lays out the workdir's config.paper_tables, as launch/train.py did.
  assert launch_report.build([workdir]) == out.records['markdown']
  assert len(read_metrics(os.path.join(run_dir, 'alpha', 'metrics.jsonl'))) == 2
  # The α-subset probe restores the run: α on every module gives the ATP rows, on none
  # the global model (No adaptation), exactly; single layers come in the model's order.
  from fedjax_shift.papers.atp import probe
  subsets = probe.probe_run(config, workdir, 'label', 0)
  table1 = out.records['table1']
  for key in ('atp_batch', 'atp_online'):
    assert subsets['every module'][key] == pytest.approx(100 * table1[key]['label'][0])
    assert subsets['none (No adaptation)'][key] == pytest.approx(
        100 * table1['no_adapt']['label'][0])
  assert [label for label in subsets if label.endswith(' alone')] == [
      'encoder/Dense_0 alone', 'encoder/BatchNorm_0 alone', 'head alone']
  assert '| every module |' in probe.markdown(subsets, config)


@pytest.mark.slow
def test_digits_hybrid_quick_protocol_runs_every_row(tmp_path):
  """The paper-sized digits protocol (240 + 60 clients), 40 + 40 rounds, one seed:
  every Table 1 row gives a finite accuracy above chance (10 %)."""
  config = atp_configs.get_config('digits_hybrid,quick')
  config.progress = False
  out = pipelines.run(config, str(tmp_path))
  for key in config.tta.rows:
    accuracy = out.records['table1'][key]['hybrid'][0]
    assert np.isfinite(accuracy) and accuracy > 0.1, (key, accuracy)


def test_tables_rank_ties_and_take_the_table3_diagonal_from_table1():
  from fedjax_shift.papers.atp import tables as report
  table1 = {'no_adapt': {'feature': {0: 0.5, 1: 0.7}, 'label': {0: 0.4, 1: 0.4}},
            'atp_batch': {'feature': {0: 0.8, 1: 0.8}, 'label': {0: 0.4, 1: 0.4}}}
  table3 = {('feature', 'label'): {'atp_batch': {0: 0.3, 1: 0.5}},
            ('label', 'feature'): {'atp_batch': {0: 0.6, 1: 0.6}}}
  text = report.tta_tables(table1, table3, {'no_adapt': 'No adaptation',
                                            'atp_batch': 'ATP-batch'},
                           ('feature', 'label'), (0, 1))
  # Feature: ATP 80 beats 60 → ranks 2 / 1; label: tie → 1.5 each.
  assert '| No adaptation | 60.00 ± 10.00 | 40.00 ± 0.00 | 1.8 |' in text
  assert '| ATP-batch | 80.00 ± 0.00 | 40.00 ± 0.00 | 1.2 |' in text
  # Table 3 rows: train shift; the diagonal is Table 1's ATP-batch, off-diagonal table3.
  assert '| Feature shift | 80.00 ± 0.00 | 40.00 ± 10.00 |' in text
  assert '| Label shift | 60.00 ± 0.00 | 40.00 ± 0.00 |' in text


def test_table7_puts_one_column_per_pretraining_method(tmp_path):
  """ATP Table 7 from finished workdirs: the hybrid column of each run, named after its
  pretraining method, with the paper's numbers and claims beside it."""
  from fedjax_shift.papers.atp import tables as report
  workdirs = []
  for method, base in (('fedavg', 0.6), ('fedprox', 0.5)):
    workdir = tmp_path / method
    workdir.mkdir()
    table1 = {'no_adapt': {'hybrid': {'0': base, '1': base}},
              'atp_batch': {'hybrid': {'0': base + 0.1, '1': base + 0.1}},
              'atp_online': {'hybrid': {'0': base + 0.2, '1': base}}}
    (workdir / 'results.json').write_text(json.dumps({'table1': table1, 'table3': {}}))
    (workdir / 'config.json').write_text(json.dumps(
        {'algorithms': [method], 'tta': {'label': {'no_adapt': 'No adaptation',
                                                   'atp_batch': 'ATP-batch',
                                                   'atp_online': 'ATP-online'}}}))
    workdirs.append(str(workdir))
  text = report.table7_from_workdirs(workdirs)
  assert ('| Method | FedAvg | paper: FedAvg | FedProx | paper: FedProx | '
          "paper's claims, on our numbers |") in text
  assert '| No adaptation | 60.00 ± 0.00 | 63.68 | 50.00 ± 0.00 | 63.77 | — |' in text
  # ATP-online 70 ± 10 vs ATP-batch 70: not above it in either column.
  assert '| ATP-online | 70.00 ± 10.00 | 75.37 | 60.00 ± 10.00 | 75.51 | > ATP-batch ✗' in text
  (tmp_path / 'fedavg' / 'results.json').write_text(json.dumps(
      {'table1': {'no_adapt': {'feature': {'0': 0.5}}}, 'table3': {}}))
  with pytest.raises(ValueError, match='hybrid shift'):
    report.table7_from_workdirs(workdirs)
  # an accuracy outside [0, 1] (a hand-edited file) would print as 170.00: refused
  (tmp_path / 'fedavg' / 'results.json').write_text(json.dumps(
      {'table1': {'no_adapt': {'hybrid': {'0': 1.7}}}, 'table3': {}}))
  with pytest.raises(ValueError, match=r'table1.no_adapt.hybrid.0 is 1.7, not an accuracy in '
                                       r'\[0, 1\]'):
    report.table7_from_workdirs(workdirs)


def test_alpha_is_never_reused_after_its_global_model_changed(tmp_path):
  """α (and a learned-rates row) records the pretraining run's fingerprint and round: a
  re-run that extends the pretraining (rounds 2 → 3, resume=extend) or trains it with
  another configuration is refused before anything is touched, naming the α run and
  the change; the same command resumes as before."""
  config = tiny()
  config.tta.rows = ('no_adapt', 'atp_batch')
  workdir = str(tmp_path)
  first = pipelines.run(config, workdir)
  alpha_dir = os.path.join(workdir, 'hybrid', 'seed_0', 'alpha')
  with open(os.path.join(alpha_dir, 'run.json')) as f:
    recorded = json.load(f)['fields']
  assert json.loads(recorded['depends_on.global_model'])['round'] == 2
  extended = override(tiny(), **{'tta.rows': ('no_adapt', 'atp_batch'), 'rounds': 3,
                                 'resume': 'extend'})
  with pytest.raises(ValueError, match=r'(?s)alpha holds a run of another configuration.*'
                                       r'depends_on.global_model: .*"round": 2.* → .*"round": 3'):
    pipelines.run(extended, workdir)
  # Pretraining retrained with another rate of its own (its run deleted first): α's
  # global model is another one.
  import shutil
  saved = os.path.join(workdir, 'kept_pretrain')
  shutil.copytree(os.path.join(workdir, 'hybrid', 'seed_0', 'pretrain'), saved)
  shutil.rmtree(os.path.join(workdir, 'hybrid', 'seed_0', 'pretrain'))
  other = override(tiny(), **{'tta.rows': ('no_adapt', 'atp_batch'),
                              'client_overrides': {'fedavg': {'learning_rate': 0.05}}})
  with pytest.raises(ValueError, match=r'alpha holds a run.*\n  depends_on.global_model: '
                                       r'{"fingerprint"'):
    pipelines.run(other, workdir)
  shutil.copytree(saved, os.path.join(workdir, 'hybrid', 'seed_0', 'pretrain'))
  assert pipelines.run(config, workdir).records['table1'] == first.records['table1']
