"""MOON and FedDC (FedIns Table 1 baselines): closed forms against FedAvg / SCAFFOLD."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_shift.algorithms import moon
from fedjax_shift.core.round import RoundConfig, build_round
from helpers import build_method, override, tiny_config, toy_clients

NUM_CLASSES = 3


def make(name, config, data):
  return build_method(name, config, data, NUM_CLASSES)[1:]


def one_round(name, config, data, server=None, clients=None):
  algorithm, fresh_server, fresh_clients = make(name, config, data)
  server = fresh_server if server is None else server
  clients = fresh_clients if clients is None else clients
  out = build_round(algorithm, RoundConfig(cohort_size=data.num_clients))[1](
      server, clients, data, jnp.arange(data.num_clients), jax.random.key(7))
  return out.server_state, out.client_states


def test_moon_contrastive_loss_closed_form():
  # τ = 0.5: z = z_glob (cos 1) and z ⟂ z_prev (cos 0): −log(e²/(e² + 1)) = log(1 + e⁻²);
  # identical global and previous representations: log 2.
  z = jnp.array([[1.0, 0.0]])
  np.testing.assert_allclose(moon.contrastive_loss(z, z, jnp.array([[0.0, 3.0]]), 0.5),
                             [np.log1p(np.exp(-2.0))], rtol=1e-6)
  np.testing.assert_allclose(moon.contrastive_loss(z, 2 * z, 5 * z, 0.5), [np.log(2.0)],
                             rtol=1e-6)


def test_moon_with_mu_zero_is_fedavg_and_keeps_each_clients_model():
  config = tiny_config(**{'model.name': 'mlp', 'moon.mu': 0.0})
  data, _, _ = toy_clients([6, 9, 4], num_classes=NUM_CLASSES)
  moon_server, moon_clients = one_round('moon', config, data)
  fedavg_server, _ = one_round('fedavg', config, data)
  chex.assert_trees_all_close(moon_server.variables, fedavg_server.variables, rtol=1e-5,
                              atol=1e-7)
  # Each client's previous model is now its own local model, not the average.
  first = jax.tree.map(lambda a: a[0], moon_clients)
  second = jax.tree.map(lambda a: a[1], moon_clients)
  assert not np.allclose(first['params']['head']['kernel'], second['params']['head']['kernel'])


def test_moon_term_changes_the_update_after_the_first_round():
  # Round 1: previous = global, so ℓ_con's two similarities start equal; from round 2 the
  # previous model differs and μ > 0 moves the update away from FedAvg's.
  config = tiny_config(**{'model.name': 'mlp'})
  data, _, _ = toy_clients([6, 9], num_classes=NUM_CLASSES)
  server, clients = one_round('moon', config, data)
  with_mu, _ = one_round('moon', config, data, server, clients)
  without, _ = one_round('moon', override(config, **{'moon.mu': 0.0}), data, server, clients)
  # ℓ_con reads the encoder's representation: it moves the encoder, not the head.
  changed = [not np.allclose(a, b, atol=1e-7) for a, b in zip(
      jax.tree.leaves(with_mu.variables['params']['encoder']),
      jax.tree.leaves(without.variables['params']['encoder']))]
  assert any(changed)
  chex.assert_tree_all_finite(with_mu)


def test_feddc_first_round_closed_form():
  # Round 1 with α = 0: h_i = 0 and c = c_i = 0, so every client trains as in FedAvg
  # (Δ_i the same); every client in the cohort (|S| = N): h̄ = Σ p Δ, and the broadcast
  # model w₁ = Σ p θ_i + h̄ = w₀ + 2 Σ p Δ_i (the authors' code).
  config = tiny_config(**{'model.name': 'mlp', 'feddc.alpha': 0.0})
  data, _, _ = toy_clients([6, 9, 4], num_classes=NUM_CLASSES)
  _, start, _ = make('feddc', config, data)
  feddc_server, feddc_clients = one_round('feddc', config, data)
  fedavg_server, _ = one_round('fedavg', config, data)
  w0 = start.variables['params']
  mean_delta = jax.tree.map(jnp.subtract, fedavg_server.variables['params'], w0)
  chex.assert_trees_all_close(feddc_server.variables['params'],
                              jax.tree.map(lambda w, d: w + 2 * d, w0, mean_delta),
                              rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(feddc_server.mean_drift, mean_delta, rtol=1e-5, atol=1e-7)
  # Each client's drift is its own Δ_i; they differ between clients.
  assert not np.allclose(feddc_clients.drift['head']['kernel'][0],
                         feddc_clients.drift['head']['kernel'][1])


def test_feddc_drift_penalty_pulls_towards_w_minus_h():
  # Round 2: the penalty (α/2)‖θ + h_i − w‖² moves θ toward w − h_i, so a large α keeps
  # the update closer to −h_i than α = 0 does.
  config = tiny_config(**{'model.name': 'mlp', 'feddc.alpha': 0.0})
  data, _, _ = toy_clients([6, 9], num_classes=NUM_CLASSES)
  server, clients = one_round('feddc', config, data)
  plain, _ = one_round('feddc', config, data, server, clients)
  pulled, _ = one_round('feddc', override(config, **{'feddc.alpha': 5.0}), data, server, clients)
  assert not np.allclose(plain.variables['params']['head']['kernel'],
                         pulled.variables['params']['head']['kernel'], atol=1e-7)
  chex.assert_tree_all_finite(pulled)


@pytest.mark.parametrize('name, field, value, pattern', [
    ('moon', 'mu', -1.0, 'config.moon.mu: must be a number >= 0'),
    ('moon', 'temperature', 0.0, 'config.moon.temperature: must be a number > 0'),
    ('feddc', 'alpha', -0.1, 'config.feddc.alpha: must be a number >= 0'),
])
def test_bad_hyperparameters_name_the_field(name, field, value, pattern):
  config = tiny_config(**{'model.name': 'mlp', f'{name}.{field}': value})
  data, _, _ = toy_clients([4], num_classes=NUM_CLASSES)
  with pytest.raises(ValueError, match=pattern):
    make(name, config, data)
