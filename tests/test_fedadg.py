"""FedADG (Zhang et al. 2021): each player's update against a hand statement of its loss."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_shift import algorithms, models
from fedjax_shift.algorithms import fedadg as fedadg_lib
from fedjax_shift.algorithms.base import ServerState
from fedjax_shift.core.algorithm import ClientData
from fedjax_shift.core.round import NO_STEP_LIMIT
from helpers import tiny_config, toy_clients

NUM_CLASSES = 3


def build(name, config, data):
  module = models.create(config.model, NUM_CLASSES)
  return module, algorithms.build(name, config, module, data.max_examples)


def client(data, k):
  return ClientData(*(jnp.asarray(a[k]) for a in data), jnp.int32(NO_STEP_LIMIT))


def test_with_lambda_zero_the_classifier_trains_exactly_as_fedavg():
  # λ_0 = 0: F and C minimise L_err alone, and the adversarial losses never reach them
  # (stop_gradient), so their update is FedAvg's from the same model, batches and steps.
  config = tiny_config(**{'fedadg.lambda_0': 0.0, 'client.local_epochs': 3,
                          'client.batch_size': 4})
  data, _, _ = toy_clients([7, 5], num_classes=NUM_CLASSES)
  _, adg = build('fedadg', config, data)
  _, fedavg = build('fedavg', config, data)
  server = adg.init(jax.random.key(0), jnp.asarray(data.x[0, :1]))
  model = {'params': server.variables['params']['model']}
  plain = ServerState(model, fedavg.init(jax.random.key(0), jnp.asarray(data.x[0, :1])).opt_state,
                      jnp.int32(0))
  for k in range(2):
    got, _ = adg.client_update(server, (), client(data, k), jax.random.key(k))
    want, _ = fedavg.client_update(plain, (), client(data, k), jax.random.key(k))
    chex.assert_trees_all_close(got.update['params']['model'], want.update['params'],
                                rtol=1e-5, atol=1e-7)
    moved = jax.tree.leaves(got.update['params']['fedadg'])
    assert max(float(jnp.max(jnp.abs(leaf))) for leaf in moved) > 0   # D and G trained


@pytest.mark.parametrize('lambda_0', [0.3, 1.0])
def test_one_step_moves_each_player_down_its_own_loss(lambda_0):
  """One SGD step on a client whose 4 examples share a label (so the noise rows pair
  with the same ỹ in any batch order): Δθ_{F,C} = −η ∇[λ L_advf + (1−λ) L_err],
  Δθ_D = −η_adv ∇ L_advd, Δθ_G = −η_adv ∇ L_advg, each written out here."""
  config = tiny_config(**{'fedadg.lambda_0': lambda_0, 'client.local_steps': 1,
                          'client.local_epochs': 0, 'client.batch_size': 4,
                          'client.learning_rate': 0.05,
                          'fedadg.adversarial_learning_rate': 0.2})
  data, _, _ = toy_clients([4], num_classes=NUM_CLASSES)
  data = data._replace(y=np.ones_like(data.y))
  module, adg = build('fedadg', config, data)
  server = adg.init(jax.random.key(0), jnp.asarray(data.x[0, :1]))
  rng = jax.random.key(7)
  out, _ = adg.client_update(server, (), client(data, 0), rng)
  params = server.variables['params']
  x, y = jnp.asarray(data.x[0]), jnp.asarray(data.y[0])
  labels = 0.6 * jax.nn.one_hot(y, NUM_CLASSES)
  # local_train's step-0 key (core/local.py): fold_in(fold_in(rng, 1), 0)
  noise = jax.random.uniform(jax.random.fold_in(jax.random.fold_in(rng, 1), 0),
                             (4, config.fedadg.noise_dim))
  hidden = config.fedadg.hidden

  def features(model):
    return models.features(module, {'params': model}, x)

  def d(d_params, h):
    return fedadg_lib.Discriminator(hidden).apply({'params': d_params}, labels, h)

  def reference(g_params, dim):
    return fedadg_lib.Generator(dim, hidden).apply({'params': g_params}, noise, labels)

  def classifier_loss(model):
    h = features(model)
    logits = models.head({'params': model}, h)
    err = -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(4), y])
    advf = jnp.mean((1 - d(params['fedadg']['discriminator'], h)) ** 2)
    return lambda_0 * advf + (1 - lambda_0) * err

  h = features(params['model'])
  r = reference(params['fedadg']['generator'], h.shape[-1])
  d_loss = lambda p: jnp.mean((1 - d(p, r)) ** 2 + d(p, h) ** 2)
  g_loss = lambda p: jnp.mean(d(params['fedadg']['discriminator'],
                                reference(p, h.shape[-1])) ** 2)
  scale = lambda tree, s: jax.tree.map(lambda g: -s * g, tree)
  tolerance = dict(rtol=1e-4, atol=1e-7)
  chex.assert_trees_all_close(out.update['params']['model'],
                              scale(jax.grad(classifier_loss)(params['model']), 0.05),
                              **tolerance)
  chex.assert_trees_all_close(out.update['params']['fedadg']['discriminator'],
                              scale(jax.grad(d_loss)(params['fedadg']['discriminator']), 0.2),
                              **tolerance)
  chex.assert_trees_all_close(out.update['params']['fedadg']['generator'],
                              scale(jax.grad(g_loss)(params['fedadg']['generator']), 0.2),
                              **tolerance)


def test_bad_fields_name_themselves():
  data, _, _ = toy_clients([4], num_classes=NUM_CLASSES)
  for field, value in (('lambda_0', 1.5), ('noise_dim', 0), ('adversarial_learning_rate', 0.0)):
    config = tiny_config(**{f'fedadg.{field}': value})
    with pytest.raises(ValueError, match=f'fedadg.{field}'):
      build('fedadg', config, data)
  config = tiny_config(**{'model.name': 'bn_mlp'})
  module, adg = build('fedadg', config, data)
  with pytest.raises(ValueError, match='BatchNorm'):
    adg.init(jax.random.key(0), jnp.asarray(data.x[0, :1]))
