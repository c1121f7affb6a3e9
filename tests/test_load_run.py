"""A trained run back in Python (``pipelines.load_run``): its restored state equals the
state its run ended with (the evaluation of the loaded global model reproduces the
recorded test accuracy), sweep points and rounds are chosen by name, and a workdir
without the method, seed, point or round names what it has."""
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_shift import models, pipelines
from tests.helpers import tiny_config


def accuracy(run, split='test'):
  """The global model's accuracy over every client of ``split``, example-weighted."""
  data = run.bench.splits[split]
  correct = total = 0
  for k in range(data.num_clients):
    n = int(data.num_examples[k])
    if n:
      logits, _ = models.apply(run.module, run.global_variables, jnp.asarray(data.x[k, :n]))
      correct += int(jnp.sum(jnp.argmax(logits, -1) == jnp.asarray(data.y[k, :n])))
      total += n
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
  config = tiny_config(rounds=1, eval_every=1, sweep="{'client.learning_rate': (0.05, 0.1)}")
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


def test_the_readmes_python_example_runs(tmp_path):
  # README.md "From Python", executed as written but for its workdir.
  import re
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, 'README.md')) as f:
    section = f.read().split('## From Python', 1)[1]
  code = re.search(r'```python\n(.*?)```', section, re.S).group(1)
  assert code.count('/tmp/fedjax_shift_python') == 2
  namespace = {}
  exec(code.replace('/tmp/fedjax_shift_python', str(tmp_path / 'python')), namespace)
  run, grads = namespace['run'], namespace['grads']
  assert run.round == run.config.rounds
  chex.assert_trees_all_equal_shapes(grads, run.global_variables['params'])
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(grads))
