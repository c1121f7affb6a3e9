"""Learned adaptation rates (adapters/learned_rates.py): gradients through the K-step
test-time scan, the federated rates training, and the test-time pipeline's rows."""
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from configs import atp as atp_configs
from fedjax_shift import config as config_lib
from fedjax_shift import algorithms, models, pipelines
from fedjax_shift.pipelines import atp as atp_pipeline
from fedjax_shift.adapters import learned_rates
from fedjax_shift.adapters.bn_adapt import bn_adapt
from fedjax_shift.adapters.tent import tent
from fedjax_shift.core.local import example_order
from fedjax_shift.core.round import RoundConfig, build_round
from fedjax_shift.core.test_time import SourceContext, build_test_time
from fedjax_shift.metrics import read_metrics
from tests.helpers import override, toy_clients

NUM_CLASSES = 3
BATCH = 4


def setup(dtype=jnp.float32):
  module = models.MODELS.get('bn_mlp')(NUM_CLASSES, hidden=(6, 5))
  variables = models.init(module, jax.random.key(0), jnp.zeros((1, 4, 4, 1)))
  variables = jax.tree.map(lambda leaf: leaf.astype(dtype), variables)
  data, _, _ = toy_clients([12, 7], num_classes=NUM_CLASSES)   # K = 3 batches of 4
  return module, variables, data


def context(variables):
  return SourceContext(variables, NUM_CLASSES, BATCH, input_shape=(4, 4, 1))


def hparams(adapter, **fields):
  out = ml_collections.ConfigDict(learned_rates.ADAPTERS.defaults(adapter).to_dict())
  out.update(fields)
  return out


def rated(adapter, module, variables, rates, **fields):
  return learned_rates.rated_adapter(adapter, module, hparams(adapter, **fields),
                                     context(variables), rates)


@pytest.mark.parametrize('predict', ['before', 'after'])
def test_tent_rates_frozen_at_initialisation_give_fixed_tents_predictions(predict):
  module, variables, data = setup()
  rates = learned_rates.init_rates('tent', ('learning_rate',), hparams('tent'), variables)
  assert sorted(rates['learning_rate']) == ['encoder/BatchNorm_0', 'encoder/BatchNorm_1']
  fixed = build_test_time(tent(module, 1e-3, predict), BATCH, 'online')(
      variables, data, jax.random.key(1))
  learned = build_test_time(rated('tent', module, variables, rates, predict=predict), BATCH,
                            'online')(variables, data, jax.random.key(1))
  np.testing.assert_array_equal(learned['predictions'], fixed['predictions'])
  np.testing.assert_allclose(learned['loss'], fixed['loss'], rtol=1e-6)


def test_bn_adapt_prior_frozen_at_initialisation_gives_fixed_bn_adapt():
  module, variables, data = setup()
  rates = learned_rates.init_rates('bn_adapt', ('prior_strength',), hparams('bn_adapt'),
                                   variables)
  fixed = build_test_time(bn_adapt(module, BATCH), BATCH, 'episodic')(
      variables, data, jax.random.key(1))
  learned = build_test_time(rated('bn_adapt', module, variables, rates), BATCH, 'episodic')(
      variables, data, jax.random.key(1))
  np.testing.assert_array_equal(learned['predictions'], fixed['predictions'])
  np.testing.assert_allclose(learned['loss'], fixed['loss'], rtol=1e-6)


def objective(module, variables, data, adapter, mode='online', remat=False, **fields):
  x, y, n = (jnp.asarray(a[0]) for a in (data.x, data.y, data.num_examples))

  def loss(rates):
    return learned_rates.k_step_loss(rated(adapter, module, variables, rates, **fields), BATCH,
                                     variables, x, y, n, jax.random.key(2), mode, remat)
  return loss


def starting_rates(adapter, variables):
  """Rates away from their defaults so every one of them moves the objective."""
  name = next(iter(learned_rates.learnable(adapter)))
  rates = learned_rates.init_rates(adapter, (name,), hparams(adapter), variables)
  if adapter == 'atp':   # α = 0.3 on every module (0 would leave BN statistics in place)
    return jax.tree.map(lambda a: a + 0.3, rates)
  return jax.tree.map(lambda u: jnp.log(jnp.asarray(0.05, u.dtype)), rates)


@pytest.mark.parametrize('adapter', ['tent', 'atp'])
def test_k_step_gradient_equals_central_finite_difference_in_float64(adapter):
  # K = 3 online batches of 4 (client 0 has 12 examples). Tent: per-layer log-rates of
  # Adam, predicting after its update; ATP-online: α through the running mean of h.
  with jax.enable_x64(True):
    module, variables, data = setup(jnp.float64)
    loss = objective(module, variables, data, adapter,
                     **({'predict': 'after'} if adapter == 'tent' else {}))
    rates = jax.tree.map(lambda r: jnp.asarray(r, jnp.float64), starting_rates(adapter, variables))
    grad = jax.jit(jax.grad(loss))(rates)
    loss = jax.jit(loss)   # compiled once for the 2 × leaves evaluations below
    leaves, tree = jax.tree.flatten(rates)
    grad_leaves = jax.tree.leaves(grad)
    step = 1e-5
    moved = 0
    for i in range(len(leaves)):
      up = jax.tree.unflatten(tree, [v + step * (j == i) for j, v in enumerate(leaves)])
      down = jax.tree.unflatten(tree, [v - step * (j == i) for j, v in enumerate(leaves)])
      numeric = (loss(up) - loss(down)) / (2 * step)
      np.testing.assert_allclose(float(grad_leaves[i]), float(numeric), rtol=1e-5, atol=1e-9)
      moved += abs(float(grad_leaves[i])) > 1e-6
    assert moved >= 2                          # the rates matter


@pytest.mark.parametrize('adapter', ['tent', 'atp'])
def test_remat_gives_the_same_gradient(adapter):
  module, variables, data = setup()
  rates = starting_rates(adapter, variables)
  plain = jax.grad(objective(module, variables, data, adapter))(rates)
  remat = jax.grad(objective(module, variables, data, adapter, remat=True))(rates)
  for a, b in zip(jax.tree.leaves(remat), jax.tree.leaves(plain)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)


def test_k1_episodic_atp_rates_training_equals_atps_alpha_training():
  # The learned-rates training of ATP's α with K = 1 in the episodic mode is ATP's
  # Algorithm 1: same batches (the engine's schedule), same loss, same scaled SGD.
  module, variables, data = setup()
  config = atp_configs.get_config('digits_hybrid,tiny,learned')
  config.atp.batch_size = BATCH
  config.tta.batch_size = BATCH
  config.atp.local_steps = 2
  config.learned.local_steps = 2
  atp = algorithms.build('atp', atp_pipeline.alpha_config(config), module, data.x.shape[1],
                         global_variables=variables)
  learned = learned_rates.rates_training(
      lambda rates: rated('atp', module, variables, rates),
      learned_rates.init_rates('atp', ('alpha',), {}, variables), variables,
      atp_pipeline.rates_optimizer(config, ('alpha',), variables),
      learned_rates.rates_schedule(BATCH, 1, 2, data.x.shape[1]), BATCH, 'episodic')
  key = jax.random.key(4)
  round_config = RoundConfig(cohort_size=2, weighting='uniform')
  expected = build_round(atp, round_config)[1](atp.init(None, None), (), data, jnp.arange(2),
                                               key).server_state.alpha
  got = build_round(learned, round_config)[1](learned.init(None, None), (), data,
                                              jnp.arange(2), key).server_state.rates['alpha']
  assert max(abs(float(a)) for a in jax.tree.leaves(expected)) > 1e-4
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)


def test_a_round_of_rates_equals_the_mean_of_each_clients_sgd_step_on_its_stream():
  # Reference: client k's stream is its examples in the engine's random order
  # (core/local.py: example_order of fold_in(client key, 0)), cycled to K·B = 8; one
  # SGD step on the gradient of its K-step objective; the server's unweighted mean.
  module, variables, data = setup()
  rates = starting_rates('tent', variables)
  make = lambda r: rated('tent', module, variables, r, predict='after')
  algorithm = learned_rates.rates_training(
      make, rates, variables, optax.sgd(0.5), learned_rates.rates_schedule(
          BATCH, 2, 1, data.x.shape[1]), BATCH, 'online')
  key = jax.random.key(4)
  out = build_round(algorithm, RoundConfig(cohort_size=2, weighting='uniform'))[1](
      algorithm.init(None, None), (), data, jnp.arange(2), key)
  deltas = []
  for k in range(2):
    one = jax.tree.map(lambda a: jnp.asarray(a[k]), data)
    client_key = jax.random.fold_in(jax.random.fold_in(key, 1), k)
    order = example_order(jax.random.fold_in(client_key, 0), one.mask)
    stream = order[jnp.arange(2 * BATCH) % one.num_examples]
    step_key = jax.random.fold_in(jax.random.fold_in(client_key, 1), 0)
    grad = jax.grad(lambda r: learned_rates.k_step_loss(
        make(r), BATCH, variables, one.x[stream], one.y[stream], jnp.int32(2 * BATCH),
        step_key))(rates)
    deltas.append(jax.tree.map(lambda g: -0.5 * g, grad))
  expected = jax.tree.map(lambda r, a, b: r + (a + b) / 2, rates, *deltas)
  for a, b, r in zip(jax.tree.leaves(out.server_state.rates), jax.tree.leaves(expected),
                     jax.tree.leaves(rates)):
    np.testing.assert_allclose(a, b, rtol=1e-5)
    assert abs(float(a - r)) > 1e-6


@pytest.mark.parametrize('adapter, names, mode, k, message', [
    ('tent', ('momentum',), 'online', 5, "tent has no learnable rate \\['momentum'\\]"),
    ('no_adapt', ('learning_rate',), 'online', 5, 'the no_adapt adapter has nothing to learn'),
    ('t3a', ('filter_size',), 'online', 5, 'the t3a adapter has nothing to learn'),
    ('tent', ('learning_rate',), 'online', 0, 'K, the number of test batches'),
    ('tent', ('learning_rate',), 'online', 1, 'use the online mode with K >= 2'),
    ('tent', ('learning_rate',), 'episodic', 5, 'use the online mode with K >= 2'),
    ('tent', (), 'online', 5, 'name at least one'),
])
def test_bad_learned_rates_are_errors_naming_the_field(adapter, names, mode, k, message):
  with pytest.raises(ValueError, match=message) as error:
    learned_rates.check_learned(adapter, names, hparams(adapter), mode, k,
                                'config.learned.rates.row')
  assert 'config.learned.rates.row' in str(error.value)


@pytest.mark.parametrize('field, value, message', [
    ('learned.rates.tent_learned', ('beta',), 'config.learned.rates.tent_learned'),
    ('learned.num_batches.atp_online_k', 0, 'config.learned.num_batches.atp_online_k'),
    ('learned.base.tent_learned', 'no_adapt', 'the no_adapt adapter has nothing to learn'),
    ('learned.base.bn_adapt_learned', 'tent3', 'config.learned.base.bn_adapt_learned'),
    ('learned.local_steps', 0, 'config.learned.local_steps'),
    ('learned.optimizer', 'lbfgs', 'config.learned.optimizer'),
])
def test_pipeline_learned_config_errors_name_the_field(field, value, message, tmp_path):
  config = override(atp_configs.get_config('digits_hybrid,tiny,learned'), **{field: value})
  with pytest.raises(ValueError, match=message):
    config_lib.validate(config, str(tmp_path))


def test_pipeline_learned_rows_train_save_plot_and_resume(tmp_path):
  config = atp_configs.get_config('digits_hybrid,tiny,learned')
  config.tta.rows = ('no_adapt', 'bn_adapt', 'tent', 'atp_online')
  config.learned.learning_rate = 0.5     # move the rates visibly in two tiny rounds
  workdir = str(tmp_path)
  out = pipelines.run(config, workdir)
  table1 = out.records['table1']
  assert list(table1) == ['no_adapt', 'bn_adapt', 'bn_adapt_learned', 'tent', 'tent_learned',
                          'atp_online', 'atp_online_k']
  assert 'ATP-online (trained online, K=5)' in out.records['markdown']
  run_dir = os.path.join(workdir, 'hybrid', 'seed_0')
  with open(os.path.join(run_dir, 'learned_rates.json')) as f:
    saved = json.load(f)
  assert sorted(saved['tent_learned']) == ['learning_rate/encoder/BatchNorm_0']
  assert not np.isclose(saved['tent_learned']['learning_rate/encoder/BatchNorm_0'], 1e-3)
  assert not np.isclose(saved['bn_adapt_learned']['prior_strength'], 16.0)
  assert len(saved['atp_online_k']) == 8
  records = read_metrics(os.path.join(run_dir, 'learned_tent_learned', 'metrics.jsonl'))
  assert [r['round'] for r in records] == [1, 2]
  assert np.isclose(records[-1]['rates/learning_rate/encoder/BatchNorm_0'],
                    saved['tent_learned']['learning_rate/encoder/BatchNorm_0'])
  for key in config.learned.rows:
    assert os.path.exists(os.path.join(workdir, f'rates_{key}.png'))
  with open(os.path.join(workdir, 'results.json')) as f:
    assert 'Tent (learned rates)' in json.load(f)['labels'].values()
  again = pipelines.run(config, workdir)           # resumes from the checkpoints
  assert again.records['table1'] == table1


LEARNABLE = [(name, rate) for name in learned_rates.ADAPTERS.names()
             for rate in learned_rates.learnable(name)]
# EATA: margin ln C, so the toy model's near-uniform predictions count as reliable and
# adapt (with 0.4 ln C none would, and its rate could not matter).
SMALL = {'eata': {'fisher_weight': 0.0, 'entropy_margin': 1.0}, 'memo': {'num_augmentations': 2},
         # the same for SAR's filter and PL's confidence; RoTTA and NOTE learn within K·B
         'sar': {'entropy_margin': 1.0}, 'pl': {'threshold': 0.34},
         'cotta': {'num_augmentations': 2}, 'rotta': {'memory_size': 6, 'update_frequency': 4},
         'note': {'memory_size': 6, 'update_frequency': 4}}
# Adapters that predict with the model before their step and have no ``predict`` field:
# only a later batch of an online stream sees their rate.
PREDICT_BEFORE = {'sar', 'cotta', 'rotta', 'note', 'pl'}


def test_every_learnable_rate_is_a_number_its_adapter_reads():
  # Read from the registry: a rate is a numeric field of the adapter's config section,
  # or ATP's α, which the adapter takes from its source context; every learned row of
  # ATP's config trains rates its base adapter registered.
  from configs import atp as atp_configs
  assert LEARNABLE
  for adapter, rate in LEARNABLE:
    parameterisation = learned_rates.learnable(adapter)[rate]
    defaults = learned_rates.ADAPTERS.defaults(adapter)
    assert parameterisation == 'alpha' or isinstance(defaults[rate], float), (adapter, rate)
  config = atp_configs.get_config()
  for row, rates in config.learned.rates.items():
    adapter = config.tta.adapter[config.learned.base[row]]
    assert set(rates) <= set(learned_rates.learnable(adapter)), (row, rates)


@pytest.mark.parametrize('adapter, rate', LEARNABLE)
def test_every_learnable_rate_frozen_gives_the_fixed_adapter_and_has_a_gradient(adapter, rate):
  # Frozen at their configured values (α: at a nonzero value given to both), the rates
  # reproduce the registered adapter's predictions; the K-step objective (K = 3 online,
  # or episodic for the adapters that do not predict before their update) has a finite,
  # nonzero gradient with respect to them.
  module, variables, data = setup()
  fields = hparams(adapter, **SMALL.get(adapter, {}))
  rates = learned_rates.init_rates(adapter, (rate,), fields, variables)
  if adapter == 'atp':
    rates = jax.tree.map(lambda a: a + 0.3, rates)
  ctx = context(variables)._replace(alpha=rates.get('alpha'))
  fixed = learned_rates.ADAPTERS.get(adapter)(module, fields, ctx)
  predict = fields.get('predict', 'before' if adapter in PREDICT_BEFORE else 'after')
  mode = 'online' if predict == 'before' or adapter == 'atp' else 'episodic'
  run = lambda a: build_test_time(a, BATCH, mode)(variables, data, jax.random.key(1))
  learned = learned_rates.rated_adapter(adapter, module, fields, context(variables), rates)
  learned_out, fixed_out = run(learned), run(fixed)
  np.testing.assert_array_equal(learned_out['predictions'], fixed_out['predictions'])
  np.testing.assert_allclose(learned_out['loss'], fixed_out['loss'], rtol=1e-5)
  x, y, n = (jnp.asarray(a[0]) for a in (data.x, data.y, data.num_examples))
  meta_gradient = jax.jit(jax.grad(lambda r: learned_rates.k_step_loss(
      learned_rates.rated_adapter(adapter, module, fields, context(variables), r), BATCH,
      variables, x, y, n, jax.random.key(2), mode)))
  # Compiled at XLA's default backend optimisation, not the suite's compile-light level 0
  # (conftest.py): at level 0 on an AVX-512 Xeon SHOT's meta-gradient came out NaN
  # (0.00385 at levels 1-3 there, and at level 0 on an AMD EPYC).
  grad = meta_gradient.lower(rates).compile(
      compiler_options={'xla_backend_optimization_level': 2})(rates)
  leaves = np.asarray([float(g) for g in jax.tree.leaves(grad)])
  assert np.all(np.isfinite(leaves)) and np.any(np.abs(leaves) > 1e-9), leaves


def test_a_rate_learned_through_adam_has_a_finite_gradient_where_a_gradient_is_zero():
  """Two Adam steps at a learned per-layer rate on tanh(W·x) with x = (1, 0): the second
  input's weights have gradient x₂·δ = 0 exactly, yet depend on W. With √v at v = 0
  (optax's default eps_root 0) the meta-gradient is ∞ · 0 = NaN on any CPU; the
  adapters' Adam direction (``common.DIRECTIONS``) gives the finite gradient a central
  difference gives, and the same steps as ``optax.adam``."""
  from fedjax_shift.adapters.common import DIRECTIONS, per_layer_rates
  x = jnp.array([1.0, 0.0])
  start = {('dense', 'kernel'): jnp.array([[0.3, 0.2], [0.5, -1.0]])}

  def loss(params):
    return jnp.sum((jnp.tanh(params[('dense', 'kernel')] @ x) - 1.0) ** 2)

  def two_steps(rate, direction):
    optimizer = per_layer_rates(direction, {'dense': jnp.asarray(rate, jnp.float32)})
    params, state = start, optimizer.init(start)
    for _ in range(2):
      updates, state = optimizer.update(jax.grad(loss)(params), state, params)
      params = optax.apply_updates(params, updates)
    return params

  assert np.isnan(jax.grad(lambda r: loss(two_steps(r, optax.scale_by_adam())))(0.1))
  grad = jax.grad(lambda r: loss(two_steps(r, DIRECTIONS['adam']())))(0.1)
  step = 1e-3
  central = (loss(two_steps(0.1 + step, DIRECTIONS['adam']())) -
             loss(two_steps(0.1 - step, DIRECTIONS['adam']()))) / (2 * step)
  assert np.isfinite(grad)
  np.testing.assert_allclose(grad, central, rtol=1e-2)
  plain = optax.adam(0.1)   # the fixed adapters' optimizer: the same two steps
  params, state = start, plain.init(start)
  for _ in range(2):
    updates, state = plain.update(jax.grad(loss)(params), state, params)
    params = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(params[('dense', 'kernel')],
                                two_steps(0.1, DIRECTIONS['adam']())[('dense', 'kernel')])
