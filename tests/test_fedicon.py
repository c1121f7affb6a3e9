"""FedICON (SupCon encoder, personal heads, contrastive test-time adaptation), FedTHE
(two heads, test-time ensemble) and the FedTHE-style shifted test sets."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_shift import algorithms, models
from fedjax_shift.papers.fedicon import tables as report
from fedjax_shift.adapters import fedicon as fedicon_adapter
from fedjax_shift.adapters import fedthe as fedthe_adapter
from fedjax_shift.algorithms import ALGORITHMS
from fedjax_shift.algorithms import fedthe as fedthe_algorithm
from fedjax_shift.parts.contrastive import supcon_loss
from fedjax_shift.benchmarks import BENCHMARKS, label_skew
from fedjax_shift.core.algorithm import ClientData
from fedjax_shift.core.evaluation import personalized_variables
from fedjax_shift.core.round import RoundConfig, build_round, stack_client_states
from fedjax_shift.core.test_time import AdaptBatch, build_test_time
from fedjax_shift.data import augment
from tests.helpers import compiled_programs, data_config, tiny_config, toy_clients

NUM_CLASSES = 3


def direct_supcon(z, labels, weight, temperature, memory=None, memory_valid=None):
  """Eq. 4 written pair by pair (numpy loops): the reference for ``supcon_loss``."""
  z = np.asarray(z, np.float64)
  total, anchors = 0.0, 0
  for a in range(len(z)):
    if weight[a] <= 0:
      continue
    others = [b for b in range(len(z)) if b != a and weight[b] > 0]
    denominator = sum(np.exp(z[a] @ z[b] / temperature) for b in others)
    if memory is not None:
      denominator += sum(np.exp(z[a] @ m / temperature)
                         for m, ok in zip(np.asarray(memory, np.float64), memory_valid) if ok)
    positives = [p for p in others if labels[p] == labels[a]]
    if not positives:
      continue
    total += -np.mean([np.log(np.exp(z[a] @ z[p] / temperature) / denominator)
                       for p in positives])
    anchors += 1
  return total / max(anchors, 1)


def normalised(key, shape):
  z = jax.random.normal(key, shape)
  return z / jnp.linalg.norm(z, axis=-1, keepdims=True)


@pytest.mark.parametrize('labels,weight', [
    ([0, 1, 0, 2, 1, 0, 1, 0, 2, 1], [1, 1, 1, 0, 1, 1, 1, 1, 0, 1]),   # padding included
    ([4, 4, 4, 4, 4, 4], [1, 1, 1, 1, 1, 1]),          # one class: every view a positive
    ([0, 1, 2, 0, 1, 2], [1, 1, 1, 1, 1, 1]),          # FedICON-us / Eq. 7: instance labels
    ([0, 1, 2, 3], [1, 0, 1, 1]),                      # anchors without a positive skipped
])
def test_supcon_equals_the_pairwise_definition(labels, weight):
  z = normalised(jax.random.key(0), (len(labels), 5))
  got = supcon_loss(z, jnp.asarray(labels), jnp.asarray(weight, jnp.float32), 0.1)
  np.testing.assert_allclose(float(got), direct_supcon(z, labels, weight, 0.1), rtol=1e-5)


def test_supcon_with_memory_adds_only_negatives():
  z = normalised(jax.random.key(1), (6, 4))
  memory = normalised(jax.random.key(2), (5, 4))
  valid = np.array([True, False, True, True, False])
  labels, weight = [0, 1, 2, 0, 1, 2], [1.0] * 6
  got = supcon_loss(z, jnp.asarray(labels), jnp.asarray(weight), 0.5, memory, jnp.asarray(valid))
  np.testing.assert_allclose(float(got), direct_supcon(z, labels, weight, 0.5, memory, valid),
                             rtol=1e-5)


def test_all_padding_batch_gives_zero_loss_and_finite_gradient():
  z = normalised(jax.random.key(3), (6, 4))
  loss, grad = jax.value_and_grad(lambda z: supcon_loss(z, jnp.zeros(6, jnp.int32),
                                                        jnp.zeros(6), 0.1))(z)
  assert float(loss) == 0.0
  assert np.all(np.isfinite(np.asarray(grad))) and float(jnp.abs(grad).max()) == 0.0


# --- augmentations -------------------------------------------------------------------

def test_view_augmentations_keep_shape_and_range_and_follow_the_key():
  x = jax.random.uniform(jax.random.key(0), (3, 12, 12, 3))
  names = augment.VIEW_AUGMENTATIONS.names()
  views = jax.jit(lambda k, x: augment.two_views(k, x, names))(jax.random.key(1), x)
  chex.assert_shape(views, (6, 12, 12, 3))
  assert float(views.min()) >= 0.0 and float(views.max()) <= 1.0
  again = augment.two_views(jax.random.key(1), x, names)
  np.testing.assert_allclose(views, again, atol=1e-6)
  assert not np.allclose(views[:3], views[3:])     # the two views differ


def test_flip_mirrors_and_grayscale_equalises_channels():
  image = jax.random.uniform(jax.random.key(0), (5, 7, 3))
  flips = [augment.horizontal_flip(jax.random.key(k), image) for k in range(16)]
  assert all(np.allclose(f, image) or np.allclose(f, image[:, ::-1]) for f in flips)
  assert any(np.allclose(f, image[:, ::-1]) for f in flips)
  grays = [augment.grayscale(jax.random.key(k), image) for k in range(32)]
  changed = [g for g in grays if not np.allclose(g, image)]
  assert changed and all(np.allclose(g[..., 0], g[..., 1]) for g in changed)


def test_mild_crop_keeps_at_least_three_fifths_of_the_area_and_the_variants_set_every_view():
  """A crop of area a and aspect ratio r resized to the image widens it by 1/√(a·r): a
  vertical stripe one pixel wide ends at most 1/√(0.6·3/4) ≈ 1.49 pixels wide after the
  mild crop (bilinear: at most 3 columns touched), where SimCLR's U(0.2, 1) reaches
  1/√(0.2·3/4) ≈ 2.58 (4 or 5 columns). translate_rotate is augment's geometric part on
  the same keys."""
  image = jnp.zeros((28, 28, 1)).at[:, 14].set(1.0)
  widths = lambda crop: [int((np.asarray(crop(jax.random.key(k), image)).max(0)[:, 0] > 1e-3)
                             .sum()) for k in range(64)]
  mild, simclr = widths(augment.mild_resized_crop), widths(augment.random_resized_crop)
  assert max(mild) <= 3 and max(simclr) >= 4
  shift_key, rotation_key = jax.random.split(jax.random.key(5))
  np.testing.assert_array_equal(augment.translate_rotate(jax.random.key(5), image),
                                augment.translate_and_rotate(shift_key, rotation_key, image))
  from configs import fedicon as fedicon_configs
  for variant, names in fedicon_configs.VIEWS.items():
    config = fedicon_configs.get_config(f'digit5,ablation,{variant}')
    methods = [name for name in ALGORITHMS.names() if name.startswith('fedicon')]
    assert len(methods) == 5   # FedICON and its four variants, which follow its views
    assert all(tuple(ALGORITHMS.section(name, config).augmentations) == names
               for name in methods)
    assert tuple(config.adapters.fedicon.augmentations) == names


def test_unknown_augmentation_names_the_field():
  config = tiny_config(**{'algorithms': ('fedicon',)})
  config.fedicon.augmentations = ('random_resized_crop', 'solarize')
  with pytest.raises(ValueError, match=r'fedicon\.augmentations.*solarize'):
    algorithms.base.ALGORITHMS.check('fedicon', config.fedicon, 'config.fedicon')


# --- FedICON and FedTHE training -----------------------------------------------------

def build(name, data, **fields):
  config = tiny_config(**{'model.name': 'bn_mlp', 'model.hidden': (16,),
                          'client.batch_size': 4, **fields})
  module = models.create(config.model, NUM_CLASSES)
  algorithm = algorithms.build(name, config, module, data.max_examples, {}, data.num_clients,
                               data.x.shape[2:])
  server = algorithm.init(jax.random.key(0), jnp.asarray(data.x[0, :1]))
  return config, module, algorithm, server


def test_batch_of_one_is_refused_naming_the_field():
  data, _, _ = toy_clients([6, 5], num_classes=NUM_CLASSES)
  with pytest.raises(ValueError, match='client.batch_size=1'):
    build('fedicon', data, **{'client.batch_size': 1})


@pytest.mark.parametrize('name', ['fedicon', 'fedicon_us', 'fedthe'])
def test_personal_heads_never_reach_the_server(name):
  """FedTHE's personal heads, and FedICON's with head_sharing='local'."""
  data, _, _ = toy_clients([6, 5, 7], num_classes=NUM_CLASSES)
  _, _, algorithm, server = build(name, data, **{f'{name}.head_sharing': 'local'}
                                  if name != 'fedthe' else {})
  states = stack_client_states(algorithm, server, 3)
  other = jax.tree.map(lambda a: a + jax.random.normal(jax.random.key(9), a.shape), states)
  if name == 'fedthe':   # its client features are recomputed each round; heads are not
    other = states._replace(head=other.head)
  round_fn = build_round(algorithm, RoundConfig(cohort_size=3))[1]
  ids, key = jnp.arange(3), jax.random.key(4)
  a = round_fn(server, states, data, ids, key)
  b = round_fn(server, other, data, ids, key)
  chex.assert_trees_all_close(a.server_state, b.server_state, atol=0)
  heads_a = a.client_states if name != 'fedthe' else a.client_states.head
  heads_b = b.client_states if name != 'fedthe' else b.client_states.head
  assert not np.allclose(jax.tree.leaves(heads_a)[0], jax.tree.leaves(heads_b)[0])


def first_client_update(algorithm, server, data):
  """Client 0's ClientOutput for one round from the server's state (no step limit)."""
  state = jax.tree.map(lambda a: a[0], stack_client_states(algorithm, server, 1))
  one = jax.tree.map(lambda a: jnp.asarray(a[0]), data)
  return algorithm.client_update(
      server, state, ClientData(one.x, one.y, one.mask, one.num_examples, jnp.int32(10 ** 6)),
      jax.random.key(1))[0]


def test_fedicon_uploads_encoder_and_projection_not_head():
  data, _, _ = toy_clients([6, 5], num_classes=NUM_CLASSES)
  for dim, expected in ((64, {'encoder', 'projection'}), (0, {'encoder'})):
    _, _, algorithm, server = build('fedicon', data, **{'fedicon.head_sharing': 'local',
                                                        'fedicon.projection_dim': dim})
    output = first_client_update(algorithm, server, data)
    assert {path[1] for path in output.update} == expected


def test_fedicon_federated_head_is_averaged_then_personalised_alone():
  """head_sharing='federated_then_personal' (Sec. 4.1.2): the server's head after a round
  is the weighted mean of the clients' trained heads; personalisation trains the head
  alone on the final encoder's eval-mode features (encoder, projection and BatchNorm
  statistics unchanged)."""
  data, _, _ = toy_clients([6, 5], num_classes=NUM_CLASSES)
  _, _, algorithm, server = build('fedicon', data)
  outputs = []
  for k in range(2):
    one = jax.tree.map(lambda a: jnp.asarray(a[k]), data)
    outputs.append(algorithm.client_update(
        server, (), ClientData(one.x, one.y, one.mask, one.num_examples, jnp.int32(10 ** 6)),
        jax.random.key(k))[0])
  assert {path[1] for path in outputs[0].update} == {'encoder', 'head'}   # Eq. 3: no g
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *outputs)
  weights = jnp.array([6.0, 5.0]) / 11
  new = algorithm.server_update(server, stacked, weights)
  head = ('params', 'head', 'kernel')
  start = server.variables['params']['head']['kernel']
  expected = sum(w * (start + out.update[head]) for w, out in zip(weights, outputs))
  np.testing.assert_allclose(new.variables['params']['head']['kernel'], expected,
                             rtol=1e-5, atol=1e-6)
  personal = personalized_variables(algorithm, new, (),
                                    jax.tree.map(lambda a: jnp.asarray(a[0]), data), 0,
                                    jax.random.key(5))
  chex.assert_trees_all_equal(personal['params']['encoder'], new.variables['params']['encoder'])
  chex.assert_trees_all_equal(personal['batch_stats'], new.variables['batch_stats'])
  assert not np.allclose(personal['params']['head']['kernel'],
                         new.variables['params']['head']['kernel'])
  with pytest.raises(ValueError, match='fedicon.head_sharing'):
    build('fedicon', data, **{'fedicon.head_sharing': 'global'})


@pytest.mark.parametrize('weighting', ['uniform', 'num_examples'])
def test_fedthe_global_feature_is_the_mean_of_client_features(weighting):
  """f_G: the plain mean of the f_k (the official master.py), or weighted by data size."""
  data, _, _ = toy_clients([6, 2, 7], num_classes=NUM_CLASSES)
  _, module, algorithm, server = build('fedthe', data, **{'fedthe.feature_weighting': weighting})
  states = stack_client_states(algorithm, server, 3)
  out = build_round(algorithm, RoundConfig(cohort_size=3))[1](server, states, data,
                                                               jnp.arange(3), jax.random.key(2))
  weights = np.array([6, 2, 7]) / 15 if weighting == 'num_examples' else np.ones(3) / 3
  expected = np.tensordot(weights, np.asarray(out.client_states.feature), axes=1)
  np.testing.assert_allclose(out.server_state.global_feature, expected, rtol=1e-5)


def test_fedthe_personal_head_and_feature_come_from_the_received_model():
  """personal_on='received' (the official THE_worker): f_k is the received global
  model's mean feature; 'local' takes the locally trained encoder's. With head_bias
  False the personal head's bias stays 0."""
  data, _, _ = toy_clients([6, 5], num_classes=NUM_CLASSES)
  features = {}
  for where in ('received', 'local'):
    _, module, algorithm, server = build('fedthe', data, **{'fedthe.personal_on': where})
    states = stack_client_states(algorithm, server, 2)
    out = build_round(algorithm, RoundConfig(cohort_size=2))[1](server, states, data,
                                                                 jnp.arange(2), jax.random.key(2))
    features[where] = np.asarray(out.client_states.feature[0])
    np.testing.assert_array_equal(out.client_states.head['bias'], 0.0)
  one = jax.tree.map(lambda a: jnp.asarray(a[0]), data)
  expected = fedthe_algorithm.mean_feature(module, server.variables, one)
  np.testing.assert_allclose(features['received'], expected, rtol=1e-5, atol=1e-6)
  assert not np.allclose(features['local'], expected, rtol=1e-3)


def test_fedthe_balanced_softmax_loss_by_hand():
  """CE(z + log(n + 1), y): logits z = (1, 0, 0), counts n = (3, 0, 1), label 2:
  −log(e^{0 + log 2} / (e^{1 + log 4} + e^{0 + log 1} + e^{0 + log 2})) = −log(2 / (4e + 3))."""
  data = ClientData(jnp.zeros((5, 1)), jnp.array([0, 0, 0, 2, 1]),
                    jnp.array([True, True, True, True, False]), jnp.int32(4), jnp.int32(1))
  adjustment = fedthe_algorithm.balanced_softmax_adjustment(data, 3)
  np.testing.assert_allclose(adjustment, np.log([4.0, 1.0, 2.0]), rtol=1e-6)
  logits = jnp.array([[1.0, 0.0, 0.0]])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits + adjustment, jnp.array([2]))
  np.testing.assert_allclose(loss[0], -np.log(2.0 / (4 * np.e + 3)), rtol=1e-6)


def test_fedthe_personal_head_optimizer_decays_the_kernel_and_freezes_the_bias():
  """One step, lr 0.01, weight decay 5e-4: kernel − 0.01 (g + 5e-4 kernel); bias unchanged."""
  config = tiny_config()
  opt = fedthe_algorithm.head_optimizer(config.fedthe)
  head = {'kernel': jnp.full((2, 3), 2.0), 'bias': jnp.zeros(3)}
  grads = {'kernel': jnp.full((2, 3), 0.5), 'bias': jnp.ones(3)}
  updates, _ = opt.update(grads, opt.init(head), head)
  new = optax.apply_updates(head, updates)
  np.testing.assert_allclose(new['kernel'], 2.0 - 0.01 * (0.5 + 5e-4 * 2.0), rtol=1e-6)
  np.testing.assert_array_equal(new['bias'], 0.0)
  assert (config.fedthe.global_loss, config.fedthe.head_bias) == ('balanced_softmax', False)


# --- test-time adapters --------------------------------------------------------------

def trained(name, **fields):
  data, _, _ = toy_clients([12, 10], num_classes=NUM_CLASSES)
  config, module, algorithm, server = build(name, data, **fields)
  states = stack_client_states(algorithm, server, 2)
  out = build_round(algorithm, RoundConfig(cohort_size=2))[1](server, states, data,
                                                               jnp.arange(2), jax.random.key(3))
  variables = personalized_variables(algorithm, out.server_state,
                                     jax.tree.map(lambda a: a[0], out.client_states),
                                     jax.tree.map(lambda a: jnp.asarray(a[0]), data), 0,
                                     jax.random.key(5))
  return config, module, variables, data


@pytest.mark.slow
def test_online_contrastive_tta_with_empty_memory_equals_batch_variant_on_first_batch():
  config, module, variables, data = trained('fedicon')
  adapter = fedicon_adapter.fedicon_tta(module, 4, fedicon_adapter.ContrastiveTTA(memory_size=8))
  online = build_test_time(adapter, 4, 'online')(variables, data, jax.random.key(1))
  episodic = build_test_time(adapter, 4, 'episodic')(variables, data, jax.random.key(1))
  np.testing.assert_array_equal(online['predictions'][:, :4], episodic['predictions'][:, :4])
  # After a batch the memory holds its four features (negatives for the next one).
  state, _ = adapter.step(adapter.init(variables, jax.random.key(0)),
                          AdaptBatch(jnp.asarray(data.x[0, :4]), jnp.ones(4)))
  assert int(state.memory_valid.sum()) == 4


def test_fedicon_memory_is_first_in_first_out():
  memory, valid = jnp.zeros((4, 2)), jnp.zeros((4,), bool)
  rows = jnp.arange(6, dtype=jnp.float32).reshape(3, 2)
  memory, valid, slot = fedicon_adapter.write_memory(memory, valid, jnp.int32(3), rows,
                                                     jnp.array([1.0, 0.0, 1.0]))
  np.testing.assert_array_equal(memory, [[4, 5], [0, 0], [0, 0], [0, 1]])
  np.testing.assert_array_equal(valid, [True, False, False, True])
  assert int(slot) == 1


def test_fedicon_adapter_contrasts_the_encoder_output_without_a_projection_and_bad_sizes():
  """Eq. 3 with no projection: the memory holds normalised encoder outputs (the head's
  input width); bad memory and batch sizes are refused."""
  config, module, variables, data = trained('fedicon')
  assert 'projection' not in variables['params']
  adapter = fedicon_adapter.fedicon_tta(module, 4, fedicon_adapter.ContrastiveTTA(memory_size=8))
  state, logits = adapter.step(adapter.init(variables, jax.random.key(0)),
                               AdaptBatch(jnp.asarray(data.x[0, :4]), jnp.ones(4)))
  assert state.memory.shape == (8, variables['params']['head']['kernel'].shape[0])
  np.testing.assert_allclose(jnp.linalg.norm(state.memory[:4], axis=-1), 1.0, rtol=1e-5)
  assert int(state.memory_valid.sum()) == 4
  assert np.all(np.isfinite(logits))
  with pytest.raises(ValueError, match='memory_size'):
    fedicon_adapter.fedicon_tta(module, 4, fedicon_adapter.ContrastiveTTA(memory_size=3))
  with pytest.raises(ValueError, match='eval_adapter_batch_size=1'):
    fedicon_adapter.fedicon_tta(module, 1)


@pytest.mark.parametrize('weight,head', [(1.0, 'global'), (0.0, 'personal')])
def test_fedthe_fixed_weight_gives_one_heads_predictions(weight, head):
  config, module, variables, data = trained('fedthe')
  adapter = fedthe_adapter.fedthe_adapter(module, steps=0, initial_global_weight=weight)
  result = build_test_time(adapter, 4, 'online')(variables, data, jax.random.key(1))
  if head == 'global':
    model = {**variables, 'params': {**variables['params'],
                                     'head': variables['fedthe']['global_head']}}
  else:
    model = variables
  for k in range(2):
    n = int(data.num_examples[k])
    logits = models.apply(module, model, jnp.asarray(data.x[k, :n]), 'eval')[0]
    np.testing.assert_array_equal(result['predictions'][k, :n], np.argmax(logits, -1))


def test_fedthe_official_history_over_three_batches_by_hand():
  """THE_worker: batch 1 h = (f_0, α f_1 + (1 − α) h_0, …); a later batch starts from the
  previous batch's last h, its own first feature unused. Three batches of two rows."""
  f = np.arange(1.0, 7.0, dtype=np.float32)[:, None]   # features 1 … 6 (one dimension)
  a = 0.1
  h1 = [1.0, a * 2 + (1 - a) * 1.0]
  h2 = [h1[-1], a * 4 + (1 - a) * h1[-1]]               # f = 3 unused
  h3 = [h2[-1], a * 6 + (1 - a) * h2[-1]]               # f = 5 unused
  history, has = jnp.zeros(1), jnp.asarray(False)
  got = []
  for batch in range(3):
    per_row, history, has = fedthe_adapter.feature_history(
        jnp.asarray(f[2 * batch:2 * batch + 2]), jnp.ones(2), history, has, a)
    got.extend(np.asarray(per_row)[:, 0])
  np.testing.assert_allclose(got, h1 + h2 + h3, rtol=1e-6)
  assert fedthe_adapter.ADAPTERS.defaults('fedthe').beta == 0.1   # THE_beta (parameters.py)
  with pytest.raises(ValueError, match='history: choose from'):
    fedthe_adapter.feature_history(jnp.asarray(f), jnp.ones(6), history, has, a, 'ema')


def test_fedthe_history_is_the_ema_of_the_test_stream():
  features = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)
  weight = np.array([1, 1, 0, 1, 1], np.float32)
  per_row, last, has = fedthe_adapter.feature_history(jnp.asarray(features), jnp.asarray(weight),
                                                      jnp.zeros(3), jnp.asarray(False), 0.1,
                                                      'continuous')
  expected, h = [], None
  for f, w in zip(features, weight):
    if w > 0:
      h = f if h is None else 0.1 * f + 0.9 * h
    expected.append(h)
  np.testing.assert_allclose(per_row, np.stack(expected), rtol=1e-6)
  np.testing.assert_allclose(last, expected[-1], rtol=1e-6)
  assert bool(has)


def test_fedthe_adapter_needs_a_fedthe_model():
  config, module, variables, data = trained('fedicon')
  with pytest.raises(ValueError, match='trained by fedthe'):
    fedthe_adapter.fedthe_adapter(module).init(variables, jax.random.key(0))


# --- FedTHE-style test sets ----------------------------------------------------------

def shifted_benchmark(**fields):
  config = data_config(num_clients=6, min_examples_per_client=2,
                       corruptions=('gaussian_noise',), shift_tests=('ooc', 'natural', 'mixture'),
                       **fields)
  label_skew.check(config)
  return BENCHMARKS.get('label_skew_corrupted')(config, 0)


def rows(split, k):
  return {np.asarray(x).tobytes() for x in split.client(k)[0]}


def test_every_shifted_test_set_is_disjoint_from_all_training_data():
  bench = shifted_benchmark()
  train = set().union(*(rows(bench.splits['train'], k) for k in range(6)))
  for name in ('test', 'test_corrupted', 'test_ooc', 'test_natural', 'test_mixture'):
    for k in range(6):
      assert not rows(bench.splits[name], k) & train, (name, k)


def test_pooled_out_of_client_sets_are_a_share_of_the_other_clients_tests():
  """FedTHE's OOC set: client k draws round(P_k / 5) examples from the pool P_k of the
  other five clients' test splits, none of its own."""
  bench = shifted_benchmark()
  test, ooc = bench.splits['test'], bench.splits['test_ooc']
  for k in range(6):
    others = set().union(*(rows(test, j) for j in range(6) if j != k))
    pool_size = sum(int(test.num_examples[j]) for j in range(6) if j != k)
    assert rows(ooc, k) <= others and not rows(ooc, k) & rows(test, k)
    assert int(ooc.num_examples[k]) == round(pool_size / 5)
  assert bench.info['ooc_source'] == 'pooled'
  with pytest.raises(ValueError, match='data.ooc_source'):
    BENCHMARKS.check('label_skew_corrupted', data_config(ooc_source='all'), 'config.data',
                     known_fields_only=False)


def test_shifted_test_sets_follow_their_definitions():
  bench = shifted_benchmark(ooc_source='donor')
  test, donors = bench.splits['test'], bench.info['ooc_donors']
  assert sorted(donors) == list(range(6)) and all(d != k for k, d in enumerate(donors))
  natural = bench.splits['test_natural']
  for k in range(6):
    assert rows(bench.splits['test_ooc'], k) == rows(test, donors[k])
    # the natural set has the client's test label counts
    np.testing.assert_array_equal(np.bincount(natural.client(k)[1], minlength=10),
                                  np.bincount(test.client(k)[1], minlength=10))
    # every mixture example comes from one of the client's four other test sets
    pool = set().union(*(rows(bench.splits[s], k) for s in
                         ('test', 'test_corrupted', 'test_ooc', 'test_natural')))
    assert rows(bench.splits['test_mixture'], k) <= pool
  assert bench.info['natural_source'] == 'uci_digits'


def test_shifted_sets_leave_the_other_splits_unchanged():
  plain = BENCHMARKS.get('label_skew_corrupted')(
      data_config(num_clients=6, min_examples_per_client=2, corruptions=('gaussian_noise',)), 0)
  shifted = shifted_benchmark()
  for name, split in plain.splits.items():
    np.testing.assert_array_equal(split.x, shifted.splits[name].x)


def test_corruption_per_example_draws_several_corruptions_and_keeps_the_other_splits():
  """corruption_draw='example' (FedTHE's corr_data): each corrupted test example is
  ``corrupt`` of its clean self under the corruption drawn for it, clients hold more
  than one corruption, and every other split equals the per-client draw's."""
  from fedjax_shift.data import corruptions
  names = ('gaussian_noise', 'contrast', 'pixelate')
  make = lambda draw: BENCHMARKS.get('label_skew_corrupted')(
      data_config(num_clients=6, min_examples_per_client=2, corruptions=names,
                  corruption_draw=draw), 0)
  per_client, per_example = make('client'), make('example')
  for name in ('train', 'val', 'test'):
    np.testing.assert_array_equal(per_client.splits[name].x, per_example.splits[name].x)
  counts = np.array(per_example.info['corruption_counts_per_client'])
  test, corrupted = per_example.splits['test'], per_example.splits['test_corrupted']
  np.testing.assert_array_equal(counts.sum(1), test.num_examples)
  assert (np.count_nonzero(counts, axis=1) > 1).sum() >= 4
  for k in range(6):   # each example is one of the three corruptions of itself
    candidates = np.stack([corruptions.corrupt(test.client(k)[0], name, 5, k) for name in names])
    matches = np.all(np.isclose(candidates, corrupted.client(k)[0][None]), axis=(2, 3, 4))
    # noise depends on the batch it is drawn with, so compare the deterministic ones
    deterministic = matches[1:].any(0)
    np.testing.assert_array_equal(np.bincount(matches[1:].argmax(0)[deterministic] + 1,
                                              minlength=3)[1:], counts[k, 1:])
  with pytest.raises(ValueError, match='data.corruption_draw'):
    BENCHMARKS.check('label_skew_corrupted', data_config(corruption_draw='domain'), 'config.data',
                     known_fields_only=False)


def test_natural_shift_errors_name_the_field():
  with pytest.raises(ValueError, match='data.natural_source'):
    label_skew.check(data_config(source='uci_digits', shift_tests=('natural',)))
  with pytest.raises(ValueError, match='data.shift_tests'):
    BENCHMARKS.check('label_skew_corrupted', data_config(shift_tests=('ood',)), 'config.data',
                     known_fields_only=False)
  config = data_config(num_clients=4, min_examples_per_client=2, shift_tests=('natural',),
                       natural_source='tfds:cifar10_1', data_dir='/nonexistent')
  with pytest.raises(FileNotFoundError, match='natural_source'):
    BENCHMARKS.get('label_skew_corrupted')(config, 0)


# --- the paper's table ---------------------------------------------------------------

def test_fedicon_table_rows_and_columns():
  results = [
      {'algorithm': 'fedavg', 'seed': s, 'metrics': {'global/test/accuracy': 0.5 + s / 10,
                                                    'global/test_ooc/accuracy': 0.4,
                                                    'global+tent/test/accuracy': 0.3}}
      for s in range(2)] + [
      {'algorithm': 'fedicon', 'seed': 0,
       'metrics': {'personalized+fedicon/test/accuracy': 0.9,
                   'personalized+fedicon/test_ooc/accuracy': 0.1}}]
  lines = report.fedicon_table(results).splitlines()
  assert lines[0] == '| Method | In-distribution | Out-of-client | seeds |'
  assert lines[2] == '| FedAvg | 55.00 ± 5.00 | 40.00 ± 0.00 | 2 |'
  assert lines[3] == '| Tent | 30.00 ± 0.00 | n/a | 2 |'
  assert lines[4] == '| FedICON | 90.00 | 10.00 | 1 |'
  assert len(lines) == 5


def test_fedicon_config_runs_end_to_end(tmp_path):
  import importlib

  from fedjax_shift import pipelines
  config = importlib.import_module('configs.fedicon').get_config('tiny')
  config.algorithms = ('fedthe', 'fedicon')
  config.eval_adapters = ('fedthe:online', 'fedicon:online')
  config.eval_adapter_algorithms = ('fedthe', 'fedicon')
  config.rounds = 2
  config.eval_every = 2
  out = pipelines.run(config, str(tmp_path))
  table = out.records['paper_tables']
  for row in ('| FedTHE |', '| FedICON (online) |'):   # the config ran its online variant
    assert row in table
  metrics = {r['algorithm']: r['metrics'] for r in out.records['results']}
  for split in ('test', 'test_corrupted', 'test_ooc', 'test_natural', 'test_mixture'):
    assert np.isfinite(metrics['fedicon'][f'personalized+fedicon/{split}/accuracy'])
    assert np.isfinite(metrics['fedthe'][f'personalized+fedthe/{split}/accuracy'])
  assert not any(k.startswith('global+fedthe') for k in metrics['fedthe'])


def test_fedicon_columns_follow_the_benchmark():
  assert report.fedicon_columns(data_config()) == report.FEDICON_COLUMNS
  covariate = report.fedicon_columns(data_config(benchmark='digit_domains'))
  assert [split for split, _ in covariate] == [
      'test_corrupted_mnist', 'test_corrupted_uci', 'test_corrupted_mnistm',
      'test_corrupted_synth', 'test_corrupted', 'test']
  held_out = report.fedicon_columns(data_config(benchmark='digit_domains',
                                                held_out_domain='uci'))
  assert held_out == (('test', 'Held-out domain: uci'), ('test_own', 'Own domain'))


@pytest.mark.parametrize('name', ['fedicon', 'fedthe'])
def test_round_is_one_compiled_call_for_a_whole_run(name):
  from fedjax_shift.core.round import round_key
  data, _, _ = toy_clients([6, 9, 4], num_classes=NUM_CLASSES)
  _, _, algorithm, server = build(name, data)
  clients = stack_client_states(algorithm, server, 3)
  round_device, _ = build_round(algorithm, RoundConfig(cohort_size=2))
  for r in range(3):
    out = round_device(server, clients, data, round_key(jax.random.key(0), r))
    server, clients = out.server_state, out.client_states
  assert compiled_programs(round_device) == 1


def test_fedicon_lodo_table_has_one_column_per_held_out_domain():
  runs = {'uci': [{'algorithm': 'fedicon', 'seed': 0,
                   'metrics': {'personalized+fedicon/test/accuracy': 0.5}}],
          'synth': [{'algorithm': 'fedicon', 'seed': 0,
                     'metrics': {'personalized+fedicon/test/accuracy': 0.25}},
                    {'algorithm': 'fedavg', 'seed': 0, 'metrics': {'global/test/accuracy': 0.2}}]}
  lines = report.fedicon_lodo_table(runs).splitlines()
  assert lines[0] == '| Method | Held out: uci | Held out: synth |'
  assert lines[2] == '| FedAvg | n/a | 20.00 |'
  assert lines[3] == '| FedICON | 50.00 | 25.00 |'


# --- Table 5 ablations ----------------------------------------------------------------

def test_without_sharing_nothing_is_sent_and_each_client_keeps_its_encoder():
  data, _, _ = toy_clients([6, 5, 7], num_classes=NUM_CLASSES)
  _, _, algorithm, server = build('fedicon_no_sharing', data)
  states = stack_client_states(algorithm, server, 3)
  out = build_round(algorithm, RoundConfig(cohort_size=3))[1](server, states, data,
                                                               jnp.arange(3), jax.random.key(1))
  chex.assert_trees_all_close(out.server_state.variables, server.variables, atol=0)
  encoders = out.client_states['params']['encoder']
  first = jax.tree.leaves(encoders)[0]
  assert not np.allclose(first[0], first[1])
  from fedjax_shift.pipelines.runs import uploaded_parameters
  assert uploaded_parameters(algorithm, server, states, data) == 0


def test_cross_entropy_ablation_leaves_the_projection_untrained():
  data, _, _ = toy_clients([6, 5], num_classes=NUM_CLASSES)
  _, _, algorithm, server = build('fedicon_ce', data, **{'fedicon_ce.weight_decay': 0.0,
                                                         'fedicon_ce.projection_dim': 64})
  output = first_client_update(algorithm, server, data)
  projection = {p: v for p, v in output.update.items() if p[1] == 'projection'}
  encoder = {p: v for p, v in output.update.items() if p[1] == 'encoder'}
  assert projection and all(float(jnp.abs(v).max()) == 0.0 for v in projection.values())
  assert any(float(jnp.abs(v).max()) > 0.0 for v in encoder.values())


def test_ablation_table_maps_the_papers_cells_and_keeps_ours_as_extra_rows():
  """Table 5's CE cells are Local (– / – / –: 34.00) and FedAvg's global model
  (– / ✓ / –: 55.04); FedICON whole is ✓ / ✓ / ✓ (62.23); our encoder-only CE row is an
  extra row with no paper number."""
  results = [{'algorithm': 'local', 'seed': 0,
              'metrics': {'personalized/test_corrupted/accuracy': 0.3}},
             {'algorithm': 'fedavg', 'seed': 0,
              'metrics': {'global/test_corrupted/accuracy': 0.45,
                          'personalized/test_corrupted/accuracy': 0.99}},
             {'algorithm': 'fedicon_ce', 'seed': 0,
              'metrics': {'personalized/test_corrupted/accuracy': 0.4,
                          'personalized+fedicon/test_corrupted/accuracy': 0.5}},
             {'algorithm': 'fedicon', 'seed': 0,
              'metrics': {'personalized/test_corrupted/accuracy': 0.6,
                          'personalized+fedicon/test_corrupted/accuracy': 0.62}}]
  lines = report.fedicon_ablation_table(results).splitlines()
  assert lines[2:] == [
      '| Local |  |  |  | 30.00 | 34.00 |',
      '| FedAvg (the whole model shared) |  | ✓ |  | 45.00 | 55.04 |',
      '| FedICON | ✓ | ✓ |  | 60.00 |  |',
      '| FedICON | ✓ | ✓ | ✓ | 62.00 | 62.23 |',
      '| extra: CE, encoder shared, head local |  | ✓ |  | 40.00 |  |',
      '| extra: CE, encoder shared, head local |  | ✓ | ✓ | 50.00 |  |']


def test_transductive_mode_equals_a_hand_written_loop_over_shuffled_passes():
  """Eq. 2 as written: two passes over client 0's shuffled test split (12 examples in
  batches of 4: three steps a pass), the state carried, equal a Python loop over the same
  batches of the same adapter's step; the order is a permutation of the real examples."""
  from fedjax_shift.core.test_time import client_batches, shuffled_order, transductive_adapt
  _, module, variables, data = trained('fedicon')
  adapter = fedicon_adapter.fedicon_tta(module, 4, fedicon_adapter.ContrastiveTTA(memory_size=8, epochs=2,
                                                                        learning_rate=0.05))
  x, n, rng = jnp.asarray(data.x[1]), jnp.int32(data.num_examples[1]), jax.random.key(7)
  initial = adapter.init(variables, jax.random.key(0))
  scanned = jax.jit(lambda state: transductive_adapt(adapter, 4, state, x, n, rng))(initial)
  state = initial
  for epoch in range(2):
    order = shuffled_order(jax.random.fold_in(rng, epoch), x.shape[0], n)
    assert sorted(np.asarray(order[:int(n)]).tolist()) == list(range(int(n)))
    batches, _ = client_batches(x[order], n, 4)
    for t in range(batches.weight.shape[0]):
      batch = AdaptBatch(batches.x[t], batches.weight[t])
      if float(batch.weight.sum()) > 0:
        state = jax.jit(adapter.step)(state, batch)[0]
  # The scan and the loop compile the step apart, and XLA:CPU orders their sums by the
  # machine's vector width (AVX2, AVX-512): after six steps one stored feature of 128
  # differed by 1.5e-6 on a 2-core AVX2 machine, over the 1e-6 that AVX-512 kept.
  chex.assert_trees_all_close(scanned.variables, state.variables, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(scanned.memory, state.memory, rtol=1e-5, atol=1e-5)
  moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))),
                       initial.variables['params'], scanned.variables['params'])
  assert max(jax.tree.leaves(moved)) > 1e-4   # the passes did adapt the encoder


def test_transductive_mode_with_rate_zero_predicts_as_the_unadapted_model():
  from fedjax_shift.adapters.no_adapt import no_adapt
  _, module, variables, data = trained('fedicon')
  adapter = fedicon_adapter.fedicon_tta(module, 4, fedicon_adapter.ContrastiveTTA(epochs=3, learning_rate=0.0))
  adapted = build_test_time(adapter, 4, 'transductive')(variables, data, jax.random.key(1))
  plain = build_test_time(no_adapt(module), 4)(variables, data, jax.random.key(1))
  np.testing.assert_array_equal(adapted['predictions'], plain['predictions'])
  np.testing.assert_allclose(adapted['loss'], plain['loss'], rtol=1e-6)


def test_fedicon_test_batch_norm_option_moves_the_running_statistics_by_momentum():
  """batch_norm='test': after a batch the running statistics are 0.9·training's + 0.1·the
  batch's (BN_MOMENTUM); 'frozen' keeps the training ones."""
  _, module, variables, data = trained('fedicon')
  batch = AdaptBatch(jnp.asarray(data.x[0, :4]), jnp.ones(4))
  stats = {}
  for mode in ('frozen', 'test'):
    adapter = fedicon_adapter.fedicon_tta(module, 4, fedicon_adapter.ContrastiveTTA(batch_norm=mode,
                                                                          learning_rate=0.0))
    stats[mode] = adapter.step(adapter.init(variables, jax.random.key(0)), batch)[0] \
        .variables['batch_stats']
  chex.assert_trees_all_equal(stats['frozen'], variables['batch_stats'])
  expected = models.apply(module, variables, batch.x, 'train')[1]['batch_stats']
  chex.assert_trees_all_close(stats['test'], expected, rtol=1e-6)
  assert not np.allclose(jax.tree.leaves(stats['test'])[0],
                         jax.tree.leaves(variables['batch_stats'])[0])


def test_raw_anchors_average_only_the_raw_samples_losses():
  """Eq. 7 anchors the raw samples: with 2 samples and their 2 views, the loss is the
  mean of the two raw anchors' −log softmax_{A(x)}(z_x·z_x'/τ), every other view in A(x);
  the symmetric form averages all four anchors (a numpy reference computes both)."""
  z = jax.random.normal(jax.random.key(0), (4, 3))
  z = z / jnp.linalg.norm(z, axis=-1, keepdims=True)
  labels, weight, tau = jnp.array([0, 1, 0, 1]), jnp.ones(4), 0.5
  sims = np.asarray(z @ z.T) / tau
  per_anchor = []
  for a in range(4):
    others = [b for b in range(4) if b != a]
    positive = (a + 2) % 4
    per_anchor.append(-(sims[a, positive] - np.log(np.sum(np.exp(sims[a, others])))))
  raw = supcon_loss(z, labels, weight, tau, anchor_weight=jnp.array([1., 1., 0., 0.]))
  np.testing.assert_allclose(raw, np.mean(per_anchor[:2]), rtol=1e-5)
  np.testing.assert_allclose(supcon_loss(z, labels, weight, tau), np.mean(per_anchor),
                             rtol=1e-5)


@pytest.mark.parametrize('fields, message', [
    (dict(epochs=0), 'config.adapters.fedicon.epochs: must be >= 1'),
    (dict(anchors='both'), "config.adapters.fedicon.anchors: unknown 'both'"),
    (dict(batch_norm='adapt'), "config.adapters.fedicon.batch_norm: unknown 'adapt'"),
    (dict(weight_decay=-1.0), 'config.adapters.fedicon.weight_decay: must be >= 0'),
])
def test_bad_fedicon_adapter_fields_are_refused_naming_them(fields, message):
  module = models.create(tiny_config(**{'model.name': 'bn_mlp'}).model, NUM_CLASSES)
  with pytest.raises(ValueError, match=message):
    fedicon_adapter.fedicon_tta(module, 4, fedicon_adapter.ContrastiveTTA(**fields))


def test_transductive_mode_is_refused_for_an_adapter_that_cannot_run_it():
  from fedjax_shift.adapters.no_adapt import no_adapt
  from fedjax_shift.config import validate
  module = models.create(tiny_config(**{'model.name': 'bn_mlp'}).model, NUM_CLASSES)
  with pytest.raises(ValueError, match="cannot run it"):
    build_test_time(no_adapt(module), 4, 'transductive')
  config = tiny_config(eval_adapters=('tent:transductive',))
  with pytest.raises(ValueError, match=r"config.eval_adapters: tent cannot run the "
                                       r"'transductive' mode \(adapters that can: \['fedicon'\]"):
    validate(config)
  validate(tiny_config(eval_adapters=('fedicon:transductive',), algorithms=('fedicon',)))
