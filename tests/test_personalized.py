"""Personalised-FL baselines against the special cases their papers name."""
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_shift import models
from fedjax_shift import algorithms
from fedjax_shift.core.algorithm import ClientData
from fedjax_shift.core.round import RoundConfig, build_round, stack_client_states
from helpers import tiny_config, toy_clients

NUM_CLASSES = 3


def make(name, config, data):
  module = models.create(config.model, NUM_CLASSES)
  algorithm = algorithms.build(name, config, module, data.max_examples)
  server = algorithm.init(jax.random.key(0), jnp.asarray(data.x[0, :1]))
  return algorithm, server, stack_client_states(algorithm, server, data.num_clients)


def assert_round_equals_fedavg(name, config, data, key, rtol=1e-6, atol=0.0):
  """One compiled round of ``name`` leaves the global model where FedAvg's does;
  returns (the method, its round output)."""
  algorithm, server, states = make(name, config, data)
  fedavg, _, fedavg_states = make('fedavg', config, data)
  cohort = RoundConfig(cohort_size=data.num_clients)
  out = build_round(algorithm, cohort)[0](server, states, data, key)
  expected = build_round(fedavg, cohort)[0](server, fedavg_states, data, key)
  chex.assert_trees_all_close(out.server_state.variables, expected.server_state.variables,
                              rtol=rtol, atol=atol)
  return algorithm, out


def test_ditto_with_lambda_zero_personal_model_is_local_training():
  config = tiny_config(**{'ditto.lam': 0.0, 'client.batch_size': 3})
  data, _, _ = toy_clients([6, 9], num_classes=NUM_CLASSES)
  ditto, server, clients = make('ditto', config, data)
  local, _, local_clients = make('local', config, data)
  one = lambda d, k: ClientData(*(jnp.asarray(a[k]) for a in d), jnp.int32(10 ** 6))
  for k in range(2):
    state_k = jax.tree.map(lambda a: a[k], clients)
    _, personal = ditto.client_update(server, state_k, one(data, k), jax.random.key(k))
    _, local_state = local.client_update(server, jax.tree.map(lambda a: a[k], local_clients),
                                         one(data, k), jax.random.fold_in(jax.random.key(k), 1))
    chex.assert_trees_all_close(personal[0], local_state[0], rtol=1e-6)
  # λ > 0 pulls the personal model toward the global one: a different result.
  config.ditto.lam = 10.0
  ditto10, _, _ = make('ditto', config, data)
  _, pulled = ditto10.client_update(server, jax.tree.map(lambda a: a[0], clients), one(data, 0),
                                    jax.random.key(0))
  _, free = ditto.client_update(server, jax.tree.map(lambda a: a[0], clients), one(data, 0),
                                jax.random.key(0))
  assert not np.allclose(pulled[0]['params']['head']['kernel'], free[0]['params']['head']['kernel'])


def test_fedrep_with_frozen_encoder_trains_only_heads():
  config = tiny_config(**{'client.local_epochs': 0, 'fedrep.head_epochs': 2,
                          'client.local_steps': 0})
  data, _, _ = toy_clients([6, 9, 4], num_classes=NUM_CLASSES)
  fedrep, server, heads = make('fedrep', config, data)
  out = build_round(fedrep, RoundConfig(cohort_size=3))[0](server, heads, data, jax.random.key(1))
  chex.assert_trees_all_equal(out.server_state.variables['params'],
                              server.variables['params'])
  for k in range(3):
    assert not np.allclose(out.client_states['kernel'][k], heads['kernel'][k])
  # With encoder epochs the representation moves and the server averages it.
  config.client.local_epochs = 1
  fedrep1, _, _ = make('fedrep', config, data)
  moved = build_round(fedrep1, RoundConfig(cohort_size=3))[0](server, heads, data,
                                                              jax.random.key(1))
  assert not np.allclose(moved.server_state.variables['params']['encoder']['Dense_0']['kernel'],
                         server.variables['params']['encoder']['Dense_0']['kernel'])
  chex.assert_trees_all_equal(moved.server_state.variables['params']['head'],
                              server.variables['params']['head'])


def test_apfl_with_mixing_weight_zero_equals_fedavg():
  config = tiny_config(**{'apfl.alpha': 0.0, 'client.batch_size': 3})
  data, _, _ = toy_clients([6, 9, 4], num_classes=NUM_CLASSES)
  apfl, a = assert_round_equals_fedavg('apfl', config, data, jax.random.key(2))
  variables = apfl.personalize(a.server_state, jax.tree.map(lambda x: x[0], a.client_states),
                               None, None)
  chex.assert_trees_all_close(variables, a.server_state.variables)
  with pytest.raises(ValueError, match='config.apfl.alpha'):
    config.apfl.alpha = 1.5
    make('apfl', config, data)


def test_gma_mask_and_threshold_zero_equals_fedavg():
  from fedjax_shift.algorithms.gma import agreement_mask
  deltas = {'w': jnp.array([[1.0, 1.0, -1.0], [1.0, -1.0, -1.0], [1.0, 1.0, 0.0]])}
  mask = agreement_mask(deltas, jnp.array([0.5, 0.5, 0.0]), 0.6)  # third client excluded
  # agreements |Σ sign| / 2 = [1, 0, 1]: below τ the mask is the agreement itself.
  np.testing.assert_allclose(mask['w'], [1.0, 0.0, 1.0])
  config = tiny_config(**{'gma.threshold': 0.0})
  data, _, _ = toy_clients([6, 9, 4], num_classes=NUM_CLASSES)
  assert_round_equals_fedavg('gma', config, data, jax.random.key(4))


def test_gma_global_rate_scales_the_masked_step():
  """With τ = 0 the mask is 1 everywhere, so η_g scales FedAvg's averaged update:
  w' = w + η_g · Σ_k p_k Δ_k (server SGD at rate 1), here η_g = 1.5."""
  config = tiny_config(**{'gma.threshold': 0.0, 'gma.global_learning_rate': 1.5})
  data, _, _ = toy_clients([6, 9, 4], num_classes=NUM_CLASSES)
  gma, server, states = make('gma', config, data)
  fedavg, _, fedavg_states = make('fedavg', config, data)
  cohort = RoundConfig(cohort_size=data.num_clients)
  key = jax.random.key(4)
  out = build_round(gma, cohort)[0](server, states, data, key)
  plain = build_round(fedavg, cohort)[0](server, fedavg_states, data, key)
  expected = jax.tree.map(lambda w, p: w + 1.5 * (p - w), server.variables,
                          plain.server_state.variables)
  chex.assert_trees_all_close(out.server_state.variables, expected, rtol=1e-5, atol=1e-7)


def test_fedrod_generic_part_equals_fedavg_on_label_balanced_clients():
  """With a uniform client label distribution the balanced softmax is the plain
  softmax and the personal head is detached from the generic model, so the global
  update is FedAvg's; the personalised head is g + p."""
  from fedjax_shift.data.federated import stack_clients
  rng = np.random.default_rng(0)
  xs = [rng.random((6, 4, 4, 1)).astype(np.float32) for _ in range(2)]
  ys = [np.array([0, 1, 2, 0, 1, 2], np.int32)] * 2
  data = stack_clients(xs, ys)
  config = tiny_config(**{'client.batch_size': 3})
  fedrod, a = assert_round_equals_fedavg('fedrod', config, data, jax.random.key(5), rtol=1e-5,
                                         atol=1e-7)
  head = jax.tree.map(lambda h: h[0], a.client_states)
  assert not np.allclose(head['kernel'], 0.0)
  personal = fedrod.personalize(a.server_state, head, None, None)
  np.testing.assert_allclose(personal['params']['head']['kernel'],
                             a.server_state.variables['params']['head']['kernel'] +
                             head['kernel'], rtol=1e-6)


def test_fedsr_kl_closed_form_and_zero_weights_train_like_fedavg_on_mu():
  from fedjax_shift.algorithms.fedsr import gaussian_kl
  # KL(N(0,1) ‖ N(0,1)) = 0; KL(N(1,1) ‖ N(0,2²)) = ln 2 + (1 + 1)/8 − 1/2.
  np.testing.assert_allclose(gaussian_kl(jnp.zeros(3), jnp.ones(3), jnp.zeros(3), jnp.ones(3)),
                             0.0, atol=1e-7)
  np.testing.assert_allclose(gaussian_kl(jnp.ones(1), jnp.ones(1), jnp.zeros(1),
                                         2 * jnp.ones(1)), np.log(2) + 2 / 8 - 0.5, rtol=1e-6)
  config = tiny_config(**{'client.batch_size': 3})
  data, _, _ = toy_clients([6, 9, 4], num_classes=NUM_CLASSES)
  fedsr, server, clients = make('fedsr', config, data)
  out = build_round(fedsr, RoundConfig(cohort_size=3))[0](server, clients, data,
                                                          jax.random.key(0))
  chex.assert_tree_all_finite(out.server_state.variables)
  assert 'fedsr' not in fedsr.global_model(out.server_state)['params']
  assert not np.allclose(out.server_state.variables['params']['fedsr']['ref_mean'], 0.0)


def test_uploaded_parameters_are_counted_from_the_update_pytrees():
  """FedEvolve Table 7: FedAvg uploads its model, FedRep only its representation,
  FedBN all but its BatchNorm layers, Local nothing."""
  from fedjax_shift.pipelines.runs import uploaded_parameters
  config = tiny_config()
  data, _, _ = toy_clients([6, 9], num_classes=NUM_CLASSES)
  counts = {}
  config.model.name = 'bn_mlp'
  for name in ('fedavg', 'fedrep', 'fedbn', 'local'):
    algorithm, server, clients = make(name, config, data)
    counts[name] = uploaded_parameters(algorithm, server, clients, data)
  params = server.variables['params']
  total = models.num_parameters(server.variables)  # BN running statistics are averaged too
  batch_norm = models.num_parameters(server.variables['batch_stats']) + models.num_parameters(
      params['encoder']['BatchNorm_0'])
  assert counts['fedavg'] == total
  assert counts['fedrep'] == total - models.num_parameters(params['head'])
  assert counts['fedbn'] == total - batch_norm
  assert counts['local'] == 0


def test_fedbn_on_a_model_without_batch_norm_is_refused_and_tiny_keeps_batch_norm():
  """FedBN on a model with no BatchNorm would train exactly as FedAvg (nothing stays
  local): refused naming both; the label-skew ``tiny`` variant keeps a BN model's BN."""
  config = tiny_config()
  config.model.name = 'mlp'
  data, _, _ = toy_clients([6, 9], num_classes=NUM_CLASSES)
  with pytest.raises(ValueError, match=r"fedbn keeps each client's BatchNorm layers local, and "
                                       r"the model \(MLPEncoder\) has none"):
    make('fedbn', config, data)
  config.fedbn.local_norms = 'all'
  with pytest.raises(ValueError, match=r"normalisation layers local.*MLPEncoder"):
    make('fedbn', config, data)


def _configs_running_fedbn_tiny():
  import glob
  import importlib
  names = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(
      os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs', '*.py')))
  return [n for n in names if 'fedbn' in importlib.import_module(f'configs.{n}').get_config(
      'tiny').algorithms]


@pytest.mark.parametrize('name', _configs_running_fedbn_tiny())
def test_every_tiny_variant_that_runs_fedbn_gives_it_layers_to_keep(name):
  """``configs/<name>.py:tiny`` swaps in a small model: where FedBN runs, the model
  keeps normalisation layers, so its state initialises (it refuses a model without)."""
  import importlib
  from fedjax_shift.pipelines.runs import build_data
  config = importlib.import_module(f'configs.{name}').get_config('tiny')
  bench = build_data(config, config.seeds[0])
  train = bench.splits['train']
  module = models.create(config.model, bench.num_classes)
  algorithm = algorithms.build('fedbn', config, module, train.max_examples, bench.info,
                               train.num_clients, train.x.shape[2:])
  server = algorithm.init(jax.random.key(0), jnp.asarray(train.x[0, :1]))
  assert jax.tree.leaves(algorithm.init_client_state(server))
