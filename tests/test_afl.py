"""AFL (Mohri et al. 2019): the simplex projection, λ = 1/N with γ_λ = 0, the λ ascent."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_shift import algorithms, models
from fedjax_shift.algorithms.afl import simplex_threshold
from fedjax_shift.core.round import RoundConfig, build_round, stack_client_states
from helpers import tiny_config, toy_clients

NUM_CLASSES = 3


def make(name, config, data, num_clients):
  module = models.create(config.model, NUM_CLASSES)
  algorithm = algorithms.build(name, config, module, data.max_examples,
                               num_clients=num_clients)
  server = algorithm.init(jax.random.key(0), jnp.asarray(data.x[0, :1]))
  return module, algorithm, server, stack_client_states(algorithm, server, data.num_clients)


def afl_round(sizes, lambda_learning_rate):
  """One AFL round over every client of ``sizes`` (a client per size, cohort = all)."""
  config = tiny_config(**{'client.batch_size': 4, 'afl.lambda_learning_rate':
                          lambda_learning_rate, 'cohort_size': len(sizes)})
  data, _, _ = toy_clients(sizes, num_classes=NUM_CLASSES)
  module, afl, server, lambdas = make('afl', config, data, len(sizes))
  out = build_round(afl, RoundConfig(cohort_size=len(sizes)))[0](server, lambdas, data,
                                                                 jax.random.key(1))
  return module, server, data, out


def weights_after(out):
  """λ_k = max(μ_k − τ, 0) as the clients will apply them next round."""
  return np.maximum(np.asarray(out.client_states) - float(out.server_state.threshold), 0)


def project(values):
  return np.maximum(values - float(simplex_threshold(jnp.asarray(values))), 0.0)


def test_simplex_projection_closed_forms_and_optimality():
  np.testing.assert_allclose(project(np.array([0.5, 0.5, 0.5])), [1 / 3] * 3, atol=1e-6)
  np.testing.assert_allclose(project(np.array([2.0, 0.0, 0.0])), [1.0, 0.0, 0.0], atol=1e-6)
  np.testing.assert_allclose(project(np.array([0.3, 0.2, 0.1])), [0.3 + 0.4 / 3,
                                                                  0.2 + 0.4 / 3,
                                                                  0.1 + 0.4 / 3], atol=1e-6)
  values = np.random.default_rng(0).normal(size=7)
  p = project(values)
  assert abs(p.sum() - 1) < 1e-5 and (p >= 0).all()
  # KKT: values − p is the same τ on the support and ≥ τ... i.e. values ≤ τ off it
  tau = float(simplex_threshold(jnp.asarray(values)))
  np.testing.assert_allclose((values - p)[p > 0], tau, atol=1e-5)
  assert (values[p == 0] <= tau + 1e-6).all()


def test_zero_lambda_rate_is_uniformly_weighted_fedavg():
  # γ_λ = 0: λ stays 1/N, so the server step is FedAvg with uniform client weights.
  config = tiny_config(**{'client.batch_size': 4, 'afl.lambda_learning_rate': 0.0,
                          'cohort_size': 3})
  data, _, _ = toy_clients([6, 9, 4], num_classes=NUM_CLASSES)
  _, fedavg, server, clients = make('fedavg', config, data, 3)
  _, afl, afl_server, lambdas = make('afl', config, data, 3)
  key = jax.random.key(3)
  uniform = RoundConfig(cohort_size=3, weighting='uniform')
  a = build_round(fedavg, uniform)[0](server, clients, data, key)
  b = build_round(afl, RoundConfig(cohort_size=3))[0](afl_server, lambdas, data, key)
  chex.assert_trees_all_close(a.server_state.variables, b.server_state.variables, atol=1e-6)
  np.testing.assert_allclose(weights_after(b), [1 / 3] * 3, atol=1e-6)


def test_lambda_ascends_on_the_client_losses():
  # After round 1: λ = Π_Δ(1/N + γ_λ L) with L the clients' losses under the initial w.
  module, server, data, out = afl_round([6, 9, 4], 0.5)
  losses = []
  for k in range(3):
    n = int(data.num_examples[k])
    logits = module.apply(server.variables, data.x[k, :n])
    losses.append(float(jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
        logits, data.y[k, :n]))))
  expected = project(1 / 3 + 0.5 * np.array(losses))
  got = weights_after(out)
  np.testing.assert_allclose(got, expected, atol=1e-5)
  assert got.argmax() == int(np.argmax(losses))


def test_afl_needs_every_client_in_every_round():
  config = tiny_config(**{'cohort_size': 2})
  data, _, _ = toy_clients([6, 9, 4], num_classes=NUM_CLASSES)
  with pytest.raises(ValueError, match='config.cohort_size: AFL'):
    make('afl', config, data, 3)


def test_a_client_without_data_gets_no_weight():
  # Clients {6, 9, 4} plus an empty one: after a round the empty client's λ is 0 and the
  # others' λ is the projection over them alone; the model equals the run without it.
  _, _, _, out = afl_round([6, 9, 4, 0], 0.5)
  got = weights_after(out)
  assert got[3] == 0.0 and abs(got.sum() - 1) < 1e-5
  # round 1 used λ = 1/4 for the three with data: the same mixture as 1/3 each
  _, _, _, out3 = afl_round([6, 9, 4], 0.5)
  np.testing.assert_allclose(project(np.array([1.0, 2.0, -np.inf])), [0.0, 1.0, 0.0],
                             atol=1e-6)
  assert np.isfinite(np.asarray(out.server_state.threshold))
  chex.assert_trees_all_close(out.server_state.variables, out3.server_state.variables,
                              atol=1e-6)
