"""ATP: update directions, the α gradient, adapted predictions, and α training."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_shift import algorithms, models
from fedjax_shift.pipelines import atp as atp_pipeline
from fedjax_shift.adapters import atp as atp_lib
from fedjax_shift.adapters.no_adapt import no_adapt
from fedjax_shift.core.round import RoundConfig, build_round, round_key
from fedjax_shift.core.test_time import build_test_time
from fedjax_shift.parts import atp_rates
from helpers import tiny_config, toy_clients

NUM_CLASSES = 3


def setup(model='bn_mlp', seed=0):
  module = models.MODELS.get(model)(NUM_CLASSES, hidden=(8,)) if 'mlp' in model else \
      models.MODELS.get(model)(NUM_CLASSES)
  variables = models.init(module, jax.random.key(seed), jnp.zeros((1, 4, 4, 1)))
  if models.has_batch_norm(variables):  # source-like running statistics
    variables = {**variables, 'batch_stats': jax.tree.map(lambda s: s + 0.3,
                                                          variables['batch_stats'])}
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.random((6, 4, 4, 1)), jnp.float32)
  y = jnp.asarray(rng.integers(0, NUM_CLASSES, 6), jnp.int32)
  return module, variables, x, y


def test_module_count_matches_reference():
  """the authors' code: 23 modules for the ATP CNN, 102 for ResNet-18 (BN = 4 modules)."""
  for name, expected in (('atp_cnn', 23), ('resnet18', 102)):
    module = models.MODELS.get(name)(10)
    variables = jax.eval_shape(lambda: models.init(module, jax.random.key(0),
                                                   jnp.zeros((1, 32, 32, 3))))
    assert len(jax.tree.leaves(atp_rates.init_alpha(variables))) == expected


def test_bn_direction_is_running_minus_unbiased_eval_mode_batch_statistic():
  module, variables, x, _ = setup()
  h, _ = atp_rates.update_direction(module, variables, x, jnp.ones(6))
  # First BN layer: its input is Dense_0(x), identical in eval and train mode.
  dense = variables['params']['encoder']['Dense_0']
  pre = x.reshape(6, -1) @ dense['kernel'] + dense['bias']
  running = variables['batch_stats']['encoder']['BatchNorm_0']
  got = h['batch_stats']['encoder']['BatchNorm_0']
  np.testing.assert_allclose(got['mean'], running['mean'] - pre.mean(0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got['var'], running['var'] - np.var(pre, 0, ddof=1),
                             rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize('model', ['bn_mlp', 'mlp'])
def test_alpha_gradient_equals_closed_form_and_finite_differences(model):
  """∂CE/∂α_i = −⟨∂CE/∂θ'_i, h_i⟩ (chain rule through θ' = θ − α⊙h), and a central
  difference (float64) of the loss along α_i agrees."""
  with jax.enable_x64(True):
    module, variables, x, y = setup(model)
    variables = jax.tree.map(lambda a: a.astype(jnp.float64), variables)
    x = x.astype(jnp.float64)
    weight = jnp.ones(6)
    h, _ = atp_rates.update_direction(module, variables, x, weight)
    alpha = jax.tree.map(lambda a: a + 0.01, atp_rates.init_alpha(variables))
    alpha = jax.tree.map(lambda a: a.astype(jnp.float64), alpha)
    loss = lambda a: atp_rates.alpha_loss(module, variables, a, h, x, y, weight)
    grad = jax.grad(loss)(alpha)
    adapted = atp_rates.adapted_variables(variables, alpha, h)
    modules = {k: adapted[k] for k in alpha}
    rest = {k: v for k, v in adapted.items() if k not in alpha}

    def ce_of_adapted(modules):
      logits = models.apply(module, {**rest, **modules}, x, 'eval')[0]
      return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))

    d_theta = jax.grad(ce_of_adapted)(modules)
    closed = jax.tree.map(lambda g, d: -jnp.sum(g * d), d_theta, {k: h[k] for k in alpha})
    chex.assert_trees_all_close(grad, closed, rtol=1e-6, atol=1e-10)
    leaves, treedef = jax.tree.flatten(alpha)
    for i, g in enumerate(jax.tree.leaves(grad)):
      eps = 1e-5
      bump = lambda d: treedef.unflatten([a + d if j == i else a for j, a in enumerate(leaves)])
      numeric = (loss(bump(eps)) - loss(bump(-eps))) / (2 * eps)
      np.testing.assert_allclose(g, numeric, rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize('mode', ['episodic', 'online'])
def test_alpha_zero_equals_no_adaptation(mode):
  module, variables, _, _ = setup()
  data, _, _ = toy_clients([7, 0, 5], num_classes=NUM_CLASSES, pad_to=8)
  run = lambda adapter: build_test_time(adapter, 3, mode)(variables, data, jax.random.key(0))
  base = run(no_adapt(module))
  out = run(atp_lib.atp(module, atp_rates.init_alpha(variables)))
  np.testing.assert_array_equal(out['predictions'], base['predictions'])
  np.testing.assert_allclose(out['loss'], base['loss'], rtol=1e-6)


def test_online_uses_cumulative_mean_of_directions():
  """Batch 2 of ATP-online predicts with θ − α⊙(h1 + h2)/2 (Algorithm 2, line 8)."""
  module, variables, _, _ = setup()
  data, xs, _ = toy_clients([8], num_classes=NUM_CLASSES)
  alpha = jax.tree.map(lambda a: a + 0.5, atp_rates.init_alpha(variables))
  out = build_test_time(atp_lib.atp(module, alpha), 4, 'online')(variables, data,
                                                                 jax.random.key(0))
  ones = jnp.ones(4)
  h1, _ = atp_rates.update_direction(module, variables, jnp.asarray(xs[0][:4]), ones)
  h2, _ = atp_rates.update_direction(module, variables, jnp.asarray(xs[0][4:]), ones)
  mean_h = jax.tree.map(lambda a, b: (a + b) / 2, h1, h2)
  adapted = atp_rates.adapted_variables(variables, alpha, mean_h)
  logits = models.apply(module, adapted, jnp.asarray(xs[0][4:]))[0]
  np.testing.assert_array_equal(out['predictions'][0][4:], np.argmax(logits, -1))
  batch = build_test_time(atp_lib.atp(module, alpha), 4, 'episodic')(variables, data,
                                                                     jax.random.key(0))
  assert not np.allclose(batch['loss'], out['loss'])


def test_adapted_running_variance_is_clamped():
  module, variables, x, _ = setup()
  h, _ = atp_rates.update_direction(module, variables, x, jnp.ones(6))
  alpha = jax.tree.map(lambda a: a + 100.0, atp_rates.init_alpha(variables))
  adapted = atp_rates.adapted_variables(variables, alpha, h)
  for layer in adapted['batch_stats']['encoder'].values():
    assert float(jnp.min(layer['var'])) >= 0.0


def test_alpha_that_does_not_match_the_model_is_rejected():
  module, variables, _, _ = setup()
  other = models.MODELS.get('bn_mlp')(NUM_CLASSES, hidden=(8, 8))
  other_vars = models.init(other, jax.random.key(0), jnp.zeros((1, 4, 4, 1)))
  with pytest.raises(ValueError, match='modules do not match the model'):
    atp_lib.atp(module, atp_rates.init_alpha(other_vars)).init(variables, jax.random.key(0))
  with pytest.raises(ValueError, match='atp.scaling'):
    atp_rates.gradient_scale(variables, 'log')


def alpha_training(config, module, max_examples, variables):
  """ATP's α training as the atp pipeline builds it: a plain method run of config.atp."""
  return algorithms.build('atp', atp_pipeline.alpha_config(config), module, max_examples,
                          global_variables=variables)


def alpha_round_setup(scaling='sqrt', weighting='uniform'):
  module, variables, _, _ = setup()
  config = tiny_config()
  config.atp.scaling = scaling
  config.atp.batch_size = 4
  data, _, _ = toy_clients([4, 4, 0, 4], num_classes=NUM_CLASSES, pad_to=6, seed=1)
  algorithm = alpha_training(config, module, 6, variables)
  state = algorithm.init(jax.random.key(0), data.x[0, :1])
  round_config = RoundConfig(cohort_size=4, weighting=weighting)
  return module, variables, config, data, algorithm, state, round_config


def test_alpha_round_equals_hand_loop_over_clients():
  """One compiled α round == per client SGD on α (lr 0.1, 1/sqrt(numel) scaling,
  one batch of 4 = the client's data), then the unweighted mean over the three
  clients with data (the empty client gets weight 0)."""
  module, variables, config, data, algorithm, state, round_config = alpha_round_setup()
  round_device, _ = build_round(algorithm, round_config)
  out = round_device(state, (), data, round_key(jax.random.key(0), 0))
  scale = atp_rates.gradient_scale(variables, 'sqrt')
  expected = []
  for k in (0, 1, 3):
    n = int(data.num_examples[k])
    x, y, w = data.x[k, :n], data.y[k, :n], jnp.ones(n)
    h, _ = atp_rates.update_direction(module, variables, x, w)
    grad = jax.grad(lambda a: atp_rates.alpha_loss(module, variables, a, h, x, y, w))(state.alpha)
    expected.append(jax.tree.map(lambda a, g, s: a - config.atp.learning_rate * s * g,
                                 state.alpha, grad, scale))
  mean = jax.tree.map(lambda *a: sum(a) / 3, *expected)
  chex.assert_trees_all_close(out.server_state.alpha, mean, rtol=1e-4, atol=1e-7)
  chex.assert_trees_all_equal(out.server_state.variables, variables)
  assert int(out.server_state.round) == 1


def test_alpha_training_is_a_method_run_of_config_atp():
  """α training's optimizer and schedule are config.atp's, built by the engine as any
  method's: the round's plan runs atp.local_steps steps of atp.batch_size (not the
  pretraining's config.client), and a round with 3 fixed steps equals 3 hand SGD steps
  of lr 0.1 on the 1/sqrt(numel)-scaled α gradient, averaged over the clients."""
  from fedjax_shift.pipelines.programs import round_config as pipeline_round_config
  module, variables, config, data, _, _, _ = alpha_round_setup()
  config.client.batch_size, config.client.local_steps = 7, 0   # the pretraining's
  config.atp.local_steps, config.atp.local_epochs = 3, 0
  alpha_run = atp_pipeline.alpha_config(config)
  plan = pipeline_round_config(alpha_run, data, 'atp')
  assert (plan.schedule.num_steps, plan.schedule.batch_size) == (3, 4)
  algorithm = alpha_training(config, module, 6, variables)
  state = algorithm.init(jax.random.key(0), data.x[0, :1])
  out = build_round(algorithm, RoundConfig(cohort_size=4, weighting='uniform',
                                           schedule=plan.schedule))[0](
      state, (), data, round_key(jax.random.key(0), 0))
  scale = atp_rates.gradient_scale(variables, 'sqrt')
  expected = []
  for k in (0, 1, 3):   # 4 examples, batch 4: each step is the whole client
    n = int(data.num_examples[k])
    x, y, w = data.x[k, :n], data.y[k, :n], jnp.ones(n)
    h, _ = atp_rates.update_direction(module, variables, x, w)
    alpha = state.alpha
    for _ in range(3):
      grad = jax.grad(lambda a: atp_rates.alpha_loss(module, variables, a, h, x, y, w))(alpha)
      alpha = jax.tree.map(lambda a, g, s: a - 0.1 * s * g, alpha, grad, scale)
    expected.append(alpha)
  mean = jax.tree.map(lambda *a: sum(a) / 3, *expected)
  chex.assert_trees_all_close(out.server_state.alpha, mean, rtol=1e-4, atol=1e-7)
  config.client_overrides = {'atp': {'learning_rate': 0.5}}
  with pytest.raises(ValueError, match=r"config.client_overrides.atp: α training's optimizer"):
    atp_pipeline.check(config)


def test_alpha_training_lowers_source_loss():
  module, variables, config, data, algorithm, state, round_config = alpha_round_setup()
  config.atp.learning_rate = 1.0
  algorithm = alpha_training(config, module, 6, variables)
  round_device, _ = build_round(algorithm, round_config)
  losses = []
  for r in range(8):
    out = round_device(state, (), data, round_key(jax.random.key(0), r))
    state = out.server_state
    losses.append(float(out.metrics['loss']))
  assert losses[-1] < losses[0]


def test_variance_clamp_rules_on_a_hand_built_clamped_case():
  """A running variance r pushed below 0 by α_var·h_var (α_var > r/(r − b) on some
  channels, below it on others): the forward value is clamped at 0 either
  way; α_var's gradient is −Σ_c g_c·h_c over every channel with the authors'
  straight-through rule, and over the unclamped channels only with 'zero', where g is
  ∂CE/∂(adapted variance) at the clamped model."""
  module, variables, x, y = setup()
  h, _ = atp_rates.update_direction(module, variables, x, jnp.ones(6))
  alpha = jax.tree.map(jnp.zeros_like, atp_rates.init_alpha(variables))
  path = ('batch_stats', 'encoder', 'BatchNorm_0', 'var')
  get = lambda tree: tree[path[0]][path[1]][path[2]][path[3]]
  running, direction = get(variables), get(h)
  # α_var between the channels' thresholds r / h (h = r − b > 0): some clamp, some not.
  thresholds = np.sort(np.asarray(running / direction)[np.asarray(direction) > 0])
  rate = float(thresholds[len(thresholds) // 2]) * 1.001
  alpha['batch_stats']['encoder']['BatchNorm_0']['var'] = jnp.float32(rate)
  adapted = running - rate * direction
  clamped = adapted < 0
  assert clamped.any() and (~clamped).any()  # both kinds of channel
  weight = jnp.ones(6)
  at = {'straight_through': atp_rates.adapted_variables(variables, alpha, h, 'straight_through'),
        'zero': atp_rates.adapted_variables(variables, alpha, h, 'zero')}
  np.testing.assert_allclose(get(at['zero']), np.maximum(adapted, 0.0))
  chex.assert_trees_all_equal(at['zero'], at['straight_through'])  # same forward

  def ce(adapted_variables):
    logits = models.apply(module, adapted_variables, x, 'eval')[0]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))

  g = get(jax.grad(ce, allow_int=True)(at['zero']))
  for clamp, keep in (('straight_through', np.ones_like(clamped)), ('zero', ~clamped)):
    grad = jax.grad(lambda a: atp_rates.alpha_loss(module, variables, a, h, x, y, weight,
                                                 clamp))(alpha)
    expected = -np.sum(np.asarray(g) * np.asarray(direction) * keep)
    np.testing.assert_allclose(get(grad), expected, rtol=1e-4, atol=1e-7)


def test_float64_round_of_fedavg_and_of_alpha_training():
  """Under x64 every scan carry follows the loss dtype: one FedAvg round and one ATP
  α round run in float64 and give finite results."""
  from fedjax_shift import algorithms
  from fedjax_shift.core.round import stack_client_states
  with jax.enable_x64(True):
    data, _, _ = toy_clients([4, 5, 6], num_classes=NUM_CLASSES, pad_to=6, seed=2)
    data = data._replace(x=data.x.astype(np.float64))
    config = tiny_config(**{'model.name': 'bn_mlp', 'client.batch_size': 3})
    module = models.create(config.model, NUM_CLASSES)
    fedavg = algorithms.build('fedavg', config, module, data.max_examples)
    server = fedavg.init(jax.random.key(0), jnp.asarray(data.x[0, :1]))
    server = jax.tree.map(lambda a: a.astype(jnp.float64) if jnp.issubdtype(
        a.dtype, jnp.floating) else a, server)
    clients = stack_client_states(fedavg, server, data.num_clients)
    out = build_round(fedavg, RoundConfig(cohort_size=3))[0](server, clients, data,
                                                             round_key(jax.random.key(0), 0))
    assert out.server_state.variables['params']['head']['kernel'].dtype == jnp.float64
    assert out.metrics['loss'].dtype == jnp.float64 or np.isfinite(out.metrics['loss'])
    chex.assert_tree_all_finite(out.server_state.variables)
    config.atp.batch_size = 3
    algorithm = alpha_training(config, module, data.max_examples, out.server_state.variables)
    state = algorithm.init(jax.random.key(1), jnp.asarray(data.x[0, :1]))
    alpha_out = build_round(algorithm, RoundConfig(cohort_size=3, weighting='uniform'))[0](
        state, (), data, round_key(jax.random.key(0), 1))
    chex.assert_tree_all_finite(alpha_out.server_state.alpha)
    assert np.isfinite(float(alpha_out.metrics['loss']))
