"""SCAFFOLD (Karimireddy et al. 2020, Alg. 1 option II) against FedAvg and a hand loop."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_shift import algorithms, models
from fedjax_shift.core.algorithm import ClientData
from fedjax_shift.core.round import NO_STEP_LIMIT, RoundConfig, build_round, stack_client_states
from helpers import tiny_config, toy_clients

NUM_CLASSES = 3


def make(name, config, data, num_clients=None):
  module = models.create(config.model, NUM_CLASSES)
  algorithm = algorithms.build(name, config, module, data.max_examples,
                               num_clients=num_clients)
  server = algorithm.init(jax.random.key(0), jnp.asarray(data.x[0, :1]))
  return module, algorithm, server, stack_client_states(algorithm, server, data.num_clients)


def client_data(data, k):
  return ClientData(*(jnp.asarray(a[k]) for a in data), jnp.int32(NO_STEP_LIMIT))


def full_batch_gradient(module, params, data, k):
  n = int(data.num_examples[k])
  x, y = data.x[k, :n], data.y[k, :n]
  return jax.grad(lambda p: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
      module.apply({'params': p}, x), y)))(params)


def test_zero_control_variates_and_one_local_step_equal_fedavg():
  # One step on the whole client (batch ≥ its examples), c = c_i = 0, η_g = 1:
  # y − x = −η_l ∇f_i(x), exactly FedAvg's client delta.
  config = tiny_config(**{'client.batch_size': 16, 'client.local_epochs': 1,
                          'scaffold.global_learning_rate': 1.0})
  data, _, _ = toy_clients([6, 9, 4], num_classes=NUM_CLASSES)
  _, fedavg, server, clients = make('fedavg', config, data)
  _, scaffold, scaffold_server, controls = make('scaffold', config, data)
  chex.assert_trees_all_equal(server.variables, scaffold_server.variables)
  key = jax.random.key(3)
  a = build_round(fedavg, RoundConfig(cohort_size=3))[0](server, clients, data, key)
  b = build_round(scaffold, RoundConfig(cohort_size=3))[0](scaffold_server, controls, data, key)
  chex.assert_trees_all_close(a.server_state.variables, b.server_state.variables, atol=1e-6)


def test_control_variates_after_one_step_are_the_client_gradients():
  # Option II with K = 1 full-batch step: c_i⁺ = c_i − c + (x − y)/η = ∇f_i(x); the
  # server's c = (|S|/N) Σ w_i c_i⁺ with |S|/N = 3/4 (3 of 4 clients sampled).
  config = tiny_config(**{'client.batch_size': 16, 'client.local_epochs': 1})
  data, _, _ = toy_clients([6, 9, 4, 5], num_classes=NUM_CLASSES)
  module, scaffold, server, controls = make('scaffold', config, data, num_clients=4)
  out = build_round(scaffold, RoundConfig(cohort_size=3))[0](server, controls, data,
                                                             jax.random.key(5))
  cohort = np.asarray(out.metrics['cohort'])
  params = server.variables['params']
  gradients = [full_batch_gradient(module, params, data, k) for k in cohort]
  for k, gradient in zip(cohort, gradients):
    chex.assert_trees_all_close(jax.tree.map(lambda c: c[k], out.client_states), gradient,
                                atol=1e-5)
  unsampled = sorted(set(range(4)) - set(cohort.tolist()))[0]
  chex.assert_trees_all_equal(jax.tree.map(lambda c: c[unsampled], out.client_states),
                              jax.tree.map(jnp.zeros_like, params))
  weights = data.num_examples[cohort] / data.num_examples[cohort].sum()
  expected = jax.tree.map(lambda *g: 0.75 * sum(w * gi for w, gi in zip(weights, g)),
                          *gradients)
  chex.assert_trees_all_close(out.server_state.control, expected, atol=1e-5)


def test_local_steps_follow_the_corrected_gradient():
  # A hand loop of y ← y − η(∇f_i(y) − c_i + c) over 3 full-batch steps, from given
  # nonzero c, c_i; then Δc = (c_i⁺ − c_i) = −c + (x − y)/(3η).
  # batch = the client's 7 examples, 3 fixed steps: each step sees all of them.
  config = tiny_config(**{'client.batch_size': 7, 'client.local_steps': 3,
                          'client.learning_rate': 0.2})
  data, _, _ = toy_clients([7], num_classes=NUM_CLASSES)
  module, scaffold, server, _ = make('scaffold', config, data)
  params = server.variables['params']
  rng = np.random.default_rng(0)
  control = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype) * 0.1,
                         params)
  client_control = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype) * 0.1,
                                params)
  server = server._replace(control=control)
  output, new_control = scaffold.client_update(server, client_control, client_data(data, 0),
                                               jax.random.key(0))
  y = params
  for _ in range(3):
    gradient = full_batch_gradient(module, y, data, 0)
    y = jax.tree.map(lambda p, g, ci, c: p - 0.2 * (g - ci + c), y, gradient, client_control,
                     control)
  chex.assert_trees_all_close(output.update.model['params'],
                              jax.tree.map(jnp.subtract, y, params), atol=1e-5)
  expected_control = jax.tree.map(lambda ci, c, x, yy: ci - c + (x - yy) / (3 * 0.2),
                                  client_control, control, params, y)
  chex.assert_trees_all_close(new_control, expected_control, atol=1e-4)
  chex.assert_trees_all_close(output.update.control,
                              jax.tree.map(jnp.subtract, expected_control, client_control),
                              atol=1e-4)


def test_global_learning_rate_scales_the_model_step_and_bad_values_are_errors():
  config = tiny_config(**{'client.batch_size': 16, 'scaffold.global_learning_rate': 1.0})
  data, _, _ = toy_clients([6, 9], num_classes=NUM_CLASSES)
  _, one, server, controls = make('scaffold', config, data)
  config.scaffold.global_learning_rate = 1.5
  _, one_half, _, _ = make('scaffold', config, data)
  key = jax.random.key(1)
  a = build_round(one, RoundConfig(cohort_size=2))[0](server, controls, data, key)
  b = build_round(one_half, RoundConfig(cohort_size=2))[0](server, controls, data, key)
  x = server.variables['params']
  chex.assert_trees_all_close(
      jax.tree.map(lambda p, q: 1.5 * (p - q), a.server_state.variables['params'], x),
      jax.tree.map(jnp.subtract, b.server_state.variables['params'], x), atol=1e-6)
  config.scaffold.global_learning_rate = 0.0
  try:
    make('scaffold', config, data)
  except ValueError as e:
    assert 'scaffold.global_learning_rate' in str(e)
  else:
    raise AssertionError('η_g = 0 was accepted')


def test_float64_control_variate_agrees_with_a_float64_reference():
  """In a float64 run, c_i⁺ = c_i − c + (x − y)/(K·η_l) with K·η_l in float64: K = 4
  steps of η_l = 0.1 (0.4, which float32 rounds to 0.4000000060) give the client's
  control to 1e-12 of the formula evaluated in numpy float64 on its own delta."""
  config = tiny_config(**{'client.batch_size': 2, 'client.local_epochs': 1,
                          'client.learning_rate': 0.1})
  data, _, _ = toy_clients([8], num_classes=NUM_CLASSES)
  with jax.enable_x64(True):
    data = data._replace(x=data.x.astype(np.float64))
    _, scaffold, server, controls = make('scaffold', config, data)
    server = jax.tree.map(lambda a: a.astype(jnp.float64) if jnp.issubdtype(
        a.dtype, jnp.floating) else a, server)
    controls = jax.tree.map(lambda a: a.astype(jnp.float64), controls)
    out, control = scaffold.client_update(server, jax.tree.map(lambda c: c[0], controls),
                                          client_data(data, 0), jax.random.key(1))
    assert float(out.metrics['num_steps']) == 4
    expected = jax.tree.map(lambda d: -np.asarray(d, np.float64) / (4 * 0.1),
                            out.update.model['params'])
    chex.assert_trees_all_equal_dtypes(control, expected)
    chex.assert_trees_all_close(control, expected, rtol=1e-12, atol=0)
