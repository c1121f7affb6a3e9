"""Tent's per-layer rates as differentiable inputs (adapters/learned_rates.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_shift import models
from fedjax_shift.adapters import learned_rates
from fedjax_shift.adapters.tent import tent
from fedjax_shift.core.test_time import build_test_time
from tests.helpers import toy_clients

NUM_CLASSES = 3
BATCH = 4


def setup(dtype=jnp.float32):
  module = models.MODELS.get('bn_mlp')(NUM_CLASSES, hidden=(6, 5))
  variables = models.init(module, jax.random.key(0), jnp.zeros((1, 4, 4, 1)))
  variables = jax.tree.map(lambda leaf: leaf.astype(dtype), variables)
  data, _, _ = toy_clients([12, 7], num_classes=NUM_CLASSES)   # K = 3 batches of 4
  return module, variables, data


def test_rates_frozen_at_tents_rate_give_tents_predictions():
  module, variables, data = setup()
  log_rates = learned_rates.init_log_rates(variables, 1e-3)
  assert sorted(log_rates) == ['encoder/BatchNorm_0', 'encoder/BatchNorm_1']
  for predict in ('before', 'after'):
    fixed = build_test_time(tent(module, 1e-3, predict), BATCH, 'online')(
        variables, data, jax.random.key(1))
    learned = build_test_time(learned_rates.rated_tent(module, log_rates, predict), BATCH,
                              'online')(variables, data, jax.random.key(1))
    np.testing.assert_array_equal(learned['predictions'], fixed['predictions'])
    np.testing.assert_allclose(learned['loss'], fixed['loss'], rtol=1e-6)


def objective(module, variables, data, remat=False):
  x, y, n = (jnp.asarray(a[0]) for a in (data.x, data.y, data.num_examples))

  def loss(log_rates):
    adapter = learned_rates.rated_tent(module, log_rates, predict='after')
    return learned_rates.k_step_loss(adapter, BATCH, variables, x, y, n, jax.random.key(2),
                                     remat)
  return loss


def test_k_step_gradient_equals_central_finite_difference_in_float64():
  # The gradient through K = 3 online Tent steps (Adam, per-layer rates) against a
  # central difference of the same objective, both in float64.
  with jax.enable_x64(True):
    module, variables, data = setup(jnp.float64)
    loss = objective(module, variables, data)
    log_rates = {k: jnp.asarray(v, jnp.float64) for k, v in
                 learned_rates.init_log_rates(variables, 0.05).items()}
    grad = jax.grad(loss)(log_rates)
    step = 1e-5
    for layer in log_rates:
      up = {**log_rates, layer: log_rates[layer] + step}
      down = {**log_rates, layer: log_rates[layer] - step}
      numeric = (loss(up) - loss(down)) / (2 * step)
      assert abs(float(grad[layer])) > 1e-6          # the rate matters
      np.testing.assert_allclose(float(grad[layer]), float(numeric), rtol=1e-5, atol=1e-9)


def test_remat_gives_the_same_gradient():
  module, variables, data = setup()
  log_rates = learned_rates.init_log_rates(variables, 0.05)
  plain = jax.grad(objective(module, variables, data))(log_rates)
  remat = jax.grad(objective(module, variables, data, remat=True))(log_rates)
  for layer in log_rates:
    np.testing.assert_allclose(remat[layer], plain[layer], rtol=1e-5, atol=1e-8)


def test_a_model_without_batch_norm_has_no_rates_to_learn():
  module = models.MODELS.get('mlp')(NUM_CLASSES, hidden=(4,))
  variables = models.init(module, jax.random.key(0), jnp.zeros((1, 4, 4, 1)))
  with pytest.raises(ValueError, match='BatchNorm'):
    learned_rates.init_log_rates(variables, 1e-3)


def test_a_federated_round_of_rates_equals_the_mean_of_each_clients_sgd_step():
  # Reference: each client's gradient of its own K-step objective (its stream drawn with
  # its engine key, core/round.py: fold_in(fold_in(round key, 1), client id)), one SGD
  # step, the unweighted mean over the cohort.
  from fedjax_shift.core.round import RoundConfig, build_round
  module, variables, data = setup()
  log_rates = learned_rates.init_log_rates(variables, 0.05)
  make = lambda rates: learned_rates.rated_tent(module, rates, predict='after')
  algorithm = learned_rates.rates_training(make, log_rates, variables, BATCH, num_batches=2,
                                           learning_rate=0.5)
  state = algorithm.init(None, None)
  key = jax.random.key(4)
  out = build_round(algorithm, RoundConfig(cohort_size=2, weighting='uniform'))[1](
      state, (), data, jnp.arange(2), key)
  deltas = []
  for k in range(2):
    one = jax.tree.map(lambda a: jnp.asarray(a[k]), data)
    rng = jax.random.fold_in(jax.random.fold_in(key, 1), k)
    indices, count = learned_rates.client_stream(one.x, one.mask, one.num_examples, 2, BATCH,
                                                 jax.random.fold_in(rng, 0))
    grad = jax.grad(lambda r: learned_rates.k_step_loss(
        make(r), BATCH, variables, one.x[indices], one.y[indices], count,
        jax.random.fold_in(jax.random.fold_in(rng, 0), 1)))(log_rates)
    deltas.append({layer: -0.5 * g for layer, g in grad.items()})
  for layer in log_rates:
    expected = log_rates[layer] + (deltas[0][layer] + deltas[1][layer]) / 2
    np.testing.assert_allclose(out.server_state.rates[layer], expected, rtol=1e-5)
    assert abs(float(out.server_state.rates[layer] - log_rates[layer])) > 1e-6
  with pytest.raises(ValueError, match='K must be >= 1'):
    learned_rates.rates_training(make, log_rates, variables, BATCH, 0, 0.5)
