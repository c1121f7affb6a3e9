"""The test-time engine and the first adapters against direct computations."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_shift import models
from fedjax_shift.adapters import ADAPTERS
from fedjax_shift.adapters.bn_adapt import bn_adapt, prior_weight
from fedjax_shift.adapters.no_adapt import no_adapt
from fedjax_shift.adapters.tent import tent
from fedjax_shift.core.test_time import AdaptBatch, build_test_time
from helpers import backend_tolerance, toy_clients

NUM_CLASSES = 3


def setup(sizes, pad_to=None, seed=0):
  module = models.MODELS.get('bn_mlp')(NUM_CLASSES, hidden=(8,))
  data, xs, ys = toy_clients(sizes, num_classes=NUM_CLASSES, seed=seed, pad_to=pad_to)
  variables = models.init(module, jax.random.key(0), jnp.zeros((1, 4, 4, 1)))
  # Non-trivial running statistics, as after source training.
  variables = {**variables, 'batch_stats': jax.tree.map(lambda s: s + 0.3,
                                                        variables['batch_stats'])}
  return module, data, xs, ys, variables


def test_no_adapt_equals_direct_evaluation():
  module, data, xs, ys, variables = setup([7, 4, 9])
  out = build_test_time(no_adapt(module), batch_size=4)(variables, data, jax.random.key(0))
  for k, (x, y) in enumerate(zip(xs, ys)):
    logits, _ = models.apply(module, variables, jnp.asarray(x))
    np.testing.assert_allclose(out['correct'][k], np.sum(np.argmax(logits, -1) == y))
    np.testing.assert_array_equal(out['predictions'][k][:len(y)], np.argmax(logits, -1))
  np.testing.assert_array_equal(out['count'], [7, 4, 9])


def test_bn_adapt_prior_one_equals_no_adapt_and_prior_zero_uses_batch_stats():
  """N = inf gives p = 1 (the source statistics: no adaptation), N = 0 gives p = 0."""
  module, data, xs, _, variables = setup([8, 8])
  run = lambda adapter: build_test_time(adapter, batch_size=4)(variables, data,
                                                               jax.random.key(0))
  base, prior_one = run(no_adapt(module)), run(bn_adapt(module, 4, float('inf')))
  np.testing.assert_array_equal(prior_one['predictions'], base['predictions'])
  np.testing.assert_allclose(prior_one['loss'], base['loss'], rtol=1e-6)
  # p = 0: each batch of 4 normalised by its own statistics == the train-mode forward.
  batch = jnp.asarray(xs[0][:4])
  expected, _ = models.apply(module, variables, batch, 'batch_stats')
  _, logits = bn_adapt(module, 4, 0.0).step(variables, AdaptBatch(batch, jnp.ones(4)))
  np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-5)
  assert prior_weight(16, 16) == 0.5 and prior_weight(float('inf'), 4) == 1.0


def test_online_over_one_batch_equals_episodic():
  module, data, _, _, variables = setup([4, 3, 4])  # every client fits in one batch of 4
  adapter = tent(module, learning_rate=0.1, predict='after')
  online = build_test_time(adapter, 4, 'online')(variables, data, jax.random.key(0))
  episodic = build_test_time(adapter, 4, 'episodic')(variables, data, jax.random.key(0))
  chex.assert_trees_all_close(online, episodic, **backend_tolerance(1e-6))


def test_vmapped_clients_equal_python_loop_over_clients():
  module, data, _, _, variables = setup([9, 0, 6, 11], pad_to=12)
  adapter = tent(module, learning_rate=0.05)
  run = build_test_time(adapter, 4, 'online')
  together = run(variables, data, jax.random.key(3))
  for k in range(data.num_clients):
    one = build_test_time(adapter, 4, 'online')(variables, data.take([k]), jax.random.key(3))
    for name in ('correct', 'loss', 'count'):
      np.testing.assert_allclose(together[name][k], one[name][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(together['predictions'][k], one['predictions'][0])


def test_episodic_does_not_leak_between_batches():
  """Episodic Tent on a client's 2nd batch equals Tent run on that batch alone."""
  module, data, xs, ys, variables = setup([8])
  adapter = tent(module, learning_rate=0.5, predict='after')
  both = build_test_time(adapter, 4, 'episodic')(variables, data, jax.random.key(0))
  second, _, _ = toy_clients([4], num_classes=NUM_CLASSES)
  second = second._replace(x=data.x[:, 4:8], y=data.y[:, 4:8])
  alone = build_test_time(adapter, 4, 'episodic')(variables, second, jax.random.key(0))
  np.testing.assert_array_equal(both['predictions'][0][4:], alone['predictions'][0])
  # ... while online adaptation does carry state into the second batch.
  online = build_test_time(adapter, 4, 'online')(variables, data, jax.random.key(0))
  assert not np.allclose(online['loss'], both['loss'])


def test_empty_client_and_partial_batches_have_no_nan():
  module, data, _, _, variables = setup([0, 5], pad_to=8)
  out = build_test_time(tent(module), 4, 'online')(variables, data, jax.random.key(0))
  chex.assert_tree_all_finite(out)
  np.testing.assert_array_equal(out['count'], [0, 5])
  np.testing.assert_array_equal(out['predictions'][0], -1)


def test_bn_adapters_reject_models_without_batch_norm():
  module = models.MODELS.get('mlp')(NUM_CLASSES, hidden=(8,))
  variables = models.init(module, jax.random.key(0), jnp.zeros((1, 4, 4, 1)))
  for adapter in (bn_adapt(module, 4), tent(module)):
    with pytest.raises(ValueError, match='needs a model with BatchNorm'):
      adapter.init(variables, jax.random.key(0))


def test_bad_adapter_arguments():
  module = models.MODELS.get('bn_mlp')(NUM_CLASSES)
  with pytest.raises(ValueError, match="unknown adapter 'memo2'"):
    ADAPTERS.get('memo2')
  with pytest.raises(ValueError, match='unknown test-time mode'):
    build_test_time(no_adapt(module), 4, 'sometimes')
  with pytest.raises(ValueError, match='batch_size must be >= 1'):
    build_test_time(no_adapt(module), 0)
  with pytest.raises(ValueError, match='prior_strength must be >= 0'):
    bn_adapt(module, 4, -1.0)
  with pytest.raises(ValueError, match='predict'):
    tent(module, predict='during')


@pytest.mark.parametrize('mode, traces', [('online', 2), ('episodic', 2), ('transductive', 3)])
def test_adapted_evaluation_pads_close_splits_to_one_program_with_unpadded_sums(mode, traces):
  """Splits of 12 and 10 rows (3 batches of 4 each) share one padded shape; a split of 4
  rows (1 batch: padding would triple it) keeps its own. The sums equal each split run
  alone at its own size: padding adds only batches without weight. Transductive runs
  (whose shuffled order depends on the size) are never padded: one program per size."""
  from types import SimpleNamespace
  from fedjax_shift.core.evaluation import AdaptRunner, EvalAdapters, build_evaluate
  from fedjax_shift.core.test_time import client_runner
  module, split_a, _, _, variables = setup([7, 4, 9], pad_to=12)
  split_b = toy_clients([5, 8, 6], num_classes=NUM_CLASSES, seed=1, pad_to=10)[0]
  split_c = toy_clients([3, 4, 2], num_classes=NUM_CLASSES, seed=2, pad_to=4)[0]
  adapter = tent(module, learning_rate=0.1, predict='after')
  adapter = adapter._replace(predict=lambda state, batch: adapter.step(state, batch)[1])
  run_one, shapes = client_runner(adapter, 4, mode), []

  def counted(variables, x, *rest):
    shapes.append(x.shape[0])
    return run_one(variables, x, *rest)

  algorithm = SimpleNamespace(global_model=lambda server_state: server_state, personalize=None)
  evaluate_chunk = build_evaluate(algorithm, module, 4, adapters=EvalAdapters(
      {'tent': AdaptRunner(jax.jit(counted), mode, 4)}, ('a', 'b', 'c')))
  splits = {'a': split_a, 'b': split_b, 'c': split_c, 'other': split_c}   # 'other': not adapted
  ids = jnp.arange(3)
  out = evaluate_chunk(variables, jnp.zeros(3), split_a, splits, ids, jax.random.key(3))
  assert len(shapes) == traces and sorted(out) == ['global', 'global+tent']
  assert sorted(out['global+tent']) == ['a', 'b', 'c']
  assert sorted(set(shapes)) == ([4, 10, 12] if mode == 'transductive' else [4, 12])
  adapt_keys = jax.vmap(jax.random.fold_in, (None, 0))(
      jax.random.fold_in(jax.random.key(3), 1), ids)
  for name, split in ((name, splits[name]) for name in ('a', 'b', 'c')):
    alone = jax.vmap(run_one, (None, 0, 0, 0, 0))(variables, split.x, split.y,
                                                   split.num_examples, adapt_keys)
    chex.assert_trees_all_close(out['global+tent'][name],
                                {k: v for k, v in alone.items() if k != 'predictions'},
                                **backend_tolerance(1e-6))


def test_evaluation_personalises_a_client_once_for_its_plain_and_adapted_models():
  """The personalised model (FedAvg-FT: fine-tuning on the client's train split) is
  computed once per evaluation and serves both the plain and the adapted columns: one
  trace of ``personalize`` in the evaluation program, where a separate adapted program
  traced it a second time."""
  from fedjax_shift.core.evaluation import AdaptRunner, EvalAdapters, build_evaluate
  from fedjax_shift.core.test_time import client_runner
  from helpers import build_method, tiny_config
  config = tiny_config()
  data = toy_clients([6, 5, 7], num_classes=NUM_CLASSES, pad_to=8)[0]
  module, algorithm, server, clients = build_method('fedavg_ft', config, data)
  traces = []

  def personalize(*args):
    traces.append(1)
    return algorithm.personalize(*args)

  counted = algorithm._replace(personalize=personalize)
  runner = AdaptRunner(jax.jit(client_runner(no_adapt(module), 4, 'online')), 'online', 4)
  evaluate_chunk = build_evaluate(counted, module, 4,
                                  adapters=EvalAdapters({'none': runner}, ('test',)))
  out = evaluate_chunk(server, clients, data, {'test': data}, jnp.arange(3), jax.random.key(0))
  assert len(traces) == 1
  # No adaptation scores what the plain model does, on both models.
  for model in ('global', 'personalized'):
    chex.assert_trees_all_close(out[f'{model}+none']['test'], out[model]['test'], rtol=1e-6)
