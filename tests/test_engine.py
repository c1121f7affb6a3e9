"""The compiled round against slow, obviously-correct references."""
import chex
import jax
import ml_collections
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_shift import algorithms, models
from fedjax_shift.algorithms import ALGORITHMS
from fedjax_shift.core import algorithm as alg
from fedjax_shift.core import local
from fedjax_shift.core.round import (HostStore, RoundConfig, aggregation_weights, build_round,
                                     round_key, sample_cohort, stack_client_states)
from fedjax_shift.data.federated import FederatedData
from helpers import backend_tolerance, build_method, compiled_programs, tiny_config, toy_clients

NUM_CLASSES = 3


def make(name, config, data):
  return build_method(name, config, data, NUM_CLASSES)


def test_toy_algorithm_from_docstring():
  def client_update(server, client_state, data, rng):
    mean = jnp.sum(data.x * data.mask) / jnp.maximum(data.num_examples, 1)
    return alg.ClientOutput(mean - server, {'loss': jnp.float32(0)}), client_state

  toy = alg.FederatedAlgorithm(
      init=lambda rng, x: jnp.float32(0.), init_client_state=lambda s: (),
      client_update=client_update,
      server_update=lambda s, out, w: s + jnp.sum(w * out.update),
      personalize=None, global_model=lambda s: s)
  data = FederatedData(np.array([[1., 1.], [4., 0.]], np.float32), np.zeros((2, 2), np.int32),
                       np.array([[True, True], [True, False]]), np.array([2, 1], np.int32))
  _, round_host = build_round(toy, RoundConfig(cohort_size=2))
  out = round_host(jnp.float32(0.), (), data, jnp.array([0, 1]), jax.random.key(0))
  # Example-weighted mean of the client means: (2·1 + 1·4) / 3 = 2.
  np.testing.assert_allclose(out.server_state, 2.0, rtol=1e-6)


def reference_fedavg_round(module, config, variables, data, cohort_ids, key):
  """A Python loop over clients and batches, written independently of the engine's
  scan: same batch order (example_order), plain SGD, example-weighted average."""
  lr, batch = config.client.learning_rate, config.client.batch_size
  new_models, counts = [], []
  client_key = jax.random.fold_in(key, 1)
  for k in np.asarray(cohort_ids):
    n = int(data.num_examples[k])
    rng = jax.random.fold_in(client_key, int(k))
    order = np.asarray(local.example_order(jax.random.fold_in(rng, 0),
                                           jnp.asarray(data.mask[k])))
    params = variables['params']
    num_steps = -(-config.client.local_epochs * n // batch)
    for step in range(num_steps):
      positions = step * batch + np.arange(batch)
      idx = order[positions % n]
      weight = (positions < config.client.local_epochs * n).astype(np.float32)
      x, y = data.x[k][idx], data.y[k][idx]

      def loss_fn(p):
        logits = module.apply({'params': p}, x)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return jnp.sum(ce * weight) / jnp.sum(weight)

      grads = jax.grad(loss_fn)(params)
      params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    new_models.append(params)
    counts.append(n)
  weights = np.array(counts, np.float32) / sum(counts)
  return jax.tree.map(lambda *ps: sum(w * p for w, p in zip(weights, ps)), *new_models)


def test_fedavg_round_equals_loop_reference():
  config = tiny_config(**{'client.batch_size': 4, 'client.local_epochs': 2,
                          'client.learning_rate': 0.1})
  data, _, _ = toy_clients([7, 3, 10, 5], num_classes=NUM_CLASSES)
  module, fedavg, server, clients = make('fedavg', config, data)
  round_device, _ = build_round(fedavg, RoundConfig(cohort_size=3))
  key = round_key(jax.random.key(1), 0)
  out = round_device(server, clients, data, key)
  expected = reference_fedavg_round(module, config, server.variables, data,
                                    out.metrics['cohort'], key)
  chex.assert_trees_all_close(out.server_state.variables['params'], expected, atol=1e-5)


def test_a_methods_client_override_replaces_the_shared_rate(tmp_path):
  """config.client_overrides.fedavg.learning_rate = 0.1 with client.learning_rate = 0.02
  gives the loop reference's round at 0.1; a method it does not name keeps the shared
  rate; a negative override is refused, naming it."""
  from fedjax_shift import config as config_lib
  config = tiny_config(**{'client.batch_size': 4, 'client.local_epochs': 1,
                          'client.learning_rate': 0.02,
                          'client_overrides': {'fedavg': {'learning_rate': 0.1}}})
  data, _, _ = toy_clients([7, 3, 10], num_classes=NUM_CLASSES)
  module, fedavg, server, clients = make('fedavg', config, data)
  key = round_key(jax.random.key(1), 0)
  out = build_round(fedavg, RoundConfig(cohort_size=3))[0](server, clients, data, key)
  reference = tiny_config(**{'client.batch_size': 4, 'client.local_epochs': 1,
                             'client.learning_rate': 0.1})
  expected = reference_fedavg_round(module, reference, server.variables, data,
                                    out.metrics['cohort'], key)
  chex.assert_trees_all_close(out.server_state.variables['params'], expected, atol=1e-5)
  assert algorithms.base.method_client(config, 'fedprox').learning_rate == 0.02
  assert algorithms.base.method_client(config, 'fedavg').batch_size == 4
  config.client_overrides.fedavg.learning_rate = -0.1
  with pytest.raises(ValueError, match=r'client_overrides.fedavg.learning_rate: must be > 0'):
    config_lib.validate(config, str(tmp_path))


def test_fedprox_mu_zero_equals_fedavg():
  # Batch 2 so clients take several steps (the proximal gradient is 0 at step 1).
  config = tiny_config(**{'fedprox.mu': 0.0, 'client.batch_size': 2})
  data, _, _ = toy_clients([6, 9, 4], num_classes=NUM_CLASSES)
  _, fedavg, server, clients = make('fedavg', config, data)
  _, fedprox, _, _ = make('fedprox', config, data)
  key = jax.random.key(3)
  a = build_round(fedavg, RoundConfig(cohort_size=3))[0](server, clients, data, key)
  b = build_round(fedprox, RoundConfig(cohort_size=3))[0](server, clients, data, key)
  chex.assert_trees_all_equal(a.server_state.variables, b.server_state.variables)
  # and μ > 0 does change the result (the term is really applied)
  config.fedprox.mu = 1.0
  _, fedprox1, _, _ = make('fedprox', config, data)
  c = build_round(fedprox1, RoundConfig(cohort_size=3))[0](server, clients, data, key)
  assert not np.allclose(c.server_state.variables['params']['head']['kernel'],
                         a.server_state.variables['params']['head']['kernel'])


def test_qffl_q_zero_equals_uniform_fedavg_and_q_one_matches_formula():
  """q = 0: Δ_k = L·Δw_k, h_k = L, so the step is the uniform mean of the client
  deltas (FedAvg with uniform weights). q = 1: w − Σ F_k Δw_k / Σ (‖Δw_k‖² + L F_k),
  computed here from FedAvg's per-client models and F_k."""
  config = tiny_config(**{'client.batch_size': 2, 'qffl.q': 0.0})
  data, _, _ = toy_clients([6, 9, 4], num_classes=NUM_CLASSES)
  round_config = RoundConfig(cohort_size=3, weighting='uniform')
  module, fedavg, server, clients = make('fedavg', config, data)
  _, qffl0, _, _ = make('qffl', config, data)
  key = jax.random.key(3)
  a = build_round(fedavg, round_config)[0](server, clients, data, key)
  b = build_round(qffl0, round_config)[0](server, clients, data, key)
  chex.assert_trees_all_close(a.server_state.variables, b.server_state.variables,
                              rtol=1e-5, atol=1e-6)
  config.qffl.q = 1.0
  _, qffl1, _, _ = make('qffl', config, data)
  c = build_round(qffl1, round_config)[0](server, clients, data, key)
  from fedjax_shift.algorithms.qffl import client_loss
  from fedjax_shift.core.algorithm import ClientData
  lipschitz = 1.0 / config.client.learning_rate
  client_key = jax.random.fold_in(key, 1)
  params = server.variables['params']
  num, den = jax.tree.map(jnp.zeros_like, params), 0.0
  for k in range(3):
    one = ClientData(*(jnp.asarray(a[k]) for a in (data.x, data.y, data.mask,
                                                   data.num_examples)), jnp.int32(10 ** 6))
    out, _ = fedavg.client_update(server, (), one, jax.random.fold_in(client_key, k))
    delta_w = jax.tree.map(lambda d: -lipschitz * d, out.update['params'])
    loss = client_loss(module, server.variables, one) + 1e-10
    num = jax.tree.map(lambda s, d: s + loss * d, num, delta_w)
    den += sum(float(jnp.sum(d ** 2)) for d in jax.tree.leaves(delta_w)) + lipschitz * loss
  expected = jax.tree.map(lambda p, s: p - s / den, params, num)
  chex.assert_trees_all_close(c.server_state.variables['params'], expected, rtol=1e-4,
                              atol=1e-6)


# Every registered method that trains on ordinary client data (the evolving ones need
# domain blocks; tests/test_evolving.py covers them).
@pytest.mark.parametrize('name', [n for n in ALGORITHMS.names()
                                  if ALGORITHMS.meta(n).get('layout') != 'domains'])
def test_padding_does_not_change_update(name):
  # BatchNorm where the method supports it (a method registered with batch_norm=False
  # does not). The methods that need a ViT (FedIns) get a one-block ViT on 4×4×3 inputs.
  model = 'bn_mlp' if ALGORITHMS.meta(name).get('batch_norm', True) else 'mlp'
  config = tiny_config(**{'model.name': model, 'client.batch_size': 3})
  shape = (4, 4, 1)
  if ALGORITHMS.meta(name).get('models'):
    config.model = ml_collections.ConfigDict({'name': 'vit', 'patch_size': 2, 'width': 8,
                                              'depth': 1, 'heads': 2, 'mlp_dim': 8})
    shape = (4, 4, 3)
  tight, _, _ = toy_clients([5, 8], shape=shape, num_classes=NUM_CLASSES)
  padded, _, _ = toy_clients([5, 8], shape=shape, num_classes=NUM_CLASSES, pad_to=20)
  _, algorithm, server, clients = make(name, config, tight)
  _, algorithm_padded, _, _ = make(name, config, padded)
  ids = jnp.array([0, 1])
  key = jax.random.key(5)
  a = build_round(algorithm, RoundConfig(cohort_size=2))[1](server, clients, tight, ids, key)
  b = build_round(algorithm_padded, RoundConfig(cohort_size=2))[1](server, clients, padded,
                                                                   ids, key)
  chex.assert_trees_all_close(a.server_state, b.server_state, atol=1e-6)
  chex.assert_trees_all_close(a.client_states, b.client_states, atol=1e-6)


def test_empty_client_gets_zero_weight_and_no_nan():
  config = tiny_config()
  data, _, _ = toy_clients([6, 0, 4], num_classes=NUM_CLASSES)
  _, fedavg, server, clients = make('fedavg', config, data)
  with pytest.raises(ValueError, match='cohort_size=2'):
    build_round(fedavg, RoundConfig(cohort_size=2))[1](server, clients, data,
                                                       jnp.array([0, 1, 2]), jax.random.key(0))
  with_empty = build_round(fedavg, RoundConfig(cohort_size=3))[1](
      server, clients, data, jnp.array([0, 1, 2]), jax.random.key(0))
  chex.assert_tree_all_finite(with_empty.server_state)
  np.testing.assert_allclose(aggregation_weights(jnp.array([6, 0, 4]), 'num_examples'),
                             [0.6, 0.0, 0.4])
  np.testing.assert_allclose(aggregation_weights(jnp.array([6, 0, 4]), 'uniform'),
                             [0.5, 0.0, 0.5])
  # Only-empty cohort: weights all zero, server unchanged, nothing NaN.
  only_empty = build_round(fedavg, RoundConfig(cohort_size=1))[1](
      server, clients, data.take([1]), jnp.array([1]), jax.random.key(0))
  chex.assert_trees_all_close(only_empty.server_state.variables, server.variables)
  assert float(only_empty.metrics['loss']) == 0.0


def test_round_compiles_once_for_a_whole_run():
  config = tiny_config()
  data, _, _ = toy_clients([6, 9, 4, 7], num_classes=NUM_CLASSES)
  _, fedavg, server, clients = make('fedavg', config, data)
  round_device, _ = build_round(fedavg, RoundConfig(cohort_size=2))
  for r in range(4):
    out = round_device(server, clients, data, round_key(jax.random.key(0), r))
    server, clients = out.server_state, out.client_states
  assert compiled_programs(round_device) == 1


def test_stragglers_run_at_most_tau_steps():
  config = tiny_config(**{'client.batch_size': 2, 'client.local_epochs': 3})
  data, _, _ = toy_clients([10, 10, 10, 10], num_classes=NUM_CLASSES)
  _, fedavg, server, clients = make('fedavg', config, data)
  ids = jnp.arange(4)
  full = build_round(fedavg, RoundConfig(cohort_size=4))[1](server, clients, data, ids,
                                                             jax.random.key(0))
  np.testing.assert_allclose(full.metrics['num_steps'], 15.0)  # ceil(3·10/2)
  strag = build_round(fedavg, RoundConfig(cohort_size=4, straggler_prob=1.0,
                                          straggler_max_steps=2))[1](
      server, clients, data, ids, jax.random.key(0))
  assert 1.0 <= float(strag.metrics['num_steps']) <= 2.0


def test_straggler_with_one_step_equals_tau_one_client():
  """A straggler budget of 1 step == a client configured with exactly 1 local step."""
  config = tiny_config(**{'client.batch_size': 4})
  data, _, _ = toy_clients([8, 8], num_classes=NUM_CLASSES)
  _, fedavg, server, clients = make('fedavg', config, data)
  ids = jnp.arange(2)
  strag = build_round(fedavg, RoundConfig(cohort_size=2, straggler_prob=1.0,
                                          straggler_max_steps=1))[1](
      server, clients, data, ids, jax.random.key(0))
  one_step_config = tiny_config(**{'client.batch_size': 4, 'client.local_steps': 1})
  _, one_step, _, _ = make('fedavg', one_step_config, data)
  ref = build_round(one_step, RoundConfig(cohort_size=2))[1](server, clients, data, ids,
                                                             jax.random.key(0))
  chex.assert_trees_all_close(strag.server_state.variables, ref.server_state.variables,
                              atol=1e-6)


def test_host_store_matches_device_store():
  config = tiny_config()
  data, _, _ = toy_clients([6, 9, 4, 7, 3], num_classes=NUM_CLASSES)
  _, fedavg, server, clients = make('fedavg', config, data)
  round_config = RoundConfig(cohort_size=2)
  round_device, round_host = build_round(fedavg, round_config)
  seed_key = jax.random.key(7)
  store = HostStore(data, seed_key, round_config)
  s_dev, c_dev, s_host, c_host = server, clients, server, clients
  for r in range(3):
    key = round_key(seed_key, r)
    a = round_device(s_dev, c_dev, data, key)
    cohort, ids = store.cohort(r)
    b = round_host(s_host, c_host, cohort, ids, key)
    np.testing.assert_array_equal(a.metrics['cohort'], ids)
    s_dev, c_dev, s_host, c_host = a.server_state, a.client_states, b.server_state, b.client_states
  store.close()
  chex.assert_trees_all_close(s_dev, s_host, atol=1e-6)


def test_sampling_without_replacement_and_by_size():
  num_examples = jnp.array([0, 5, 0, 10, 3, 0])
  for r in range(20):
    ids = np.asarray(sample_cohort(jax.random.key(r), num_examples,
                                   RoundConfig(cohort_size=3, sampling='num_examples')))
    assert len(set(ids.tolist())) == 3
    assert set(ids.tolist()) == {1, 3, 4}  # only clients with data can be drawn
  ids = np.asarray(sample_cohort(jax.random.key(0), num_examples, RoundConfig(cohort_size=6)))
  assert sorted(ids.tolist()) == list(range(6))


def test_local_keeps_per_client_models():
  config = tiny_config()
  data, _, _ = toy_clients([6, 9, 4], num_classes=NUM_CLASSES)
  _, local_alg, server, clients = make('local', config, data)
  out = build_round(local_alg, RoundConfig(cohort_size=1))[1](
      server, clients, data.take([1]), jnp.array([1]), jax.random.key(0))
  params = out.client_states[0]['params']['head']['kernel']
  # Only client 1 trained; clients 0 and 2 still hold the initial model.
  np.testing.assert_array_equal(params[0], params[2])
  assert not np.allclose(params[1], params[0])
  chex.assert_trees_all_equal(out.server_state.variables, server.variables)


def test_fedbn_keeps_batch_norm_local():
  config = tiny_config(**{'model.name': 'bn_mlp'})
  data, _, _ = toy_clients([6, 9, 4], num_classes=NUM_CLASSES)
  _, fedbn, server, clients = make('fedbn', config, data)
  out = build_round(fedbn, RoundConfig(cohort_size=2))[1](
      server, clients, data.take([0, 2]), jnp.array([0, 2]), jax.random.key(0))
  # Server BN stays at its init; shared Dense layers moved.
  chex.assert_trees_all_equal(out.server_state.variables['batch_stats'],
                              server.variables['batch_stats'])
  assert not np.allclose(out.server_state.variables['params']['head']['kernel'],
                         server.variables['params']['head']['kernel'])
  bn_mean = [v for k, v in out.client_states.items() if k[0] == 'batch_stats'][0]
  assert not np.allclose(bn_mean[0], bn_mean[2])      # trained clients differ
  np.testing.assert_array_equal(bn_mean[1], np.asarray(  # client 1 untouched
      [v for k, v in clients.items() if k[0] == 'batch_stats'][0][1]))


def test_chunked_cohort_equals_vmapped_cohort():
  config = tiny_config(**{'model.name': 'bn_mlp'})
  data, _, _ = toy_clients([6, 9, 4, 7], num_classes=NUM_CLASSES)
  _, fedbn, server, clients = make('fedbn', config, data)
  ids = jnp.arange(4)
  whole = build_round(fedbn, RoundConfig(cohort_size=4))[1](server, clients, data, ids,
                                                             jax.random.key(0))
  chunked = build_round(fedbn, RoundConfig(cohort_size=4, client_chunk=2))[1](
      server, clients, data, ids, jax.random.key(0))
  chex.assert_trees_all_close(whole.server_state, chunked.server_state, atol=1e-6)
  chex.assert_trees_all_close(whole.client_states, chunked.client_states, atol=1e-6)


def test_fedadam_first_round_closed_form():
  """Adam's first step with bias correction is u = −lr·g/(|g| + ε) per coordinate, and
  the server's pseudo-gradient is g = −Δ̄ (the weighted mean client delta), so the
  new global model is w + lr·Δ̄/(|Δ̄| + ε)."""
  config = tiny_config(**{'server.optimizer': 'fedadam', 'server.learning_rate': 0.01})
  data, _, _ = toy_clients([6, 9, 4], num_classes=NUM_CLASSES)
  _, fedadam, server, clients = make('fedavg', config, data)
  plain_config = tiny_config()
  _, fedavg, _, _ = make('fedavg', plain_config, data)
  ids, key = jnp.arange(3), jax.random.key(0)
  plain = build_round(fedavg, RoundConfig(cohort_size=3))[1](server, clients, data, ids, key)
  adam = build_round(fedadam, RoundConfig(cohort_size=3))[1](server, clients, data, ids, key)
  delta = jax.tree.map(jnp.subtract, plain.server_state.variables['params'],
                       server.variables['params'])
  expected = jax.tree.map(lambda w, d: w + 0.01 * d / (jnp.abs(d) + 1e-3),
                          server.variables['params'], delta)
  chex.assert_trees_all_close(adam.server_state.variables['params'], expected, atol=1e-6)


def test_fedavgm_second_round_uses_momentum():
  """Round 1 of FedAvgM (lr 1, β) equals FedAvg; round 2 adds β·(round-1 step)."""
  config = tiny_config(**{'server.optimizer': 'fedavgm', 'server.momentum': 0.5})
  data, _, _ = toy_clients([6, 9, 4], num_classes=NUM_CLASSES)
  _, fedavgm, server, clients = make('fedavg', config, data)
  _, fedavg, _, _ = make('fedavg', tiny_config(), data)
  ids = jnp.arange(3)
  m_round, p_round = (build_round(a, RoundConfig(cohort_size=3))[1] for a in (fedavgm, fedavg))
  m1 = m_round(server, clients, data, ids, jax.random.key(0))
  p1 = p_round(server, clients, data, ids, jax.random.key(0))
  chex.assert_trees_all_close(m1.server_state.variables, p1.server_state.variables, atol=1e-6)
  step1 = jax.tree.map(jnp.subtract, m1.server_state.variables['params'],
                       server.variables['params'])
  m2 = m_round(m1.server_state, clients, data, ids, jax.random.key(1))
  p2 = p_round(m1.server_state._replace(opt_state=p1.server_state.opt_state), clients, data,
               ids, jax.random.key(1))
  expected = jax.tree.map(lambda p, s: p + 0.5 * s, p2.server_state.variables['params'], step1)
  chex.assert_trees_all_close(m2.server_state.variables['params'], expected, atol=1e-5)


@pytest.mark.parametrize('name', ['fedavg', 'fedbn', 'local'])
def test_loop_backend_equals_compiled_round(name):
  config = tiny_config(**{'model.name': 'bn_mlp', 'client.batch_size': 3})
  data, _, _ = toy_clients([6, 9, 0, 7, 5], num_classes=NUM_CLASSES)
  _, algorithm, server, clients = make(name, config, data)
  round_config = RoundConfig(cohort_size=3, straggler_prob=0.5, straggler_max_steps=2)
  fast, _ = build_round(algorithm, round_config)
  slow, _ = build_round(algorithm, round_config, backend='loop')
  a_server, a_clients, b_server, b_clients = server, clients, server, clients
  for r in range(2):
    key = round_key(jax.random.key(4), r)
    a, b = fast(a_server, a_clients, data, key), slow(b_server, b_clients, data, key)
    np.testing.assert_array_equal(a.metrics['cohort'], b.metrics['cohort'])
    a_server, a_clients, b_server, b_clients = (a.server_state, a.client_states,
                                                b.server_state, b.client_states)
  chex.assert_trees_all_close(a_server, b_server, **backend_tolerance(1e-6, 1e-5))
  chex.assert_trees_all_close(a_clients, b_clients, **backend_tolerance(1e-6, 1e-5))


def test_loop_backend_names_failing_client():
  def client_update(server, client_state, data, rng):
    jax.debug.callback(lambda n: (_ for _ in ()).throw(ValueError('boom')) if n == 3 else None,
                       data.num_examples)
    return alg.ClientOutput(server, {}), client_state

  toy = alg.FederatedAlgorithm(lambda r, x: jnp.float32(0.), lambda s: (), client_update,
                               lambda s, o, w: s, None, lambda s: s)
  data = FederatedData(np.zeros((2, 4), np.float32), np.zeros((2, 4), np.int32),
                       np.array([[1, 1, 0, 0], [1, 1, 1, 0]], bool), np.array([2, 3], np.int32))
  _, round_host = build_round(toy, RoundConfig(cohort_size=2), backend='loop')
  with pytest.raises(RuntimeError, match='client 7'):
    jax.block_until_ready(round_host(jnp.float32(0.), (), data, jnp.array([5, 7]),
                                     jax.random.key(0)))


def test_fedavg_ft_personalises_by_local_fine_tuning():
  """FedAvg-FT's personalised model is the global model after `fedavg_ft.epochs` of local
  SGD on the client's own data: it moves away from the global model and fits that
  client's data better (lower loss) than the global model does."""
  config = tiny_config(**{'fedavg_ft.epochs': 5, 'client.learning_rate': 0.5,
                          'client.batch_size': 4})
  data, xs, ys = toy_clients([12, 12], num_classes=NUM_CLASSES)
  module, fedavg_ft, server, clients = make('fedavg_ft', config, data)
  client = alg.ClientData(jnp.asarray(data.x[0]), jnp.asarray(data.y[0]),
                          jnp.asarray(data.mask[0]), jnp.int32(12), jnp.int32(2 ** 30))
  personal = fedavg_ft.personalize(server, (), client, jax.random.key(0))

  def loss(variables):
    logits, _ = models.apply(module, variables, jnp.asarray(xs[0]))
    return float(optax.softmax_cross_entropy_with_integer_labels(logits, ys[0]).mean())

  assert loss(personal) < loss(server.variables) - 0.05
  assert fedavg_ft.global_model(server) is server.variables


# FedBN with patches runs by default (BatchNorm statistics and the vmapped matmul);
# the other three pairs only with --runslow: tests/test_models.py checks both
# implementations against lax for every model, values and gradients.
@pytest.mark.parametrize('name,impl', [
    ('fedbn', 'patches'),
    pytest.param('fedbn', 'lax_patch_grad', marks=pytest.mark.slow),
    pytest.param('fedavg', 'patches', marks=pytest.mark.slow),
    pytest.param('fedavg', 'lax_patch_grad', marks=pytest.mark.slow)])
def test_round_with_patch_convolutions_equals_the_grouped_convolution_round(name, impl):
  """The compiled round vmapped over clients with 'patches' convolutions (batched
  matmuls), or lax convolutions whose kernel gradient is a patch matmul
  ('lax_patch_grad'), equals the same round with lax convolutions (grouped under
  vmap), local steps in a rolled scan: to 1e-7
  relative in float64 (float32 epsilon is 1.2e-7; in float32, BatchNorm over batches
  of 3 amplifies the different order of the same sums to ~1e-4 after a round).
  The lax reference runs on the CPU: on an H100 the vmapped (grouped) float64 lax
  convolution's round is 0.12 relative off the CPU's on a Conv_2 kernel entry of the
  fedbn case, while one unvmapped gradient agrees to 2e-8 and the patches round equals
  the CPU's to 5e-7."""
  shape = (20, 20, 3) if name == 'fedbn' else (8, 8, 3)
  data, _, _ = toy_clients([6, 9, 4, 7], shape=shape, num_classes=NUM_CLASSES)
  outputs = []
  with jax.enable_x64(True):
    data = data._replace(x=data.x.astype(np.float64))
    for conv, device in (('lax', jax.devices('cpu')[0]), (impl, jax.devices()[0])):
      config = tiny_config(**{'client.batch_size': 3})
      config.model = ml_collections.ConfigDict({'name': 'atp_cnn' if name == 'fedbn' else
                                                'evolve_cnn', 'conv': conv})
      _, algorithm, server, _ = make(name, config, data)
      server = jax.tree.map(lambda a: a.astype(jnp.float64) if jnp.issubdtype(
          a.dtype, jnp.floating) else a, server)
      clients = stack_client_states(algorithm, server, data.num_clients)
      inputs = jax.device_put((server, clients, data, round_key(jax.random.key(0), 0)),
                              device)
      outputs.append(jax.device_get(
          build_round(algorithm, RoundConfig(cohort_size=3))[0](*inputs)))
  chex.assert_trees_all_close(outputs[1].server_state, outputs[0].server_state, rtol=1e-7,
                              atol=1e-10)
  chex.assert_trees_all_close(outputs[1].client_states, outputs[0].client_states, rtol=1e-7,
                              atol=1e-10)


def test_auto_backend_picks_the_loop_for_conv_models_on_cpu():
  from fedjax_shift.pipelines.run_config import round_backend
  on_cpu = jax.default_backend() == 'cpu'
  assert round_backend(tiny_config(**{'model.name': 'atp_cnn'})) == ('loop' if on_cpu else
                                                                    'vmap')
  assert round_backend(tiny_config(**{'model.name': 'mlp'})) == 'vmap'
  assert round_backend(tiny_config(**{'model.name': 'atp_cnn', 'engine.num_devices': 1})) == \
      'vmap'
  assert round_backend(tiny_config(**{'model.name': 'mlp', 'engine.backend': 'loop'})) == 'loop'


def test_auto_eval_chunk_follows_the_backend_and_gives_the_same_sums():
  """engine.eval_chunk_size=0 evaluates one client per call where the round is the loop
  backend (no grouped convolutions on XLA:CPU), 64 elsewhere; a chunk of 1 and a chunk of
  all clients give each client the same sums (clients are independent)."""
  from fedjax_shift.core import evaluation
  from fedjax_shift.pipelines.run_config import EVAL_CHUNK_SIZE, eval_chunk_size
  assert eval_chunk_size(tiny_config(**{'model.name': 'mlp', 'engine.backend': 'loop'})) == 1
  assert eval_chunk_size(tiny_config(**{'model.name': 'mlp'})) == EVAL_CHUNK_SIZE == 64
  assert eval_chunk_size(tiny_config(**{'model.name': 'mlp', 'engine.backend': 'loop',
                                        'engine.eval_chunk_size': 5})) == 5
  config = tiny_config()
  data, _, _ = toy_clients([5, 3, 7], pad_to=8)
  _, algorithm, server, clients = build_method('fedavg_ft', config, data)
  module = models.create(config.model, 3)
  evaluate_chunk = evaluation.build_evaluate(algorithm, module, batch_size=4)
  sums = [evaluation.evaluate_models(evaluate_chunk, server, clients, data, {'test': data},
                                     jax.random.key(1), chunk)
          for chunk in (1, 3)]
  chex.assert_trees_all_close(sums[0], sums[1], rtol=1e-6)
