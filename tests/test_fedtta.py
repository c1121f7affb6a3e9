"""FedTTA / FedTTA-Prox (algorithms/fedtta.py) and the FedTTA / FedTTA++ adapters."""
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_shift import algorithms, models
from fedjax_shift.adapters.fedtta import Adaptation, adapt, adaptation_module_of
from fedjax_shift.benchmarks import build_benchmark, check_data
from fedjax_shift.parts import losses
from fedjax_shift.parts.fedtta_step import (ADAPTATION, InnerStep, inner_step,
                                            personalization_loss)
from fedjax_shift.core.algorithm import ClientData
from fedjax_shift.core.round import NO_STEP_LIMIT
from fedjax_shift.core.test_time import ADAPTERS, AdaptBatch, SourceContext
from helpers import set_data, tiny_config, toy_clients

NUM_CLASSES = 3


def setup(name='fedtta', **overrides):
  config = tiny_config(**{'model.hidden': (6,), 'client.batch_size': 4,
                          'client.local_steps': 2, **overrides})
  module = models.create(config.model, NUM_CLASSES)
  data, _, _ = toy_clients([7], shape=(4, 4, 1), num_classes=NUM_CLASSES)
  algorithm = algorithms.build(name, config, module, data.max_examples, {})
  state = algorithm.init(jax.random.key(0), jnp.asarray(data.x[0, :1]))
  client = ClientData(*(jnp.asarray(a[0]) for a in data), jnp.int32(NO_STEP_LIMIT))
  return config, module, algorithm, state, client


def outer_loss(module, params, x, y, inner_lr):
  """L(ψ, φ) = CE(f(X; ψ − η ∇ψ ‖g(f(X; ψ); φ)‖₂), Y) (Eqs. 3–7)."""
  adaptation_module = adaptation_module_of(params['adaptation'])
  adapted = inner_step(module, adaptation_module, params['base'], params['adaptation'], x,
                       jnp.ones(len(y)), InnerStep(inner_lr, 0.1))
  logits = models.apply(module, {'params': adapted}, x)[0]
  return jnp.mean(-jax.nn.log_softmax(logits)[jnp.arange(len(y)), y])


def test_meta_gradient_through_the_inner_step_equals_finite_differences():
  """float64: the directional derivative of the outer loss along a random direction
  (for ψ and φ together) equals a central finite difference, ε = 1e-6 — so the
  gradient really flows through ψ̃ = ψ − η ∇ψ ℓ_per into φ and (second order) ψ."""
  with jax.enable_x64(True):
    _, module, _, state, client = setup()
    params = jax.tree.map(lambda a: a.astype(jnp.float64), state.variables['params'])
    x, y = client.x[:7].astype(jnp.float64), client.y[:7]
    loss = jax.jit(lambda p: outer_loss(module, p, x, y, 0.5))
    grads = jax.jit(jax.grad(loss))(params)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    direction = treedef.unflatten([jax.random.normal(k, l.shape, jnp.float64)
                                   for k, l in zip(keys, leaves)])
    analytic = sum(jnp.vdot(g, d) for g, d in zip(jax.tree.leaves(grads),
                                                  jax.tree.leaves(direction)))
    eps = 1e-6
    shift = lambda s: jax.tree.map(lambda p, d: p + s * d, params, direction)
    numeric = (loss(shift(eps)) - loss(shift(-eps))) / (2 * eps)
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6)
    assert float(jnp.abs(jax.tree.leaves(grads['adaptation'])[0]).max()) > 0


def test_with_a_constant_adaptation_model_fedtta_equals_the_base_model_training():
  """g ≡ constant (zero kernels): ∇ψ ℓ_per = 0, so ψ̃ = ψ and one FedTTA client update
  of ψ equals FedAvg's local training from the same ψ with the same batches; φ's
  gradient is zero except its last bias (η_adapt = 0 keeps it fixed)."""
  config, module, algorithm, state, client = setup(**{'fedtta.adapt_learning_rate': 0.0,
                                                      'fedtta.weight_decay': 0.0})
  params = state.variables['params']
  params = {**params, 'adaptation': jax.tree.map(jnp.zeros_like, params['adaptation'])}
  params['adaptation']['Dense_3']['bias'] = jnp.ones(1)
  state = state._replace(variables={'params': params})
  out, _ = algorithm.client_update(state, (), client, jax.random.key(5))
  fedavg = algorithms.build('fedavg', config, module, client.x.shape[0], {})
  avg_state = fedavg.init(jax.random.key(0), client.x[:1])
  avg_state = avg_state._replace(variables={'params': params['base']})
  avg_out, _ = fedavg.client_update(avg_state, (), client, jax.random.key(5))
  chex.assert_trees_all_close(out.update['params']['base'], avg_out.update['params'],
                              rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_equal(out.update['params']['adaptation'],
                              jax.tree.map(jnp.zeros_like, params['adaptation']))


@pytest.mark.parametrize('clip_groups', ['separate', 'joint'])
def test_meta_optimizer_steps_each_group_as_the_authors_torch_sgd(clip_groups):
  """ψ: SGD η_outer; φ: SGD η_adapt with momentum 0.9; the gradient clipped at global
  norm 10, each group at its own ('separate', the authors') or both at one ('joint'),
  then weight decay 1e-4·θ added (torch.optim.SGD's order), hand-computed over two
  steps. The separate clip binds on φ only; the joint one shrinks ψ's step as well."""
  import ml_collections
  import optax
  from fedjax_shift.algorithms.fedtta import meta_optimizer
  hparams = ml_collections.ConfigDict({'adapt_learning_rate': 0.01, 'adapt_momentum': 0.9,
                                       'weight_decay': 1e-4, 'clip_norm': 10.0,
                                       'clip_groups': clip_groups})
  opt = meta_optimizer(optax.sgd(0.1), hparams)
  params = {'base': jnp.array([1.0, -2.0]), 'adaptation': jnp.array([0.5])}
  grads = [{'base': jnp.array([3.0, 4.0]), 'adaptation': jnp.array([40.0])},
           {'base': jnp.array([1.0, 0.0]), 'adaptation': jnp.array([-2.0])}]
  state = opt.init(params)
  psi, phi, buffer = np.array([1.0, -2.0]), np.array([0.5]), np.zeros(1)
  for g in grads:
    updates, state = opt.update(g, state, params)
    params = optax.apply_updates(params, updates)
    g_psi, g_phi = np.asarray(g['base']), np.asarray(g['adaptation'])
    if clip_groups == 'separate':
      g_psi = g_psi * min(1.0, 10.0 / np.linalg.norm(g_psi))
      g_phi = g_phi * min(1.0, 10.0 / np.linalg.norm(g_phi))
    else:
      scale = min(1.0, 10.0 / np.linalg.norm(np.concatenate([g_psi, g_phi])))
      g_psi, g_phi = g_psi * scale, g_phi * scale
    psi = psi - 0.1 * (g_psi + 1e-4 * psi)
    buffer = 0.9 * buffer + (g_phi + 1e-4 * phi)
    phi = phi - 0.01 * buffer
    np.testing.assert_allclose(params['base'], psi, rtol=1e-6)
    np.testing.assert_allclose(params['adaptation'], phi, rtol=1e-6)
  # The first step by hand: separate clips leave ψ's (3, 4) alone (norm 5); the joint
  # clip scales all of (3, 4, 40) by 10/√1625, ψ's part with it.
  scale = 1.0 if clip_groups == 'separate' else 10.0 / np.sqrt(1625.0)
  first_psi = 1 - 0.1 * (3 * scale + 1e-4)
  second_grad = 1.0 + 1e-4 * first_psi   # ‖(1, 0, −2)‖ < 10: no clip
  np.testing.assert_allclose(psi[0], first_psi - 0.1 * second_grad, rtol=1e-6)


def test_meta_optimizer_fields_out_of_range_are_refused(tmp_path):
  from configs import fedtta as fedtta_configs
  from fedjax_shift import config as config_lib
  for field, value in (('adapt_momentum', 1.0), ('adapt_momentum', -0.1),
                       ('weight_decay', -1e-4), ('clip_norm', -1.0),
                       ('clip_groups', 'per_layer')):
    config = fedtta_configs.get_config('tiny')
    config.fedtta_prox[field] = value
    with pytest.raises(ValueError, match=f'config.fedtta_prox.{field}'):
      config_lib.validate(config, str(tmp_path))


def test_prox_term_changes_the_update_and_zero_mu_is_fedtta():
  _, _, fedtta, state, client = setup()
  a, _ = fedtta.client_update(state, (), client, jax.random.key(2))
  _, _, prox0, _, _ = setup('fedtta_prox', **{'fedtta_prox.mu': 0.0,
                                              'fedtta_prox.adapt_learning_rate': 0.01})
  b, _ = prox0.client_update(state, (), client, jax.random.key(2))
  chex.assert_trees_all_close(a.update, b.update, rtol=1e-6)
  _, _, prox, _, _ = setup('fedtta_prox', **{'fedtta_prox.mu': 10.0,
                                             'fedtta_prox.adapt_learning_rate': 0.01})
  c, _ = prox.client_update(state, (), client, jax.random.key(2))
  # The KL term is 0 with zero gradient at ψ = ψ_s (the first step) and pulls from the
  # second step on: the updates differ, and only there.
  difference = max(float(jnp.abs(u - v).max()) for u, v in zip(jax.tree.leaves(c.update),
                                                               jax.tree.leaves(a.update)))
  assert difference > 0


def _variables():
  _, module, algorithm, state, client = setup()
  return module, algorithm.global_model(state), client


def test_fedtta_pp_candidates_are_the_steps_unless_the_initial_model_is_included():
  """Algorithm 1 selects the lowest-entropy model among ψ_1 … ψ_stop: where the step
  raises the entropy (H_1 > H_0) the default keeps ψ_1, include_initial keeps ψ_0."""
  module, variables, client = _variables()
  x, weight = client.x[:7], jnp.ones(7)
  entropy = lambda params: float(losses.weighted_entropy(
      models.apply(module, {'params': params}, x)[0], weight))
  adaptation_module = adaptation_module_of(variables[ADAPTATION])
  for rate in (0.5, 2.0, 8.0, 32.0, -0.5, -2.0, -8.0):   # a step that raises H
    stepped = inner_step(module, adaptation_module, variables['params'], variables[ADAPTATION],
                         x, weight, InnerStep(rate, 0.1))
    if entropy(stepped) > entropy(variables['params']) + 1e-4:
      break
  else:
    raise AssertionError('no step raised the entropy')
  run = lambda include: adapt(module, variables, x, weight, Adaptation(
      InnerStep(rate, 0.1), 3, 1, restore_best=True, include_initial=include))
  chosen, steps = run(False)
  assert int(steps) == 1                      # patience 1: stops after the first step
  chex.assert_trees_all_close(chosen, stepped, rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_equal(run(True)[0], variables['params'])


def test_fedtta_pp_test_time_step_clips_and_decays_as_the_authors():
  """clip 10 then weight decay: ψ_1 = ψ − η(clip(∇, c) + λψ), checked with a binding clip."""
  module, variables, client = _variables()
  x, weight = client.x[:7], jnp.ones(7)
  adaptation_module = adaptation_module_of(variables[ADAPTATION])
  params = variables['params']
  plain = inner_step(module, adaptation_module, params, variables[ADAPTATION], x, weight,
                     InnerStep(1.0, 0.1))
  grads = jax.tree.map(lambda p, q: p - q, params, plain)        # η = 1: the gradient
  norm = float(jnp.sqrt(sum(jnp.sum(g ** 2) for g in jax.tree.leaves(grads))))
  clip = norm / 4                                                 # binds
  expected = jax.tree.map(lambda p, g: p - 0.5 * (g * clip / norm + 1e-4 * p), params, grads)
  adapted, _ = adapt(module, variables, x, weight,
                     Adaptation(InnerStep(0.5, 0.1, clip_norm=clip, weight_decay=1e-4)))
  chex.assert_trees_all_close(adapted, expected, rtol=1e-5, atol=1e-6)


def test_adapter_takes_eta_inner_and_epsilon_from_the_trained_method(tmp_path):
  """Eq. 11 = Eq. 5: left at −1 the adapters take each method's η_inner and ε; another
  value is refused before anything trains, naming both fields and the override."""
  from configs import fedtta as fedtta_configs
  from fedjax_shift import config as config_lib
  from fedjax_shift.pipelines.programs import adapter_section
  config = fedtta_configs.get_config('tiny')
  config.fedtta_prox.inner_learning_rate = 0.3
  config_lib.validate(config, str(tmp_path))                  # changing training alone is fine
  assert adapter_section(config, 'fedtta_pp', 'fedtta_prox').inner_learning_rate == 0.3
  assert adapter_section(config, 'fedtta_pp', 'fedtta').inner_learning_rate == 0.5
  assert adapter_section(config, 'fedtta', 'fedtta_prox').norm_epsilon == \
      algorithms.ALGORITHMS.section('fedtta_prox', config).norm_epsilon   # FedTTA's
  config.adapters.fedtta_pp.inner_learning_rate = 0.5
  with pytest.raises(ValueError, match=r'config.adapters.fedtta_pp.inner_learning_rate=0.5 '
                     r'differs from config.fedtta_prox.inner_learning_rate=0.3.*'
                     r'override_training=True'):
    config_lib.validate(config, str(tmp_path))
  config.adapters.fedtta_pp.override_training = True
  config_lib.validate(config, str(tmp_path))
  assert adapter_section(config, 'fedtta_pp', 'fedtta_prox').inner_learning_rate == 0.5


def test_a_small_batch_filled_to_the_training_batch_takes_trainings_step():
  """fill_batch = B: a batch of n < B examples steps as the training batch that repeats
  them to B entries (here n = 4, B = 12: each example three times, weights 1); a batch
  of B or more examples, and fill_batch = 0, take the examples as they are."""
  module, variables, client = _variables()
  x = client.x[:4]
  adaptation_module = adaptation_module_of(variables[ADAPTATION])
  repeated = inner_step(module, adaptation_module, variables['params'], variables[ADAPTATION],
                        jnp.concatenate([x, x, x]), jnp.ones(12), InnerStep(0.5, 0.1))
  padded_x = jnp.concatenate([x, jnp.zeros_like(x)])           # 4 real examples of 8
  weight = jnp.array([1.0] * 4 + [0.0] * 4)
  filled, _ = adapt(module, variables, padded_x, weight,
                    Adaptation(InnerStep(0.5, 0.1), fill_batch=12))
  chex.assert_trees_all_close(filled, repeated, rtol=1e-5, atol=1e-6)
  plain = inner_step(module, adaptation_module, variables['params'], variables[ADAPTATION],
                     x, jnp.ones(4), InnerStep(0.5, 0.1))
  for fill in (0, 4, 3):
    as_is, _ = adapt(module, variables, padded_x, weight,
                     Adaptation(InnerStep(0.5, 0.1), fill_batch=fill))
    chex.assert_trees_all_close(as_is, plain, rtol=1e-5, atol=1e-6)
  with pytest.raises(AssertionError):
    chex.assert_trees_all_close(plain, repeated, rtol=1e-5, atol=1e-6)


def test_fill_batch_defaults_to_the_training_batch_and_bad_values_are_refused(tmp_path):
  from configs import fedtta as fedtta_configs
  from fedjax_shift import config as config_lib
  from fedjax_shift.pipelines.programs import adapter_section
  config = fedtta_configs.get_config('tiny')
  config.client.batch_size = 48
  for name in ('fedtta', 'fedtta_pp'):
    assert adapter_section(config, name, 'fedtta_prox').fill_batch == 48
  config.adapters.fedtta.fill_batch = 0
  assert adapter_section(config, 'fedtta', 'fedtta').fill_batch == 0
  config.adapters.fedtta_pp.fill_batch = -2
  with pytest.raises(ValueError, match=r'fedtta_pp.fill_batch: must be an integer >= 0, or -1'):
    config_lib.validate(config, str(tmp_path))


def test_patience_at_least_e_runs_all_e_steps_like_a_plain_loop():
  module, variables, client = _variables()
  x, weight = client.x[:7], jnp.ones(7)
  adaptation_module = adaptation_module_of(variables[ADAPTATION])
  params = variables['params']
  for _ in range(4):   # the reference: four plain inner steps
    params = inner_step(module, adaptation_module, params, variables[ADAPTATION], x, weight,
                        InnerStep(0.5, 0.1))
  for patience in (0, 4, 9):
    adapted, steps = adapt(module, variables, x, weight,
                           Adaptation(InnerStep(0.5, 0.1), 4, patience))
    assert int(steps) == 4
    chex.assert_trees_all_close(adapted, params, rtol=1e-6, atol=1e-7)


def test_early_stop_fires_when_the_entropy_stops_decreasing():
  """A hand-built case: the entropy after each step is recomputed here with plain
  steps; with patience p the adapter must stop at the first step e where the entropy
  has not gone below its running minimum for p consecutive steps (H_0 counts), and
  return ψ_e."""
  module, variables, client = _variables()
  x, weight = client.x[:7], jnp.ones(7)
  adaptation_module = adaptation_module_of(variables[ADAPTATION])
  lr = 25.0   # large steps so the entropy goes up and down
  params, history, entropies = variables['params'], [variables['params']], []
  from fedjax_shift.parts.losses import weighted_entropy
  entropy = lambda p: float(weighted_entropy(models.apply(module, {'params': p}, x)[0], weight))
  entropies.append(entropy(params))
  for _ in range(12):
    params = inner_step(module, adaptation_module, params, variables[ADAPTATION], x, weight,
                        InnerStep(lr, 0.1))
    history.append(params)
    entropies.append(entropy(params))
  for patience in (1, 2):
    lowest, waited, expected, best = entropies[0], 0, 12, 0
    for e in range(1, 13):
      if entropies[e] < lowest:
        waited, best = 0, e
      else:
        waited += 1
      lowest = min(lowest, entropies[e])
      if waited >= patience:
        expected = e
        break
    for loop in ('scan', 'while'):
      for restore_best, kept in ((False, expected), (True, best)):
        adapted, steps = adapt(module, variables, x, weight,
                               Adaptation(InnerStep(lr, 0.1), 12, patience, loop, restore_best))
        assert int(steps) == expected, (loop, patience, entropies)
        assert patience > 1 or expected < 12, entropies   # the case really stops early
        # (the large steps amplify float32 rounding between the scan and the eager loop)
        chex.assert_trees_all_close(adapted, history[kept], rtol=1e-4, atol=1e-5)
    assert best != expected   # the stop's model and the lowest-entropy one differ here


def test_while_loop_equals_the_masked_scan_vmapped_over_clients():
  """Vmapped over clients that stop at different steps, the while loop (which runs
  until the last one stops) gives each client the masked scan's ψ and step count."""
  module, variables, client = _variables()
  xs = jnp.stack([client.x[:7], client.x[:7] * 0.5, client.x[:7][::-1] * 2.0])
  weight = jnp.ones(7)
  run = lambda loop: jax.vmap(lambda x: adapt(module, variables, x, weight, Adaptation(
      InnerStep(25.0, 0.1), 12, 1, loop)))(xs)
  (scanned, scan_steps), (looped, loop_steps) = run('scan'), run('while')
  np.testing.assert_array_equal(scan_steps, loop_steps)
  assert len(set(np.asarray(scan_steps).tolist())) > 1, scan_steps   # they stop apart
  chex.assert_trees_all_close(scanned, looped, rtol=1e-5, atol=1e-6)


def test_adapter_on_a_model_without_g_and_bad_fields_are_errors():
  module, variables, client = _variables()
  config = tiny_config()
  from fedjax_shift.pipelines.programs import adapter_section
  adapter = ADAPTERS.get('fedtta')(module, adapter_section(config, 'fedtta', 'fedtta'),
                                   SourceContext(None, NUM_CLASSES, 8))
  state = adapter.init(variables, jax.random.key(0))
  _, logits = adapter.step(state, AdaptBatch(client.x[:7], jnp.ones(7)))
  chex.assert_shape(logits, (7, NUM_CLASSES))
  with pytest.raises(ValueError, match='trained by fedtta'):
    adapter.init({'params': variables['params']}, jax.random.key(0))
  config.adapters.fedtta_pp.max_steps = 0
  with pytest.raises(ValueError, match=r'fedtta_pp.max_steps: must be an integer >= 1'):
    ADAPTERS.check('fedtta_pp', config.adapters.fedtta_pp, 'config.adapters.fedtta_pp')
  config.adapters.fedtta_pp.max_steps = 5
  config.adapters.fedtta_pp.loop = 'for'
  with pytest.raises(ValueError, match=r'config.adapters.fedtta_pp.loop'):
    ADAPTERS.check('fedtta_pp', config.adapters.fedtta_pp, 'config.adapters.fedtta_pp')
  config.fedtta.adaptation_size = 'huge'
  with pytest.raises(ValueError, match=r'config.fedtta.adaptation_size'):
    algorithms.build('fedtta', config, module, 7, {})


def test_personalization_loss_is_the_l2_norm_over_real_examples():
  module = models.AdaptationMLP((4,))
  logits = jax.random.normal(jax.random.key(0), (5, NUM_CLASSES))
  params = module.init(jax.random.key(1), logits)['params']
  scores = module.apply({'params': params}, logits)[:, 0]
  weight = jnp.array([1., 1., 0., 1., 0.])
  np.testing.assert_allclose(personalization_loss(module, params, logits, weight, 0.1),
                             np.sqrt(np.sum(np.asarray(scores)[[0, 1, 3]] ** 2) + 0.1),
                             rtol=1e-5)


def upfl_config(**fields):
  from configs import fedtta as fedtta_config
  config = fedtta_config.get_config('tiny')
  set_data(config.data, **fields)
  return config


def test_upfl_splits_new_clients_and_bad_input():
  config = upfl_config(num_clients=20)
  bench = build_benchmark(config.data, 0)
  train, val, test = (bench.splits[s] for s in ('train', 'val', 'test'))
  assert train.num_clients == val.num_clients == test.num_clients == 10
  assert sorted(bench.info['training_clients'] + bench.info['new_clients']['test']) == \
      list(range(20))
  # every example once: 85/15 of the training clients plus all of the new clients'
  assert int(train.num_examples.sum() + val.num_examples.sum() + test.num_examples.sum()) \
      == 5000
  np.testing.assert_allclose(val.num_examples.sum() / (train.num_examples.sum() +
                                                       val.num_examples.sum()), 0.15, atol=0.01)
  # new clients' images are none of the training clients' (disjoint pools)
  train_images = {hash(x.tobytes()) for k in range(10) for x in train.x[k][train.mask[k]]}
  assert not any(hash(x.tobytes()) in train_images
                 for k in range(10) for x in test.x[k][test.mask[k]])
  # 30 % new clients: 14 training, 6 new; the new side is padded with empty clients
  uneven = build_benchmark(upfl_config(num_clients=20, new_client_fraction=0.3).data, 0)
  assert uneven.splits['test'].num_clients == 14
  assert (uneven.splits['test'].num_examples > 0).sum() == 6
  for field, value, match in [('classes_per_client', 11, 'only 10 classes'),
                              ('new_client_fraction', 1.0, 'new_client_fraction')]:
    bad = upfl_config(**{field: value})
    with pytest.raises(ValueError, match=match):
      build_benchmark(bad.data, 0)


def test_new_clients_labels_are_never_read_by_the_adaptation():
  """The FedTTA++ runner on a new client with its true labels and with poisoned
  (permuted, out-of-range-free) labels predicts exactly the same."""
  from fedjax_shift.core.test_time import client_runner
  module, variables, client = _variables()
  config = tiny_config()
  from fedjax_shift.pipelines.programs import adapter_section
  adapter = ADAPTERS.get('fedtta_pp')(module, adapter_section(config, 'fedtta_pp', 'fedtta'),
                                      SourceContext(None, NUM_CLASSES, 4))
  run_one = jax.jit(client_runner(adapter, 4, 'episodic'))
  y = client.y
  poisoned = (y + 1) % NUM_CLASSES
  clean = run_one(variables, client.x, y, client.num_examples, jax.random.key(0))
  dirty = run_one(variables, client.x, poisoned, client.num_examples, jax.random.key(0))
  np.testing.assert_array_equal(clean['predictions'], dirty['predictions'])
  assert float(clean['correct']) != float(dirty['correct'])   # the labels did change


def test_upfl_pipeline_runs_and_scores_personalised_methods_as_pfl_baselines(tmp_path):
  from fedjax_shift import pipelines
  # 30 % new clients: the new-client split is padded with clients holding no data
  config = upfl_config(new_client_fraction=0.3)
  config.algorithms = ('fedtta_prox',)
  out = pipelines.run(config, str(tmp_path / 'ok'))
  metrics = out.records['results'][0]['metrics']
  for key in ('global/val/accuracy', 'global/test/accuracy', 'global+fedtta/test/accuracy',
              'global+fedtta_pp/test/accuracy', 'global+fedtta/test/client_accuracy',
              'global+fedtta/val/accuracy'):   # config.eval_adapter_splits ('test', 'val')
    assert 0.0 <= metrics[key] <= 1.0, key
  # The run records the test-time settings it used, resolved from training's.
  used = json.load(open(tmp_path / 'ok' / 'fedtta_prox' / 'seed_0' / 'results.json'))['adapters']
  assert set(used) == {'fedtta', 'fedtta_pp'}
  trained = algorithms.ALGORITHMS.section('fedtta_prox', config)   # FedTTA's η_inner and ε
  for name in used:
    assert used[name]['inner_learning_rate'] == trained.inner_learning_rate
    assert used[name]['norm_epsilon'] == trained.norm_epsilon
    assert used[name]['fill_batch'] == config.client.batch_size
  # A personalised method has no model for a new client: its own model is scored on the
  # training clients' validation data only, and new clients get PFL-Sampled / -Ensemble.
  config.algorithms = ('fedper',)
  config.eval_adapter_algorithms = ()   # every method run that an adapter adapts: none
  with pytest.raises(ValueError, match=r"config.algorithms: the fedtta adapter adapts models "
                                       r"trained by \['fedtta', 'fedtta_prox'\]; none of "
                                       r"\['fedper'\] is"):
    pipelines.run(config, str(tmp_path / 'fedper'))
  adapters, config.eval_adapters = config.eval_adapters, ()
  metrics = pipelines.run(config, str(tmp_path / 'fedper')).records['results'][0]['metrics']
  assert 'personalized/test/accuracy' not in metrics
  for key in ('personalized/val/accuracy', 'pfl_sampled/test/accuracy',
              'pfl_ensemble/test/accuracy'):
    assert 0.0 <= metrics[key] <= 1.0, key
  # Each method gets only the adapters trained for it: ODPFL-HN's generator, not FedTTA's.
  config.algorithms, config.eval_adapters = ('odpfl_hn',), adapters
  config.eval_adapter_algorithms = ('fedtta', 'odpfl_hn')
  metrics = pipelines.run(config, str(tmp_path / 'odpfl')).records['results'][0]['metrics']
  assert 0.0 <= metrics['global+odpfl_hn/test/accuracy'] <= 1.0
  assert not any(key.startswith('global+fedtta') for key in metrics)
  config.algorithms = ('fedavg',)
  config.eval_adapter_algorithms = ('fedavg',)
  with pytest.raises(ValueError, match=r"config.eval_adapter_algorithms: the fedtta adapter "
                                       r"adapts models trained by \['fedtta', 'fedtta_prox'\]"):
    pipelines.run(config, str(tmp_path / 'fedavg'))
  config.eval_adapter_algorithms = ('fedtta', 'odpfl_hn', 'fedavg')
  with pytest.raises(ValueError, match=r'config.eval_adapter_algorithms: no adapter of '
                                       r'config.eval_adapters adapts fedavg'):
    pipelines.run(config, str(tmp_path / 'fedavg'))


def test_pfl_sampled_and_ensemble_equal_a_loop_over_training_models():
  """PFL-Sampled = the donor's personalised model; PFL-Ensemble = argmax of the mean
  logits of the training clients that have data (client 2 has none and is left out)."""
  from fedjax_shift.core import evaluation
  from fedjax_shift.core.round import stack_client_states
  config = tiny_config(**{'model.hidden': (6,)})
  module = models.create(config.model, NUM_CLASSES)
  train, _, _ = toy_clients([5, 4, 0], num_classes=NUM_CLASSES)
  new, _, _ = toy_clients([6, 3], num_classes=NUM_CLASSES, seed=1)
  fedper = algorithms.build('fedper', config, module, train.max_examples)
  server = fedper.init(jax.random.key(0), jnp.asarray(train.x[0, :1]))
  heads = stack_client_states(fedper, server, train.num_clients)
  heads = jax.tree.map(lambda h: h + jax.random.normal(jax.random.key(1), h.shape), heads)
  personalized_models, evaluate_chunk = evaluation.build_new_client_evaluate(fedper, module, 4)
  stacked = personalized_models(server, heads, train, jax.random.key(2))
  has_data = jnp.asarray(train.num_examples > 0)
  donors = jnp.array([1, 0], jnp.int32)
  sums = evaluate_chunk(stacked, has_data, new, donors, None, None)
  logits = [[models.apply(module, fedper.personalize(server, jax.tree.map(lambda h: h[j], heads),
                                                     None, None), new.x[c])[0]
             for j in range(3)] for c in range(2)]
  for c in range(2):
    real = new.mask[c]
    sampled = np.argmax(logits[c][int(donors[c])], -1)
    ensemble = np.argmax((logits[c][0] + logits[c][1]) / 2, -1)
    assert float(sums['pfl_sampled']['correct'][c]) == np.sum((sampled == new.y[c]) & real)
    assert float(sums['pfl_ensemble']['correct'][c]) == np.sum((ensemble == new.y[c]) & real)
    assert float(sums['pfl_ensemble']['count'][c]) == real.sum()


def test_upfl_degree_of_shift_and_concept_shift_splits():
  from fedjax_shift.data import sources
  upfl = build_benchmark
  # Table 2: training clients from one pool (pathological here), new clients from a
  # disjoint pool with Dirichlet(0.01).
  bench = upfl(upfl_config(num_clients=20, new_client_alpha=0.01).data, 0)
  train, val, test = (bench.splits[s] for s in ('train', 'val', 'test'))
  assert int(test.num_examples.sum()) == 2500    # new_client_fraction of the 5,000
  assert int(train.num_examples.sum() + val.num_examples.sum()) == 2500
  train_images = {hash(x.tobytes()) for k in range(10) for x in train.x[k][train.mask[k]]}
  assert not any(hash(x.tobytes()) in train_images
                 for k in range(10) for x in test.x[k][test.mask[k]])
  # Dir(0.01) per class: each class's new examples sit almost all with one new client
  counts = np.stack([np.bincount(test.y[k][test.mask[k]], minlength=10) for k in range(10)])
  assert np.mean(counts.max(0) / counts.sum(0)) > 0.9
  # Concept shift: the same clients as without rotations, new client k's images
  # rotated by new_rotations[k mod 2]; training clients at 0° are unchanged.
  plain = upfl(upfl_config(num_clients=20).data, 0)
  shifted = upfl(upfl_config(num_clients=20, train_rotations=(0,),
                             new_rotations=(15, 45)).data, 0)
  np.testing.assert_array_equal(shifted.splits['train'].x, plain.splits['train'].x)
  for k in range(3):
    real = plain.splits['test'].mask[k]
    np.testing.assert_array_equal(shifted.splits['test'].x[k][real],
                                  sources.rotate(plain.splits['test'].x[k][real],
                                                 (15, 45)[k % 2]))
  assert shifted.info['rotations']['test_clients'][:4] == [15.0, 45.0, 15.0, 45.0]
  # App. F: 1,000 sampled digits, IID over 50 clients (20 each), each client's angle
  # drawn from its side's list; every new client's images are its own digits rotated
  config = upfl_config(num_clients=50, partition='iid', sample_examples=1000,
                       train_rotations=(0, 30, 60), new_rotations=(15, 45),
                       rotation_choice='random')
  app_f = upfl(config.data, 0)
  unrotated = upfl(upfl_config(num_clients=50, partition='iid', sample_examples=1000).data, 0)
  counts = [app_f.splits[s].num_examples for s in ('train', 'val', 'test')]
  assert int(sum(c.sum() for c in counts)) == 1000
  assert set((counts[0] + counts[1]).tolist()) == {20} and set(counts[2].tolist()) == {20}
  angles = app_f.info['rotations']
  assert set(angles['train_clients']) == {0.0, 30.0, 60.0}      # 25 draws cover all three
  assert set(angles['test_clients']) == {15.0, 45.0}
  assert angles['train_clients'] != [(0.0, 30.0, 60.0)[k % 3] for k in range(25)]
  for k in range(3):
    real = unrotated.splits['test'].mask[k]
    np.testing.assert_array_equal(app_f.splits['test'].x[k][real], sources.rotate(
        unrotated.splits['test'].x[k][real], angles['test_clients'][k]))
  for fields, match in [({'new_client_alpha': -1.0}, 'config.data.upfl.new_client_alpha'),
                        ({'rotation_choice': 'spin'}, 'config.data.upfl.rotation_choice'),
                        ({'sample_examples': -1}, 'config.data.upfl.sample_examples'),
                        ({'new_rotations': (15,)}, 'config.data.upfl.train_rotations')]:
    with pytest.raises(ValueError, match=match):
      check_data(upfl_config(**fields).data)


def test_fedtta_probe_reproduces_the_engines_adapted_columns(tmp_path):
  """The FedTTA probe (fedjax_shift/papers/fedtta/probe.py) recomputes one step (FedTTA) and patience-1 early stopping
  with the lowest-entropy model (FedTTA++, restore_best) from plain inner steps: both
  must equal the engine's adapter columns of the same run (one batch per client)."""
  from fedjax_shift.papers.fedtta import probe
  config = upfl_config()
  config.progress = False
  config.rounds = 2
  config.eval_adapter_batch_size = 512    # ≥ a tiny client's examples: one batch each
  row = probe.probe_seed(config, str(tmp_path), 'fedtta_prox', 0)
  np.testing.assert_allclose(row['step_1'], row['engine_global+fedtta'], atol=2e-3)
  np.testing.assert_allclose(row['patience_1_best'], row['engine_global+fedtta_pp'], atol=2e-3)
  assert 0 < row['patience_1_mean_stop'] <= config.adapters.fedtta_pp.max_steps
  assert probe.stop_and_best(np.array([3.0, 2.0, 2.5, 1.0]), 1) == (2, 1)
  assert probe.stop_and_best(np.array([3.0, 2.0, 2.5, 1.0]), 2) == (3, 3)
  # H_0 lowest: Algorithm 1 keeps step 1, the released code's candidates keep step 0.
  assert probe.stop_and_best(np.array([1.0, 2.0, 3.0]), 1) == (1, 1)
  assert probe.stop_and_best(np.array([1.0, 2.0, 3.0]), 1, include_initial=True) == (1, 0)


def test_upfl_table_rows_workdirs_and_best_validation_round():
  from fedjax_shift.papers.fedtta import tables as report
  evaluations = [{'round': 10, 'global/val/accuracy': 0.8, 'global/test/accuracy': 0.7},
                 {'round': 20, 'global/val/accuracy': 0.9, 'global/test/accuracy': 0.6},
                 {'round': 30, 'global/val/accuracy': 0.85, 'global/test/accuracy': 0.9}]
  main = [{'algorithm': 'fedavg', 'metrics': evaluations[-1], 'evaluations': evaluations}]
  tent_metrics = {'global/val/accuracy': 0.5, 'global/test/accuracy': 0.5,
                  'global+tent/val/accuracy': 0.4, 'global+tent/test/accuracy': 0.3}
  tent = [{'algorithm': 'fedavg', 'metrics': tent_metrics}]
  last = report.upfl_table({'main': main, 'tent': tent})
  assert '| FedAvg | 85.00 | 90.00 |' in last          # the main run's last round
  assert '| TENT | 40.00 | 30.00 |' in last            # from the BatchNorm workdir
  assert 'FedTTA' not in last                          # rows no run has are left out
  best = report.upfl_table({'main': main, 'tent': tent}, best_validation=True)
  assert '| FedAvg | 90.00 | 60.00 |' in best          # round 20: best validation
  assert '| TENT | 40.00 | 30.00 |' in best            # no evaluations: the last round
  fedtta = [{'algorithm': 'fedtta', 'metrics': {'global+fedtta/val/accuracy': 0.9,
                                                'global+fedtta/test/accuracy': 0.8}},
            {'algorithm': 'fedtta', 'metrics': {}, 'diverged': 'NaN in round 3'}]
  assert '| FedTTA | 90.00 | 80.00 (1 of 2 diverged) |' in report.upfl_table({'m': fedtta})
  # Table 2 layout: one Test column per group; a group merges its workdirs; Validation
  # from the first group that has the row; a row one group lacks reads n/a there.
  shifted = [{'algorithm': 'fedtta', 'metrics': {'global+fedtta/val/accuracy': 0.7,
                                                 'global+fedtta/test/accuracy': 0.6}}]
  table2 = report.upfl_shift_table({'a=0.01': {'main': main, 'tent': tent},
                                    'a=0.5': {'shift': shifted}})
  assert '| Method | Validation | Test (a=0.01) | Test (a=0.5) |' in table2
  assert '| FedAvg | 85.00 | 90.00 | n/a |' in table2
  assert '| TENT | 40.00 | 30.00 | n/a |' in table2
  assert '| FedTTA | 70.00 | n/a | 60.00 |' in table2


def test_fashion_mnist_variant_is_table_4s_column_on_a_70000_image_partition(tmp_path):
  """configs/fedtta.py:fashion_mnist on generated IDX files of Fashion-MNIST's sizes
  (60,000 + 10,000, 7,000 per class): 100 clients of 700 (200 shards of 350, two each),
  50 training clients of 595 / 105 and 50 new clients of 700; every method at its
  Table 4 (Fashion-MNIST) rate, the authors' clip 10 on each step."""
  import importlib
  from fedjax_shift.algorithms.base import method_client
  from test_offline_sources import write_fashion_mnist_like
  config = importlib.import_module('configs.fedtta').get_config('fashion_mnist')
  assert (config.data.source, config.data.tfds_split, config.rounds) == \
      ('fashion_mnist', 'train+test', 300)
  assert (config.model.name, tuple(config.model.channels), config.model.features) == \
      ('lenet5', (32, 64), 512)
  rates = {name: (method_client(config, name).learning_rate, method_client(config, name).clip_norm)
           for name in config.algorithms}
  assert rates == {'fedavg': (0.3, 10.0), 'fedprox': (0.3, 10.0), 'scaffold': (0.1, 10.0),
                   'afl': (0.3, 10.0), 'gma': (0.3, 10.0), 'fedadg': (0.3, 10.0),
                   'fedsr': (0.3, 10.0), 'fedper': (0.3, 10.0), 'odpfl_hn': (0.1, 10.0),
                   'fedtta': (0.1, 0.0), 'fedtta_prox': (0.1, 0.0)}
  assert (config.fedtta.inner_learning_rate, config.fedtta.adapt_learning_rate,
          config.fedtta_prox.mu, config.adapters.fedtta_pp.patience,
          config.gma.global_learning_rate, config.eval_adapter_batch_size) == \
      (0.05, 0.001, 0.001, 5, 1.5, 700)
  write_fashion_mnist_like(str(tmp_path))
  config.data.data_dir = str(tmp_path)
  bench = build_benchmark(config.data, 0)
  train, val, test = (bench.splits[s] for s in ('train', 'val', 'test'))
  assert bench.example_shape == (28, 28, 1)
  np.testing.assert_array_equal(train.num_examples, [595] * 50)
  np.testing.assert_array_equal(val.num_examples, [105] * 50)
  np.testing.assert_array_equal(test.num_examples, [700] * 50)
  for split in (train, test):   # at most two classes per client, 350 of each shard
    for k in range(50):
      assert len(np.unique(split.y[k][split.mask[k]])) <= 2


def test_first_round_probe_counts_diverged_clients_and_the_clip_bounds_them():
  """papers/fedtta/first_round.py on the tiny UPFL split: at client rate 100 the
  unclipped MLP ends non-finite on some client or reaches a batch loss far above the
  initial ≈ log 10 = 2.30 (ten near-uniform classes), while a clip at 1e-6 moves each
  of the 2 steps by at most 100 · 1e-6, so the clients' median last loss stays near
  log 10 (within 0.5: the initial outputs are not exactly uniform)."""
  import importlib
  from fedjax_shift.papers.fedtta.first_round import client_batches, first_round
  order = client_batches(5, 2, 4, np.random.default_rng(0))
  assert order.shape == (4, 2) and sorted(order.ravel()[:5]) == [0, 1, 2, 3, 4]
  config = importlib.import_module('configs.fedtta').get_config('tiny')
  config.client.learning_rate = 100.0
  rows = first_round(config, [0.0, 1e-6])
  unclipped, clipped = rows[0.0], rows[1e-6]
  assert unclipped['clients'] == clipped['clients'] == 6
  assert unclipped['nonfinite_clients'] > 0 or unclipped['max_loss'] > 10
  assert clipped['nonfinite_clients'] == 0
  assert abs(clipped['median_final_loss'] - np.log(10)) < 0.5
