"""Data the model cannot score never reaches a compiled program silently: the round,
evaluation and test-time adaptation called from Python refuse labels outside
[0, num_classes) and inputs that are not finite, naming the client and the label."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from fedjax_shift import algorithms, models
from fedjax_shift.adapters import ADAPTERS
from fedjax_shift.core import evaluation, test_time
from fedjax_shift.core.round import build_round, round_key, stack_client_states
from fedjax_shift.data import federated, store
from fedjax_shift.pipelines.programs import round_config

SIZES = (6, 4, 5)
NUM_CLASSES = 3


def client_arrays(label=None, value=None):
  """Three clients of 4×4 inputs, labels in [0, 3); client 1's example 2 gets
  ``label`` and client 2's example 0 the input ``value`` when given."""
  rng = np.random.default_rng(0)
  xs = [rng.normal(size=(n, 4, 4, 1)).astype(np.float32) for n in SIZES]
  ys = [rng.integers(0, NUM_CLASSES, n) for n in SIZES]
  if label is not None:
    ys[1][2] = label
  if value is not None:
    xs[2][0, 1, 1, 0] = value
  return xs, ys


def fedavg(backend='vmap'):
  config = default.get_config('tiny')
  config.cohort_size = len(SIZES)
  module = models.bn_mlp(NUM_CLASSES, (8,))   # BatchNorm: Tent adapts it
  algorithm = algorithms.build('fedavg', config, module, max(SIZES))
  train = federated.stack_clients(*client_arrays())
  round_fn = build_round(algorithm, round_config(config, train), backend=backend)[0]
  server = algorithm.init(jax.random.key(0), jnp.zeros((1, 4, 4, 1)))
  return module, algorithm, round_fn, server, stack_client_states(algorithm, server,
                                                                   len(SIZES))


BAD = [(dict(label=7), r'client 1: label 7 outside \[0, 3\)'),
       (dict(label=-1), r'client 1: label -1 outside \[0, 3\)'),
       (dict(value=np.nan), 'client 2: inputs contain NaN or inf'),
       (dict(value=np.inf), 'client 2: inputs contain NaN or inf')]


@pytest.mark.parametrize('backend', ['vmap', 'loop'])
@pytest.mark.parametrize('layout', ['padded', 'store'])
@pytest.mark.parametrize('bad,message', BAD)
def test_the_round_refuses_data_it_cannot_train_on(backend, layout, bad, message):
  # Before, a label of 7 (of 3 classes) trained three rounds to finite parameters, and
  # -1 trained as class 2 (optax reads it from the end).
  _, algorithm, round_fn, server, clients = fedavg(backend)
  assert algorithm.num_classes == NUM_CLASSES
  xs, ys = client_arrays(**bad)
  data = (federated.stack_clients(xs, ys) if layout == 'padded'
          else store.from_clients(xs, ys))
  with pytest.raises(ValueError, match='the data of the round: ' + message):
    round_fn(server, clients, data, round_key(jax.random.key(1), 0))


def test_good_data_is_checked_once_and_each_new_object_again(monkeypatch):
  _, _, round_fn, server, clients = fedavg()
  checked = []
  real = store.validate_split
  monkeypatch.setattr(store, 'validate_split',
                      lambda split, *args, **kw: checked.append(split) or real(split, *args, **kw))
  data = store.from_clients(*client_arrays())
  for r in range(3):
    out = round_fn(server, clients, data, round_key(jax.random.key(1), r))
    server, clients = out.server_state, out.client_states
  assert len(checked) == 1                      # the same store: one check, not three
  on_device = jax.device_put(data)              # new arrays: checked again
  round_fn(server, clients, on_device, round_key(jax.random.key(1), 3))
  assert len(checked) == 2 and checked[1] is on_device


def test_pipelines_check_the_benchmark_not_every_round():
  # The pipelines validate the benchmark once (runs.validate_benchmark); their host
  # cohorts are new arrays every round and go unchecked: the round is built so.
  config = default.get_config('tiny')
  module = models.mlp(NUM_CLASSES, (8,))
  algorithm = algorithms.build('fedavg', config, module, max(SIZES))
  train = federated.stack_clients(*client_arrays(label=7))
  config.cohort_size = len(SIZES)
  round_fn = build_round(algorithm, round_config(config, train), check_data=False)[0]
  server = algorithm.init(jax.random.key(0), jnp.zeros((1, 4, 4, 1)))
  round_fn(server, stack_client_states(algorithm, server, 3), train,
           round_key(jax.random.key(1), 0))   # no check: runs


@pytest.mark.parametrize('bad,message', BAD)
def test_split_metrics_refuses_unscorable_data_and_traced_it_is_nan(bad, message):
  module, algorithm, _, server, _ = fedavg()
  variables = algorithm.global_model(server)
  xs, ys = client_arrays(**bad)
  split = federated.stack_clients(xs, ys)
  k = int(message.split()[1].rstrip(':'))
  args = (split.x[k], split.y[k], split.mask[k])
  with pytest.raises(ValueError, match='split_metrics: ' + message.split(': ', 1)[1]):
    evaluation.split_metrics(module, variables, *args, 4)
  traced = jax.jit(lambda *a: evaluation.split_metrics(module, variables, *a, 4))(*args)
  # An out-of-range label makes 'correct' NaN (not a score of another class); a
  # non-finite input makes the logits, and so the loss, NaN.
  assert np.isnan(float(traced['loss']))
  if 'label' in bad:
    assert np.isnan(float(traced['correct']))
  good = evaluation.split_metrics(module, variables, *(a[0] for a in (split.x, split.y,
                                                                       split.mask)), 4)
  assert np.isfinite(float(good['correct'])) and float(good['count']) == SIZES[0]


@pytest.mark.parametrize('bad,message', BAD)
def test_a_test_time_run_refuses_unscorable_data(bad, message):
  module, algorithm, _, server, _ = fedavg()
  variables = algorithm.global_model(server)
  config = default.get_config('tiny')
  context = test_time.SourceContext(variables, num_classes=NUM_CLASSES, batch_size=2)
  adapter = ADAPTERS.get('tent')(module, config.adapters.tent, context)
  run = test_time.build_test_time(adapter, batch_size=2, mode='online')
  with pytest.raises(ValueError, match='the data of the test-time run: ' + message):
    run(variables, federated.stack_clients(*client_arrays(**bad)), jax.random.key(2))
  out = run(variables, federated.stack_clients(*client_arrays()), jax.random.key(2))
  np.testing.assert_array_equal(out['count'], SIZES)
