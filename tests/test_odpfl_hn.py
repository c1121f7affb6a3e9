"""ODPFL-HN (algorithms/odpfl_hn.py, adapters/odpfl_hn.py)."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_shift import algorithms, models
from fedjax_shift.adapters.odpfl_hn import odpfl_hn_adapter
from fedjax_shift.parts import hypernetwork as lib
from fedjax_shift.core.algorithm import ClientData
from fedjax_shift.core.round import NO_STEP_LIMIT
from fedjax_shift.core.test_time import AdaptBatch
from helpers import tiny_config, toy_clients

NUM_CLASSES = 3


def setup(**overrides):
  config = tiny_config(**{'model.name': 'mlp', 'model.hidden': (6,),
                          'odpfl_hn.embedding_dim': 4, 'odpfl_hn.hidden': 8,
                          'odpfl_hn.trunk_layers': 2, **overrides})
  module = models.create(config.model, NUM_CLASSES)
  data, _, _ = toy_clients([7, 5], num_classes=NUM_CLASSES, pad_to=9)
  algorithm = algorithms.build('odpfl_hn', config, module, data.max_examples,
                               example_shape=data.x.shape[2:])
  state = algorithm.init(jax.random.key(0), jnp.asarray(data.x[0, :1]))
  return config, module, algorithm, state, data


def test_generated_classifier_has_the_models_structure_and_ignores_padding():
  _, module, _, state, data = setup()
  omega = state.variables['params']
  template = models.init(module, jax.random.key(1), jnp.asarray(data.x[0, :1]))['params']
  n = int(data.num_examples[0])
  padded = lib.personalized_params(omega, module, jnp.asarray(data.x[0]),
                                   jnp.asarray(data.mask[0], jnp.float32))
  real = lib.personalized_params(omega, module, jnp.asarray(data.x[0, :n]), jnp.ones(n))
  chex.assert_trees_all_equal_shapes(padded, template)
  chex.assert_trees_all_close(padded, real, atol=1e-6)
  other = lib.personalized_params(omega, module, jnp.asarray(data.x[1]),
                                  jnp.asarray(data.mask[1], jnp.float32))
  assert not np.allclose(other['head']['kernel'], real['head']['kernel'])  # data-dependent


def test_one_local_step_round_is_the_weighted_chain_rule_gradient():
  """One full-batch SGD step: θ_i − θ̃_i = η ∇_θ L_i, so the round moves ω by
  Σ_i p_i (−s · η · ∇_ω L_i(H(E(D_i)))) with s = η_encoder or η_hn (pFedHN's update),
  the server's SGD at rate 1 applying the mean. The reference differentiates each
  client's loss through E and H in full, one client at a time; the method splits it
  (the client's vjp through e_i, the server's one vjp over the cohort's embeddings)."""
  config, module, algorithm, state, data = setup(**{
      'client.batch_size': 16, 'client.local_epochs': 1, 'client.learning_rate': 0.1,
      'odpfl_hn.encoder_learning_rate': 0.5, 'odpfl_hn.hypernetwork_learning_rate': 0.25})
  clients = ClientData(*(jnp.asarray(a) for a in data),
                       jnp.full((2,), NO_STEP_LIMIT, jnp.int32))
  keys = jax.random.split(jax.random.key(0), 2)
  outputs, _ = jax.vmap(algorithm.client_update, (None, None, 0, 0))(state, (), clients, keys)
  weights = jnp.array([0.7, 0.3])
  new_state = algorithm.server_update(state, outputs, weights)
  omega = state.variables['params']

  def client_loss(omega, i):
    n = int(data.num_examples[i])
    x, y = jnp.asarray(data.x[i, :n]), jnp.asarray(data.y[i, :n])
    params = lib.personalized_params(omega, module, x, jnp.ones(n))
    logits = module.apply({'params': params}, x)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))

  grads = [jax.grad(client_loss)(omega, i) for i in range(2)]
  moved = jax.tree.map(jnp.subtract, new_state.variables['params'], omega)
  for part, scale in (('encoder', 0.5), ('hypernetwork', 0.25)):
    expected = jax.tree.map(lambda g0, g1, s=scale: -s * 0.1 * (0.7 * g0 + 0.3 * g1),
                            grads[0][part], grads[1][part])
    chex.assert_trees_all_close(moved[part], expected, rtol=1e-4, atol=1e-7)


def test_a_client_uploads_its_classifier_delta_and_embedding_not_the_hypernetworks_gradient():
  """The paper's protocol: θ_i − θ̃_i (the classifier's size), e_i and the encoder's
  part of Δω; nothing the size of H's heads leaves the client."""
  _, module, algorithm, state, data = setup()
  client = ClientData(*(jnp.asarray(a[0]) for a in data), jnp.int32(NO_STEP_LIMIT))
  output, _ = algorithm.client_update(state, (), client, jax.random.key(0))
  classifier = models.init(module, jax.random.key(1), jnp.asarray(data.x[0, :1]))['params']
  chex.assert_trees_all_equal_shapes(output.update['classifier_delta'], classifier)
  chex.assert_trees_all_equal_shapes(output.update['encoder'],
                                     state.variables['params']['encoder'])
  chex.assert_shape(output.update['embedding'], (4,))


def test_adapter_generates_from_the_batch_and_online_pools_batches():
  _, module, algorithm, state, data = setup()
  variables = algorithm.global_model(state)
  omega = variables[lib.HYPERNETWORK]
  n = int(data.num_examples[0])
  x = jnp.asarray(data.x[0, :n])
  adapter = odpfl_hn_adapter(module)
  start = adapter.init(variables, jax.random.key(0))
  _, logits = adapter.step(start, AdaptBatch(x, jnp.ones(n)))
  expected = module.apply({'params': lib.personalized_params(omega, module, x, jnp.ones(n))}, x)
  np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-6)
  # online: the second batch's model comes from the embedding of both batches
  state1, _ = adapter.step(start, AdaptBatch(x[:4], jnp.ones(4)))
  _, logits2 = adapter.step(state1, AdaptBatch(x[4:], jnp.ones(n - 4)))
  both = lib.personalized_params(omega, module, x, jnp.ones(n))
  np.testing.assert_allclose(logits2, module.apply({'params': both}, x[4:]), rtol=1e-5,
                             atol=1e-6)
  # the global model is H at the zero embedding, shaped like the classifier
  chex.assert_trees_all_equal_shapes(variables['params'], lib.generate(
      omega['hypernetwork'], jnp.zeros(4), variables['params']))


def test_bad_input_is_an_error_naming_the_field():
  with pytest.raises(ValueError, match='odpfl_hn.embedding_dim'):
    setup(**{'odpfl_hn.embedding_dim': 0})
  with pytest.raises(ValueError, match='without BatchNorm'):
    setup(**{'model.name': 'bn_mlp'})
  config = tiny_config(**{'model.name': 'mlp'})
  module = models.create(config.model, NUM_CLASSES)
  with pytest.raises(ValueError, match='example shape'):
    algorithms.build('odpfl_hn', config, module, 5)
  adapter = odpfl_hn_adapter(module)
  with pytest.raises(ValueError, match='trained by odpfl_hn'):
    adapter.init({'params': {}}, jax.random.key(0))
