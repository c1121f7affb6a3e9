"""A trained run back in Python (``pipelines.load_run``): its restored state equals the
state its run ended with (the evaluation of the loaded global model reproduces the
recorded test accuracy), sweep points and rounds are chosen by name, and a workdir
without the method, seed, point or round names what it has."""
import os
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import hetero_fedtta as hetero_configs
from fedjax_shift import checkpoint, models, pipelines
from fedjax_shift.parts import atp_rates
from tests.helpers import override, tiny_config
from fedjax_shift.pipelines import sweep


def accuracy(run, split='test'):
  """The global model's accuracy over every client of ``split``, example-weighted."""
  data = run.bench.splits[split]
  correct = total = 0
  for k in range(data.num_clients):
    x, y = data.client(k)
    if len(y):
      logits, _ = models.apply(run.module, run.global_variables, jnp.asarray(x))
      correct += int(jnp.sum(jnp.argmax(logits, -1) == jnp.asarray(y)))
      total += len(y)
  return correct / total


def test_a_loaded_run_is_the_run_that_was_trained(tmp_path):
  config = tiny_config(rounds=4, eval_every=2, checkpoint_every=2, keep_checkpoints=2)
  out = pipelines.run(config, str(tmp_path))
  run = pipelines.load_run(str(tmp_path), 'fedavg', seed=0)
  assert run.round == 4 and run.results['metrics'] == out.records['results'][0]['metrics']
  assert [r['round'] for r in run.metrics] == [1, 2, 3, 4]
  # The recorded test accuracy is the global model's over every test example (the
  # evaluation weighs clients by their examples): the restored model reproduces it.
  np.testing.assert_allclose(accuracy(run), run.results['metrics']['global/test/accuracy'],
                             atol=1e-6)
  # The checkpoint names its arrays by the state's fields and reads without a template.
  read_round, tree = checkpoint.read(os.path.join(run.run_dir, 'checkpoints'))
  assert read_round == 4 and sorted(tree) == ['seconds', 'server']   # FedAvg: no client state
  chex.assert_trees_all_equal(tree['server'], checkpoint.named_tree(run.server_state))
  chex.assert_trees_all_equal(tree['server']['variables']['params'],
                              run.global_variables['params'])
  assert run.partition['num_examples']['train'] == run.bench.splits['train'].num_examples.tolist()
  earlier = pipelines.load_run(str(tmp_path), 'fedavg', seed=0, round=2)
  assert earlier.round == 2
  with pytest.raises(AssertionError):
    chex.assert_trees_all_close(earlier.global_variables, run.global_variables)
  with pytest.raises(FileNotFoundError, match=r"holds no runs of 'fedprox'; its methods: "
                                              r"\['fedavg'\]"):
    pipelines.load_run(str(tmp_path), 'fedprox', seed=0)
  with pytest.raises(FileNotFoundError, match=r'holds no seed 3; its seeds: \[0\]'):
    pipelines.load_run(str(tmp_path), 'fedavg', seed=3)
  with pytest.raises(FileNotFoundError, match=r'kept no checkpoint of round 1; its rounds: '
                                              r'\[2, 4\]'):
    pipelines.load_run(str(tmp_path), 'fedavg', seed=0, round=1)


def test_a_swept_method_loads_its_selected_point_or_the_one_named(tmp_path):
  config = tiny_config(rounds=1, eval_every=1,
                       sweep=sweep.grid({'client.learning_rate': (0.05, 0.1)}))
  pipelines.run(config, str(tmp_path))
  selected = pipelines.load_run(str(tmp_path), 'fedavg', seed=0)
  assert selected.results['sweep_point'] == {'client.learning_rate':
                                             selected.config.client.learning_rate}
  other = 0.1 if selected.config.client.learning_rate == 0.05 else 0.05
  named = pipelines.load_run(str(tmp_path), 'fedavg', seed=0,
                             point={'client.learning_rate': other})
  assert named.config.client.learning_rate == other and os.path.basename(
      os.path.dirname(named.run_dir)) == f'client.learning_rate={other}'
  with pytest.raises(FileNotFoundError, match=r'holds no point client.learning_rate=0.3; its '
                                              r'points: \[.client.learning_rate=0.05'):
    pipelines.load_run(str(tmp_path), 'fedavg', seed=0, point={'client.learning_rate': 0.3})


def readme_python_examples():
  import re
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, 'README.md')) as f:
    section = f.read().split('## From Python', 1)[1].split('\n## ', 1)[0]
  return re.findall(r'```python\n(.*?)```', section, re.S)


def test_the_readmes_python_examples_run(tmp_path, monkeypatch):
  # README.md "From Python", each example executed as written but for its workdir, from
  # another directory where the repository's root is not importable (a notebook
  # anywhere after pip install -e .): `from configs import ...` would fail there.
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, 'path', [p for p in sys.path
                                    if os.path.abspath(p or os.curdir) != root])
  for name in [m for m in sys.modules if m == 'configs' or m.startswith('configs.')]:
    monkeypatch.delitem(sys.modules, name)
  loaded, alpha, own = readme_python_examples()
  assert not any('from configs' in block or 'import configs' in block
                 for block in (loaded, alpha, own))
  namespace = {}
  assert loaded.count('/tmp/fedjax_shift_python') == 2
  exec(loaded.replace('/tmp/fedjax_shift_python', str(tmp_path / 'python')), namespace)
  run, grads = namespace['run'], namespace['grads']
  assert run.round == run.config.rounds
  metrics = namespace['metrics']   # the run's own evaluation, and T3A on its global model
  assert metrics['global/test/accuracy'] == run.results['metrics']['global/test/accuracy']
  assert 0.0 <= metrics['global+t3a/test/accuracy'] <= 1.0
  chex.assert_trees_all_equal_shapes(grads, run.global_variables['params'])
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(grads))
  # ATP: the gradient of a target client's loss with respect to every module's α.
  namespace = {}
  assert alpha.count('/tmp/fedjax_shift_atp') == 2
  exec(alpha.replace('/tmp/fedjax_shift_atp', str(tmp_path / 'atp')), namespace)
  grad = namespace['alpha_grad']
  chex.assert_trees_all_equal_structs(grad, namespace['alpha'])
  assert len(jax.tree.leaves(grad)) == len(namespace['run'].extras['alpha']) > 1
  assert all(bool(jnp.isfinite(g)) for g in jax.tree.leaves(grad))
  # The α restored is alpha.json's; its frozen model is the pretraining run's.
  run, workdir = namespace['run'], str(tmp_path / 'atp')
  names = atp_rates.module_names(run.server_state.alpha)
  np.testing.assert_allclose([float(a) for a in jax.tree.leaves(run.server_state.alpha)],
                             [run.extras['alpha'][n] for n in names], rtol=1e-6)
  pre = pipelines.load_run(workdir, run.config.algorithms[0], seed=0)
  assert pre.round == pre.config.rounds and run.round == run.config.rounds
  chex.assert_trees_all_equal(run.server_state.variables, pre.global_variables)
  with pytest.raises(FileNotFoundError, match=r"holds no shift 'label'; its shifts: "
                                              r"\['hybrid'\]"):
    pipelines.load_run(workdir, 'atp', seed=0, shift='label')
  with pytest.raises(FileNotFoundError, match=r"holds no method 'fedprox'"):
    pipelines.load_run(workdir, 'fedprox', seed=0)
  # A user's own module and arrays: five compiled rounds lower the training loss, and
  # Tent's episodic accuracy on every client is a fraction.
  namespace = {}
  exec(own, namespace)
  assert float(namespace['out'].metrics['loss']) < 1.2   # 1.37 ≈ ln 3 + noise at round 0
  chex.assert_shape(namespace['adapted']['correct'], (4,))
  np.testing.assert_array_equal(namespace['adapted']['count'], [40, 25, 60, 10])
  with pytest.raises(ValueError, match=r'x of shape \(4, 3, 7, 7, 1\) holds examples of shape '
                                       r'\(7, 7, 1\).*expected to generate shape \(49, 32\)'):
    bad = namespace['federated'].stack_clients([np.zeros((3, 7, 7, 1), np.float32)] * 4,
                                               [np.zeros(3, int)] * 4)
    namespace['round_fn'](namespace['server'], namespace['clients'], bad,
                          namespace['round_key'](jax.random.key(1), 0))


def test_a_checkpoint_of_anonymous_leaves_still_restores_and_another_state_is_named(tmp_path):
  """A checkpoint written as ``leaf_00000…`` (flattening order, before the names)
  restores into the same template as a named one; a state of other fields or shapes is
  refused naming the array."""
  state = checkpoint.RunState({'params': {'w': jnp.arange(6.).reshape(2, 3)}},
                              [jnp.ones(4)], jnp.float32(7.0))
  zeros = jax.tree.map(jnp.zeros_like, state)
  legacy = checkpoint.Checkpointer(str(tmp_path / 'legacy'), 1, 2)
  legacy.manager.save(3, args=checkpoint.ocp.args.StandardSave(
      {f'leaf_{i:05d}': np.asarray(leaf) for i, leaf in enumerate(jax.tree.leaves(state))}))
  legacy.manager.wait_until_finished()
  assert legacy.restore(zeros)[0] == 3
  chex.assert_trees_all_equal(legacy.restore(zeros)[1], state)
  named = checkpoint.Checkpointer(str(tmp_path / 'named'), 1, 2)
  named.save(3, state)
  chex.assert_trees_all_equal(named.restore(zeros)[1], state)
  assert checkpoint.leaf_names(state) == ['server.params.w', 'clients.0', 'seconds']
  with pytest.raises(checkpoint.CheckpointMismatchError, match=r"has \['server.params.v'\] "
                                                               r"that it lacks"):
    named.restore(checkpoint.RunState({'params': {'v': jnp.zeros((2, 3))}}, [jnp.ones(4)],
                                      jnp.float32(0.0)))
  with pytest.raises(checkpoint.CheckpointMismatchError, match=r'server.params.w of shape '
                                                               r'\(2, 3\) where'):
    named.restore(checkpoint.RunState({'params': {'w': jnp.zeros((3, 3))}}, [jnp.ones(4)],
                                      jnp.float32(0.0)))


def test_hetero_runs_load_per_architecture_group(tmp_path):
  config = override(hetero_configs.get_config('tiny'), rounds=2, eval_every=2, seeds=(0,))
  pipelines.run(config, str(tmp_path))
  run = pipelines.load_run(str(tmp_path), 'hetero_fedtta_lambda0.8', seed=0)
  assert run.round == 2 and len(run.client_states) == len(run.algorithm.groups)
  _, tree = checkpoint.read(os.path.join(run.run_dir, 'checkpoints'))
  chex.assert_trees_all_equal(tree['clients'], checkpoint.named_tree(run.client_states))
  with pytest.raises(FileNotFoundError, match=r"holds no method 'hetero_fedtta'; its methods: "
                                              r"\['hetero_fedtta_lambda0.8'\]"):
    pipelines.load_run(str(tmp_path), 'hetero_fedtta', seed=0)


def test_evaluate_on_a_loaded_run_gives_its_results_numbers(tmp_path):
  """pipelines.evaluate of a loaded run equals results.json's metrics to the last bit
  (same programs, same evaluation key): FedAvg's global model, FedPer's personalised ones and
  T3A on them as config.eval_adapters ran it; other adapters on request, none
  with ()."""
  config = tiny_config(**{'algorithms': ('fedavg', 'fedper'), 'eval_adapters': ('t3a:online',),
                          'eval_adapter_algorithms': ('fedper',)})
  pipelines.run(config, str(tmp_path))
  run = pipelines.load_run(str(tmp_path), 'fedper', seed=0)
  assert (run.method, run.seed) == ('fedper', 0)
  metrics = pipelines.evaluate(run)
  recorded = run.results['metrics']
  for key in ('personalized/test/accuracy', 'personalized/test/client_accuracy',
              'personalized+t3a/test/accuracy', 'personalized+t3a/test_corrupted/accuracy'):
    assert key in metrics, sorted(metrics)   # FedPer has no global model
  assert {key: recorded[key] for key in metrics} == metrics
  fedavg = pipelines.load_run(str(tmp_path), 'fedavg', seed=0)
  global_metrics = pipelines.evaluate(fedavg)
  assert 'global/test/accuracy' in global_metrics and \
      {key: fedavg.results['metrics'][key] for key in global_metrics} == global_metrics
  other = pipelines.evaluate(run, adapters=('em:episodic',))
  assert 0.0 <= other['personalized+em/test/accuracy'] <= 1.0
  assert other['personalized/test/accuracy'] == metrics['personalized/test/accuracy']
  assert not any('+' in key for key in pipelines.evaluate(run, adapters=()))
  with pytest.raises(ValueError, match=r"config.eval_adapters: unknown adapter 'nope'"):
    pipelines.evaluate(run, adapters=('nope:episodic',))
