"""Seeds as one program (config.engine.vmap_seeds): the seeds of a method train
in lockstep through the round vmapped over seeds, with the sequential runs' results."""
import json
import os

import chex
import numpy as np
import pytest

from fedjax_shift import pipelines
from fedjax_shift.data import store
from fedjax_shift.metrics import read_metrics
from fedjax_shift.pipelines.runs import build_data
from fedjax_shift.pipelines.loop import DivergenceError
from tests.helpers import tiny_config


def config_for(**fields):
  config = tiny_config(**{'seeds': (0, 1, 2), 'rounds': 4, 'eval_every': 2,
                          'checkpoint_every': 2, **fields})
  # one bound on every seed's clients, so the seeds share shapes
  bound = max(int(max(split.num_examples.max() for split in build_data(config, seed)
                      .splits.values())) for seed in config.seeds)
  config.data.pad_to = bound
  return config


def run(config, workdir):
  out = pipelines.run(config, str(workdir))
  return {(r['algorithm'], r['seed']): r for r in out.records['results']}


GROUPED = {'engine.client_chunk': 1, 'engine.example_buckets': (256, 700, 100_000)}


@pytest.mark.parametrize('algorithm,fields', [('fedavg', {}), ('fedrep', {}),
                                              ('fedavg', GROUPED)])
def test_vmapped_seeds_equal_sequential_seeds(tmp_path, algorithm, fields):
  # GROUPED: the cohort sorted by size in groups of one, cut to padded sizes that hold
  # every seed's clients.
  sequential = config_for(algorithms=(algorithm,), **fields)
  vmapped = config_for(algorithms=(algorithm,), **fields)
  vmapped.engine.vmap_seeds = True
  a = run(sequential, tmp_path / 'sequential')
  b = run(vmapped, tmp_path / 'vmapped')
  assert a.keys() == b.keys()
  for key in a:
    assert b[key]['vmapped_seeds'] == [0, 1, 2]
    chex.assert_trees_all_close(b[key]['server_state'], a[key]['server_state'], rtol=1e-5,
                                atol=1e-6)
    assert a[key]['metrics'].keys() == b[key]['metrics'].keys()
    for metric, value in a[key]['metrics'].items():
      np.testing.assert_allclose(b[key]['metrics'][metric], value, rtol=1e-5, atol=1e-6,
                                 err_msg=f'{key} {metric}')
    runs = [read_metrics(os.path.join(tmp_path / which, algorithm, f'seed_{key[1]}',
                                      'metrics.jsonl')) for which in ('sequential', 'vmapped')]
    np.testing.assert_allclose([r['loss'] for r in runs[1]], [r['loss'] for r in runs[0]],
                               rtol=1e-5)
  # checkpoints per seed: a re-run resumes every seed at the final round
  again = run(vmapped, tmp_path / 'vmapped')
  column = ('global' if algorithm == 'fedavg' else 'personalized') + '/test/accuracy'
  for key in a:
    assert again[key]['metrics'][column] == b[key]['metrics'][column]


def test_seeds_of_different_shapes_are_refused_naming_pad_to(tmp_path):
  config = tiny_config(**{'seeds': (0, 1), 'rounds': 1})
  shapes = {store.layout_key(build_data(config, seed).splits['train']) for seed in config.seeds}
  assert len(shapes) == 2   # Dirichlet seeds with different largest clients
  config.engine.vmap_seeds = True
  with pytest.raises(ValueError, match='data.pad_to'):
    pipelines.run(config, str(tmp_path))


@pytest.mark.parametrize('field,value,named', [
    ('data.store', 'host', 'data.store'),
    ('engine.rounds_per_call', 2, 'engine.rounds_per_call'),
    ('engine.backend', 'loop', 'engine.backend'),
    ('pipeline', 'atp', 'engine.vmap_seeds'),
])
def test_unsupported_combinations_name_the_field(tmp_path, field, value, named):
  config = tiny_config(**{'engine.vmap_seeds': True})
  if field == 'pipeline':
    import importlib
    config = importlib.import_module('configs.atp').get_config('tiny')
    config.engine.vmap_seeds = True
  else:
    section, leaf = field.split('.')
    config[section][leaf] = value
  with pytest.raises(ValueError, match=named.replace('.', r'\.')):
    pipelines.run(config, str(tmp_path))


def test_a_diverging_seed_is_named_or_recorded_and_the_others_go_on(tmp_path, caplog):
  config = config_for(**{'client.learning_rate': 1e8, 'engine.vmap_seeds': True})
  with pytest.raises(DivergenceError, match=r'seed 0: non-finite training loss .* round 1'):
    pipelines.run(config, str(tmp_path / 'stop'))
  config.on_divergence = 'continue'
  vmapped = run(config, tmp_path / 'continue')
  config.engine.vmap_seeds = False
  sequential = run(config, tmp_path / 'sequential')
  # the same seeds diverge (seeds 0 and 1 at this rate) and the others match
  assert {k for k, r in vmapped.items() if 'diverged' in r} == {
      k for k, r in sequential.items() if 'diverged' in r} == {('fedavg', 0), ('fedavg', 1)}
  for key, record in vmapped.items():
    if 'diverged' in record:
      assert f'seed {key[1]}' in record['diverged']
      with open(tmp_path / 'continue' / 'fedavg' / f'seed_{key[1]}' / 'results.json') as f:
        assert json.load(f)['diverged'] == record['diverged']
    else:
      np.testing.assert_allclose(record['metrics']['global/test/accuracy'],
                                 sequential[key]['metrics']['global/test/accuracy'], rtol=1e-5)
  # a sequential re-run records the diverged seeds again from their diverged.json
  # without training them (it used to retrain each up to its divergence)
  with caplog.at_level('INFO', logger='fedjax_shift'):
    again = run(config, tmp_path / 'sequential')
  assert sorted(m for m in caplog.messages if 'not retrained' in m) == [
      f'{tmp_path / "sequential" / "fedavg" / f"seed_{s}"}: diverged before (diverged.json); '
      'recorded again, not retrained (delete it to retrain)' for s in (0, 1)]
  assert {k: r['diverged'] for k, r in again.items() if 'diverged' in r} == {
      k: r['diverged'] for k, r in sequential.items() if 'diverged' in r}


def test_vmapped_seeds_resume_at_the_newest_round_every_seed_has(tmp_path):
  """A kill between the per-seed saves leaves the seeds' newest checkpoints at different
  rounds (here seed 1 lost its round-4 checkpoint): the re-run resumes every seed at
  round 2, the newest they all have, and ends with the uninterrupted run's results; a
  diverged seed (on_divergence='continue') stays recorded when the run is repeated."""
  import shutil
  config = config_for(**{'engine.vmap_seeds': True})
  straight = run(config, tmp_path / 'straight')
  shutil.copytree(tmp_path / 'straight', tmp_path / 'cut')
  shutil.rmtree(tmp_path / 'cut' / 'fedavg' / 'seed_1' / 'checkpoints' / '4')
  for seed in (0, 2):    # a finished run's results must not be what the re-run reports
    os.remove(tmp_path / 'cut' / 'fedavg' / f'seed_{seed}' / 'results.json')
  resumed = run(config, tmp_path / 'cut')
  for key in straight:
    np.testing.assert_array_equal(resumed[key]['metrics']['global/test/accuracy'],
                                  straight[key]['metrics']['global/test/accuracy'])
    records = read_metrics(os.path.join(tmp_path / 'cut', 'fedavg', f'seed_{key[1]}',
                                        'metrics.jsonl'))
    assert [r['round'] for r in records] == [1, 2, 3, 4]
  config = config_for(**{'client.learning_rate': 1e8, 'engine.vmap_seeds': True,
                         'on_divergence': 'continue'})
  first = run(config, tmp_path / 'diverged')
  # seed 2 lost its last checkpoint; seeds 0 and 1 diverged in round 1 with none kept.
  # The re-run records them again from their diverged.json and resumes seed 2 at its
  # own round 2 (it once rewound every seed to round 0, the diverged seeds' newest).
  seed_2 = tmp_path / 'diverged' / 'fedavg' / 'seed_2'
  shutil.rmtree(seed_2 / 'checkpoints' / '4')
  os.remove(seed_2 / 'results.json')
  again = run(config, tmp_path / 'diverged')
  assert {k for k, r in again.items() if 'diverged' in r} == {
      k for k, r in first.items() if 'diverged' in r} == {('fedavg', 0), ('fedavg', 1)}
  assert sorted(p.name for p in seed_2.glob('metrics.jsonl.before_resume_*')) == [
      'metrics.jsonl.before_resume_2']
  np.testing.assert_array_equal(again[('fedavg', 2)]['metrics']['global/test/accuracy'],
                                first[('fedavg', 2)]['metrics']['global/test/accuracy'])
