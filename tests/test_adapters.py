"""The test-time adapters: shared engine properties for every registered adapter,
and each method against a hand-computed case."""
import os

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from fedjax_shift import models
from fedjax_shift.adapters import ADAPTERS, SourceContext
from fedjax_shift.adapters.bbse import importance_weights
from fedjax_shift.adapters.em import em, em_prior
from fedjax_shift.adapters.memo import marginal_entropy, memo
from fedjax_shift.adapters.no_adapt import no_adapt
from fedjax_shift.adapters.shot import cluster_pseudo_labels
from fedjax_shift.adapters.surgical import surgical
from fedjax_shift.adapters.t3a import Supports, merge, t3a
from fedjax_shift.core.test_time import AdaptBatch, build_test_time, stream_problem
from fedjax_shift.data.augment import augment_many
from fedjax_shift.parts import atp_rates
from fedjax_shift.parts import losses
from helpers import backend_tolerance, toy_clients

NUM_CLASSES = 3
ADAPTER_CONFIGS = {
    'no_adapt': {},
    'bn_adapt': {'prior_strength': 16.0},
    'tent': {'learning_rate': 0.05, 'predict': 'after'},
    'eata': {'learning_rate': 0.05, 'momentum': 0.9, 'entropy_margin': 0.9,
             'redundancy_epsilon': 0.05, 'fisher_weight': 10.0, 'fisher_samples': 16,
             'predict': 'after'},
    'shot': {'learning_rate': 0.05, 'pseudo_label_weight': 0.3, 'predict': 'after'},
    't3a': {'filter_k': 3},
    'memo': {'num_augmentations': 4, 'learning_rate': 0.05},
    'em': {'num_iterations': 10},
    'bbse': {},
    'surgical': {'block': 'first', 'learning_rate': 0.05, 'predict': 'after'},
    'atp': {},
    # (η_inner, ε and fill_batch as for_method resolves them from a trained method)
    'fedtta': {'inner_learning_rate': 0.5, 'norm_epsilon': 0.1, 'fill_batch': 4},
    'fedtta_pp': {'max_steps': 3, 'inner_learning_rate': 0.5, 'norm_epsilon': 0.1,
                  'fill_batch': 4},
    'fedicon': {'memory_size': 8},
    'fedthe': {'steps': 3},
    'fedthe_plus': {'steps': 3, 'tune_steps': 1, 'num_augmentations': 2},
    'cotta': {'num_augmentations': 2},
    'rotta': {'memory_size': 6, 'update_frequency': 3},   # learns inside each batch of 4
    'note': {'memory_size': 6, 'update_frequency': 3},
}


def setup(model='bn_mlp', seed=0):
  module = models.MODELS.get(model)(NUM_CLASSES, hidden=(8,))
  variables = models.init(module, jax.random.key(seed), jnp.zeros((1, 4, 4, 1)))
  if models.has_batch_norm(variables):
    variables = {**variables, 'batch_stats': jax.tree.map(lambda s: s + 0.3,
                                                          variables['batch_stats'])}
  rng = np.random.default_rng(seed + 10)
  source_x = rng.random((16, 4, 4, 1)).astype(np.float32)
  source_y = rng.integers(0, NUM_CLASSES, 16).astype(np.int32)
  alpha = jax.tree.map(lambda a: a + 0.3, atp_rates.init_alpha(variables))
  context = SourceContext(variables, NUM_CLASSES, 4, source_x, source_y, alpha, (4, 4, 1))
  return module, variables, context


def build(name, module, context):
  # The registered defaults, test-sized where listed.
  section = ml_collections.ConfigDict({**ADAPTERS.defaults(name).to_dict(),
                                       **ADAPTER_CONFIGS.get(name, {})})
  return ADAPTERS.get(name)(module, section, context)


def variables_for(name, variables):
  """Adapters of models trained by particular methods (FedTTA's g, ODPFL-HN's
  hypernetwork) get those parts."""
  if 'odpfl_hn' in ADAPTERS.meta(name).get('trained_by', ()):
    from fedjax_shift.parts import hypernetwork
    template = hypernetwork.target_template(setup('mlp')[0], jnp.zeros((1, 4, 4, 1)))
    omega = hypernetwork.init_parameters(jax.random.key(7), template, (4, 4, 1), 5, 6, 2)
    return {**variables, hypernetwork.HYPERNETWORK: omega}
  if 'fedicon' in ADAPTERS.meta(name).get('trained_by', ()):
    from fedjax_shift.parts.contrastive import Projection
    features = models.features(setup()[0], variables, jnp.zeros((1, 4, 4, 1)))
    projection = Projection(5).init(jax.random.key(7), features)['params']
    return {**variables, 'params': {**variables['params'], 'projection': projection}}
  if 'fedthe' in ADAPTERS.meta(name).get('trained_by', ()):
    from fedjax_shift.algorithms.fedthe import EXTRA
    head = variables['params']['head']
    other = jax.tree.map(lambda leaf: leaf + 0.5, head)
    width = head['kernel'].shape[0]
    return {**variables, EXTRA: {'global_head': other, 'local_feature': jnp.full((width,), 0.2),
                                 'global_feature': jnp.full((width,), -0.1)}}
  if 'fedtta' in ADAPTERS.meta(name).get('trained_by', ()):
    from fedjax_shift.parts.fedtta_step import ADAPTATION
    g = models.AdaptationMLP((4,))
    params = g.init(jax.random.key(7), jnp.zeros((1, NUM_CLASSES)))['params']
    return {**variables, ADAPTATION: params}
  return variables


def test_test_sized_overrides_name_registered_adapters():
  # Tests parametrize over the registry; ADAPTER_CONFIGS only shrinks some defaults.
  assert set(ADAPTER_CONFIGS) <= set(ADAPTERS.names())


@pytest.mark.parametrize('name', ADAPTERS.names())
@pytest.mark.parametrize('mode', ['episodic', 'online'])
def test_vmapped_clients_equal_python_loop_and_no_nan(name, mode):
  """The vmapped scan over clients gives each client exactly what running it alone
  gives (no state leaks between clients), an empty client scores nothing, and
  partial / wrapped batches produce no NaN."""
  # (ODPFL-HN generates a classifier without BatchNorm statistics)
  module, variables, context = setup('mlp' if name == 'odpfl_hn' else 'bn_mlp')
  adapter = build(name, module, context)
  variables = variables_for(name, variables)
  data, _, _ = toy_clients([8, 0, 6, 3], num_classes=NUM_CLASSES, pad_to=10)
  run = build_test_time(adapter, 4, mode)
  too_long = [f for f, examples in adapter.stream_floor if mode == 'episodic' and examples > 4]
  if too_long:   # NOTE's memory of 6 in an episode of one batch of 4: refused, by field
    with pytest.raises(ValueError, match=f'{too_long[0]} = .* longer than the test stream'):
      run(variables, data, jax.random.key(3))
    return
  together = run(variables, data, jax.random.key(3))
  chex.assert_tree_all_finite({k: v for k, v in together.items() if k != 'predictions'})
  np.testing.assert_array_equal(together["count"], [8, 0, 6, 3])
  for k in range(data.num_clients):
    one = run(variables, data.take([k]), jax.random.key(3), jnp.array([k]))
    for field in ('correct', 'loss', 'count'):
      np.testing.assert_allclose(together[field][k], one[field][0],
                                 **backend_tolerance(2e-5, 1e-5))
    np.testing.assert_array_equal(together['predictions'][k], one['predictions'][0])


@pytest.mark.parametrize('name', ADAPTERS.names())
def test_adapters_registered_for_time_limited_streams_predict_without_a_step(name):
  """``streams=True`` promises the config checks a ``predict``: such an adapter runs a
  stream of rate 2 (finite, every example scored); any other is refused by name."""
  problem = stream_problem(name, 'online', 2.0)
  if not ADAPTERS.meta(name).get('streams'):
    assert problem is not None and name in problem
    return
  assert problem is None
  module, variables, context = setup('mlp' if name == 'odpfl_hn' else 'bn_mlp')
  adapter = build(name, module, context)
  assert adapter.predict is not None
  data, _, _ = toy_clients([8, 6], num_classes=NUM_CLASSES, pad_to=8)
  sums = build_test_time(adapter, 4, 'online', stream_rate=2.0)(
      variables_for(name, variables), data, jax.random.key(3))
  chex.assert_tree_all_finite({k: v for k, v in sums.items() if k != 'predictions'})
  np.testing.assert_array_equal(sums['count'], [8, 6])


def test_em_one_iteration_is_mean_posterior_and_converges_to_a_fixed_point():
  probs = jnp.array([[0.9, 0.1], [0.6, 0.4]])
  log_probs, weight, uniform = jnp.log(probs), jnp.ones(2), jnp.array([0.5, 0.5])
  # From π = π_s the first E-step leaves the posteriors unchanged: π = mean p = [.75, .25].
  np.testing.assert_allclose(em_prior(log_probs, weight, uniform, uniform, 1), [0.75, 0.25],
                             rtol=1e-6)
  prior = em_prior(log_probs, weight, uniform, uniform, 500)
  posterior = probs * prior / uniform
  posterior = posterior / posterior.sum(1, keepdims=True)
  np.testing.assert_allclose(posterior.mean(0), prior, atol=1e-5)  # π = mean p(y|x; π)
  assert prior[0] > 0.75  # the estimate sharpens toward the dominant class
  # All-masked batch: the prior stays where it started (no NaN).
  np.testing.assert_allclose(em_prior(log_probs, jnp.zeros(2), uniform, uniform, 5), uniform)


def test_em_without_iterations_equals_no_adaptation():
  module, variables, _ = setup()
  data, _, _ = toy_clients([7, 5], num_classes=NUM_CLASSES, pad_to=8)
  run = lambda adapter: build_test_time(adapter, 4)(variables, data, jax.random.key(0))
  np.testing.assert_array_equal(run(em(module, NUM_CLASSES, 0))['predictions'],
                                run(no_adapt(module))['predictions'])


def test_bbse_weights_solve_the_confusion_system():
  # Perfect classifier on a uniform source: C = diag(1/2), so w = μ̂ / (1/2).
  np.testing.assert_allclose(importance_weights(jnp.diag(jnp.array([0.5, 0.5])),
                                                jnp.array([0.8, 0.2])), [1.6, 0.4], rtol=1e-5)
  # A noisy classifier: μ̂ = C w with w = [1.5, 0.5] is recovered.
  confusion = jnp.array([[0.4, 0.1], [0.1, 0.4]])
  np.testing.assert_allclose(importance_weights(confusion, confusion @ jnp.array([1.5, 0.5])),
                             [1.5, 0.5], rtol=1e-4)
  # Nothing seen yet: no reweighting.
  np.testing.assert_allclose(importance_weights(confusion, jnp.zeros(2)), [1.0, 1.0])


def test_t3a_merge_keeps_the_lowest_entropy_supports_per_class():
  empty = Supports(jnp.zeros((2, 2, 3)), jnp.full((2, 2), jnp.inf))
  features = jnp.eye(3)[jnp.array([0, 1, 2, 0])] * jnp.array([[1.], [2.], [3.], [4.]])
  supports = merge(empty, features, jnp.array([0, 0, 0, 1]), jnp.array([0.5, 0.1, 0.3, jnp.inf]))
  np.testing.assert_allclose(supports.entropy, [[0.1, 0.3], [jnp.inf, jnp.inf]])
  np.testing.assert_allclose(supports.features[0], [[0, 1, 0], [0, 0, 1]])  # normalised
  supports = merge(supports, jnp.array([[1.0, 1.0, 0.0]]), jnp.array([0]), jnp.array([0.2]))
  np.testing.assert_allclose(supports.entropy[0], [0.1, 0.2])


@pytest.mark.parametrize('head_hidden', [(), (5,)])
def test_t3a_with_only_warmup_supports_predicts_with_normalised_head_weights(head_hidden):
  """z · normalise(w_c) for the head's weight vectors w_c. With hidden layers in the
  head, z is what its final linear layer reads (5-wide here, the encoder output 8)."""
  module = models.MODELS.get('mlp')(NUM_CLASSES, hidden=(8,), head_hidden=head_hidden)
  variables = models.init(module, jax.random.key(0), jnp.zeros((1, 4, 4, 1)))
  adapter = t3a(module, filter_k=1)
  state = adapter.init(variables, jax.random.key(0))
  chex.assert_shape(state[1].features, (NUM_CLASSES, 1, (head_hidden or (8,))[-1]))
  x = jnp.asarray(np.random.default_rng(0).random((4, 4, 4, 1)), jnp.float32)
  _, logits = adapter.step(state, AdaptBatch(x, jnp.zeros(4)))  # nothing joins
  features = models.head_hidden(variables, models.features(module, variables, x))
  kernel = variables['params']['head']['kernel']
  supports, _ = state[1]
  valid = np.isfinite(np.asarray(state[1].entropy[:, 0]))
  expected = features @ (kernel / jnp.linalg.norm(kernel, axis=0))
  np.testing.assert_allclose(np.asarray(logits)[:, valid], np.asarray(expected)[:, valid],
                             rtol=1e-5, atol=1e-6)


def test_shot_clustering_recovers_separated_clusters():
  features = jnp.array([[5.0, 0.1], [4.0, -0.2], [0.1, 5.0], [-0.1, 3.0]])
  probs = jnp.array([[0.6, 0.4], [0.45, 0.55], [0.4, 0.6], [0.55, 0.45]])  # two wrong
  labels = cluster_pseudo_labels(features, probs, jnp.ones(4))
  np.testing.assert_array_equal(labels, [0, 0, 1, 1])


def test_memo_marginal_entropy_and_augmentations():
  logits = jnp.array([[2.0, 0.0, -1.0]] * 5)
  np.testing.assert_allclose(marginal_entropy(logits), losses.entropy(logits[:1])[0], rtol=1e-6)
  # Two confident but opposite views: the marginal is uniform over them, entropy ln 2.
  np.testing.assert_allclose(marginal_entropy(jnp.array([[30.0, 0.0], [0.0, 30.0]])),
                             np.log(2), rtol=1e-5)
  image = jnp.asarray(np.random.default_rng(0).random((8, 8, 1)), jnp.float32)
  views = augment_many(jax.random.key(0), image, 6)
  chex.assert_shape(views, (6, 8, 8, 1))
  assert float(views.min()) >= 0.0 and float(views.max()) <= 1.0
  chex.assert_trees_all_equal(views, augment_many(jax.random.key(0), image, 6))
  assert not np.allclose(views[0], views[1])
  module, variables, _ = setup()
  data, _, _ = toy_clients([5], num_classes=NUM_CLASSES)
  run = lambda adapter: build_test_time(adapter, 4)(variables, data, jax.random.key(0))
  np.testing.assert_allclose(run(memo(module, 4, learning_rate=0.0))['loss'],
                             run(no_adapt(module))['loss'], **backend_tolerance(1e-5))


def test_surgical_changes_only_its_block_and_rejects_unknown_blocks():
  module, variables, context = setup()
  adapter = surgical(module, context, 'head', learning_rate=0.1, predict='after')
  state = adapter.init(variables, jax.random.key(0))
  x = jnp.asarray(np.random.default_rng(1).random((4, 4, 4, 1)), jnp.float32)
  new_state, _ = adapter.step(state, AdaptBatch(x, jnp.ones(4)))
  chex.assert_trees_all_equal(new_state.variables['params']['encoder'],
                              variables['params']['encoder'])
  assert not np.allclose(new_state.variables['params']['head']['kernel'],
                         variables['params']['head']['kernel'])
  with pytest.raises(ValueError, match="surgical.block: 'encoder/Conv_9' names no layer of "
                                       "this model; its layers, in order: "):
    surgical(module, context, 'encoder/Conv_9')   # the context's input shape: the layers
  with pytest.raises(ValueError, match="surgical block 'encoder/Conv_9': selects no parameter"):
    surgical(module, SourceContext(None, NUM_CLASSES, 4), 'encoder/Conv_9').init(
        variables, jax.random.key(0))            # no input shape: found at init


def test_surgical_first_is_the_first_layer_the_model_defines_on_tree_mapped_variables():
  # After a tree map the encoder's keys are sorted ('BatchNorm_0' < 'Dense_0'): the first
  # layer is still Dense_0, read from the model's layer order, and only it moves.
  module, variables, context = setup()
  variables = jax.tree.map(lambda leaf: leaf, variables)
  assert next(iter(variables['params']['encoder'])) == 'BatchNorm_0'
  adapter = ADAPTERS.get('surgical')(module, ml_collections.ConfigDict(
      {**ADAPTERS.defaults('surgical').to_dict(), 'block': 'first', 'learning_rate': 0.1,
       'predict': 'after'}), context)
  state = adapter.init(variables, jax.random.key(0))
  x = jnp.asarray(np.random.default_rng(1).random((4, 4, 4, 1)), jnp.float32)
  moved = adapter.step(state, AdaptBatch(x, jnp.ones(4)))[0].variables['params']
  changed = {f'{layer}/{name}' for layer, leaves in moved['encoder'].items()
             for name, leaf in leaves.items()
             if not np.array_equal(leaf, variables['params']['encoder'][layer][name])}
  assert changed == {'Dense_0/kernel', 'Dense_0/bias'}
  chex.assert_trees_all_equal(moved['head'], variables['params']['head'])
  with pytest.raises(ValueError, match=r"surgical.block: 'first' is a position in the model's "
                                       r"layer order, which needs the input shape"):
    surgical(module, SourceContext(None, NUM_CLASSES, 4), 'first')   # no input shape


def test_eata_without_reliable_examples_does_not_move():
  module, variables, context = setup()
  from fedjax_shift.adapters.eata import eata
  # rate 1 at the test batch (lr_batch_size = B = 4), no Fisher regulariser
  adapter = eata(module, context, learning_rate=1.0, lr_batch_size=4, entropy_margin=0.0,
                 fisher_weight=0.0)
  state = adapter.init(variables, jax.random.key(0))
  x = jnp.asarray(np.random.default_rng(1).random((4, 4, 4, 1)), jnp.float32)
  new_state, _ = adapter.step(state, AdaptBatch(x, jnp.ones(4)))
  chex.assert_trees_all_equal(new_state.variables, variables)
  # ... and with every example reliable it does.
  adapter = eata(module, context, learning_rate=1.0, lr_batch_size=4, entropy_margin=10.0,
                 fisher_weight=0.0)
  moved, _ = adapter.step(adapter.init(variables, jax.random.key(0)), AdaptBatch(x, jnp.ones(4)))
  assert not np.allclose(moved.variables['params']['encoder']['BatchNorm_0']['scale'],
                         variables['params']['encoder']['BatchNorm_0']['scale'])


def test_eata_batch_that_keeps_no_example_leaves_variables_and_momentum_bit_identical():
  # As the official code: no step at all when both filters keep nothing, even with the
  # Fisher regulariser pulling and a momentum buffer from an earlier step. The first
  # batch keeps every example (margin 10·ln C) and steps; the same batch again is
  # redundant (its predictions' cosine to their running mean is 1 ≥ ε): nothing kept.
  module, variables, context = setup()
  from fedjax_shift.adapters.eata import eata
  adapter = eata(module, context, learning_rate=0.5, lr_batch_size=4, entropy_margin=10.0,
                 fisher_weight=2000.0)   # the Fisher of the context's 16 source examples
  x = jnp.asarray(np.random.default_rng(1).random((4, 4, 4, 1)), jnp.float32)
  first, _ = adapter.step(adapter.init(variables, jax.random.key(0)),
                          AdaptBatch(x, jnp.ones(4)))
  assert bool(first.extra.kept)
  assert not np.array_equal(first.variables['params']['encoder']['BatchNorm_0']['bias'],
                            variables['params']['encoder']['BatchNorm_0']['bias'])
  second, _ = adapter.step(first, AdaptBatch(x, jnp.ones(4)))
  assert not bool(second.extra.kept)
  chex.assert_trees_all_equal(second.variables, first.variables)
  chex.assert_trees_all_equal(second.opt_state, first.opt_state)


def test_eata_rate_is_the_official_one_scaled_linearly_to_the_test_batch():
  """The registered EATA at test batch 20 steps as SGD at 0.00025 · 20 / 64 (EATA's
  code: 0.00025 at batch 64), not at 0.00025: one step equals the one of an EATA given
  that rate for its own batch."""
  from fedjax_shift.adapters.eata import eata
  module, variables, context = setup('bn_mlp')
  at_20 = context._replace(batch_size=20)
  x = jnp.asarray(np.random.default_rng(1).random((20, 4, 4, 1)), jnp.float32)
  def stepped(adapter):
    return adapter.step(adapter.init(variables, jax.random.key(0)),
                        AdaptBatch(x, jnp.ones(20)))[0].variables
  keep_all = {'entropy_margin': 10.0}   # every example reliable, so the batch steps
  section = ml_collections.ConfigDict({**ADAPTERS.defaults('eata').to_dict(), **keep_all})
  registered = stepped(ADAPTERS.get('eata')(module, section, at_20))
  scaled = stepped(eata(module, at_20, learning_rate=0.00025 * 20 / 64, lr_batch_size=20,
                        **keep_all))
  unscaled = stepped(eata(module, at_20, learning_rate=0.00025, lr_batch_size=20, **keep_all))
  chex.assert_trees_all_equal(registered, scaled)
  assert not np.allclose(registered['params']['encoder']['BatchNorm_0']['bias'],
                         unscaled['params']['encoder']['BatchNorm_0']['bias'], rtol=0, atol=0)
  for field, value in (('learning_rate', 0.0), ('fisher_weight', -1.0), ('momentum', 1.0)):
    with pytest.raises(ValueError, match=f'config.adapters.eata.{field}'):
      ADAPTERS.check('eata', ml_collections.ConfigDict(
          {**ADAPTERS.defaults('eata').to_dict(), field: value}), 'config.adapters.eata')


@pytest.mark.parametrize('name', ['tent', 'eata', 'bn_adapt'])
def test_batch_norm_adapters_reject_models_without_batch_norm(name):
  module, variables, context = setup('mlp')
  # EATA's Fisher is computed when it is built, so its error comes then.
  with pytest.raises(ValueError, match='BatchNorm'):
    build(name, module, context._replace(variables=variables)).init(variables,
                                                                   jax.random.key(0))


@pytest.mark.parametrize('name', ['no_adapt', 'tent', 'atp'])
def test_batch_larger_than_a_client_repeats_its_examples_and_scores_each_once(name):
  """Documented behaviour: with B > n the client's batch wraps its own n examples
  (BN statistics never see padding) and each example is scored exactly once."""
  module, variables, context = setup()
  data, _, _ = toy_clients([5, 3], num_classes=NUM_CLASSES, pad_to=5)
  out = build_test_time(build(name, module, context), 8, 'online')(variables, data,
                                                                   jax.random.key(0))
  chex.assert_tree_all_finite(out['loss'])
  np.testing.assert_array_equal(out['count'], [5, 3])
  assert (np.asarray(out['predictions'])[1, 3:] == -1).all()
  assert (np.asarray(out['predictions'])[0] >= 0).all()


def test_pipeline_accuracy_skips_empty_target_clients():
  from fedjax_shift.pipelines.atp import run_adapter
  module, variables, context = setup()
  data, xs, ys = toy_clients([4, 0, 6], num_classes=NUM_CLASSES, pad_to=6)
  acc = run_adapter(no_adapt(module), 'episodic', 4, variables, data, jax.random.key(0),
                    client_chunk=2)
  assert np.isnan(acc[1]) and np.isfinite(acc[[0, 2]]).all()
  logits = models.apply(module, variables, jnp.asarray(xs[2]))[0]
  np.testing.assert_allclose(acc[2], np.mean(np.argmax(logits, -1) == ys[2]), rtol=1e-6)


@pytest.mark.parametrize('field, value, message', [
    ('adapters.memo.num_augmentations', 0, 'must be'),
    ('adapters.eata.learning_rate', -1.0, 'must be'),
    ('adapters.eata.fisher_weight', -5.0, 'must be'),
    ('adapters.tent.optimizer', 'rmsprop', 'must be one of'),
    ('adapters.shot.optimizer', 'momentum', 'must be one of'),
    ('adapters.shot.pseudo_label_weight', -0.1, 'must be'),
    ('adapters.memo.augmentation', 'augmix', 'must be one of'),
    ('adapters.bbse.projection', 'l1', 'must be one of'),
    ('adapters.bn_adapt.mixing', 'sequential', 'must be one of'),
    ('adapters.tent.parameters', 'encoder', 'must be one of'),
    ('adapters.tent.clip', -1.0, 'must be'),
    ('adapters.tent.entropy_units', 'bans', 'must be one of'),
    ('adapters.tent.learning_rate', -1.0, 'must be'),
    ('adapters.t3a.filter_k', 0, 'must be an integer >= 1'),
    ('adapters.em.num_iterations', 0, 'must be an integer >= 1')])
def test_adapter_ranges_and_choices_are_refused_before_anything_trains(field, value, message,
                                                                       tmp_path):
  from configs import atp as atp_configs
  from fedjax_shift import pipelines
  config = atp_configs.get_config('tiny')
  section, name, leaf = field.split('.')
  config[section][name][leaf] = value
  with pytest.raises(ValueError, match=f'config.{field}: {message}'):
    pipelines.run(config, str(tmp_path))
  assert not os.listdir(tmp_path) or set(os.listdir(tmp_path)) <= {'.lock'}


def test_surgical_source_accuracy_picks_the_block_a_loop_of_fixed_adapters_scores_best():
  # The ATP release's rule: each candidate block adapted by one SGD step per source
  # batch from the global model, predicting after it; the best source accuracy wins.
  # Reference: the fixed-block adapter (SGD, predict after) run episodically per block.
  module, variables, context = setup()
  candidates = ('encoder/Dense_0', 'encoder/BatchNorm_0', 'head')
  lr = 2.0
  hparams = ml_collections.ConfigDict({**ADAPTERS.defaults('surgical').to_dict(),
                                       'select': 'source_accuracy', 'optimizer': 'sgd',
                                       'learning_rate': lr, 'predict': 'after',
                                       'candidates': candidates, 'selection_examples': 16})
  selected = ADAPTERS.get('surgical')(module, hparams, context)
  import optax
  xs = jnp.asarray(context.source_x).reshape(4, 4, 4, 4, 1)
  ys = np.asarray(context.source_y).reshape(4, 4)
  scores, fixed = [], {}
  for block in candidates:
    adapter = surgical(module, SourceContext(None, NUM_CLASSES, 4, input_shape=(4, 4, 1)),
                       block, lr, 'after', optax.sgd(lr))
    fixed[block] = adapter
    correct = 0
    for x, y in zip(xs, ys):
      _, logits = adapter.step(adapter.init(variables, jax.random.key(0)),
                               AdaptBatch(x, jnp.ones(4)))
      correct += int(np.sum(np.argmax(logits, -1) == y))
    scores.append(correct)
  best = candidates[int(np.argmax(scores))]
  x = jnp.asarray(np.random.default_rng(5).random((4, 4, 4, 1)), jnp.float32)
  state, logits = selected.step(selected.init(variables, jax.random.key(0)),
                                AdaptBatch(x, jnp.ones(4)))
  reference_state, reference = fixed[best].step(fixed[best].init(variables, jax.random.key(0)),
                                                AdaptBatch(x, jnp.ones(4)))
  np.testing.assert_allclose(logits, reference, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(state['params'], reference_state.variables['params'],
                              rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match='config.adapters.surgical.optimizer'):
    ADAPTERS.check('surgical', ml_collections.ConfigDict(
        {**hparams.to_dict(), 'optimizer': 'adam'}), 'config.adapters.surgical')


def test_simplex_projection_and_the_atp_release_label_distribution():
  from fedjax_shift.adapters.bbse import project_to_simplex, simplex_label_distribution
  # Inside the simplex already: unchanged. [1.2, −0.2]: θ = 0.2 gives [1, 0].
  # [0.5, 0.4, 0.3] (sum 1.2): all three stay, θ = 0.2 / 3.
  np.testing.assert_allclose(project_to_simplex(jnp.array([0.7, 0.3])), [0.7, 0.3], rtol=1e-6)
  np.testing.assert_allclose(project_to_simplex(jnp.array([1.2, -0.2])), [1.0, 0.0], atol=1e-6)
  np.testing.assert_allclose(project_to_simplex(jnp.array([0.5, 0.4, 0.3])),
                             [0.5 - 0.2 / 3, 0.4 - 0.2 / 3, 0.3 - 0.2 / 3], rtol=1e-5)
  # Class-conditional confusion C̃ = P(ŷ | y); a target with q = [0.9, 0.1] predicts
  # μ̂ = C̃ q = [0.75, 0.25]; C̃⁺ μ̂ recovers q, smoothed: 0.999·q + 0.0005.
  conditional = jnp.array([[0.8, 0.3], [0.2, 0.7]])
  q = simplex_label_distribution(jnp.linalg.pinv(conditional), jnp.array([0.75, 0.25]))
  np.testing.assert_allclose(q, [0.999 * 0.9 + 0.0005, 0.999 * 0.1 + 0.0005], rtol=1e-5)
  # μ̂ beyond what C̃ can give (all ŷ = 0): C̃⁺ μ̂ = [1.4, −0.4] projects to [1, 0].
  q = simplex_label_distribution(jnp.linalg.pinv(conditional), jnp.array([1.0, 0.0]))
  np.testing.assert_allclose(q, [0.9995, 0.0005], rtol=1e-5)


def test_bbse_simplex_adapter_shifts_the_logits_by_the_batch_label_distribution():
  from fedjax_shift.adapters.bbse import bbse, simplex_label_distribution
  module, variables, _ = setup()
  joint = jnp.array([[0.25, 0.05, 0.02], [0.05, 0.2, 0.03], [0.03, 0.08, 0.29]])
  x = jnp.asarray(np.random.default_rng(1).random((6, 4, 4, 1)), jnp.float32)
  logits = models.apply(module, variables, x)[0]
  predicted = jnp.bincount(jnp.argmax(logits, -1), length=NUM_CLASSES) / 6.0
  q = simplex_label_distribution(jnp.linalg.pinv(joint / joint.sum(0, keepdims=True)),
                                 predicted)
  adapter = bbse(module, joint, 'simplex')
  state = adapter.init(variables, jax.random.key(0))
  _, out = adapter.step(state, AdaptBatch(x, jnp.ones(6)))
  # The release adds log q to the logits; a log-softmax of it is the same prediction.
  np.testing.assert_allclose(out, jax.nn.log_softmax(logits + jnp.log(q)), atol=1e-5)


def test_bn_adapt_layerwise_mixing_equals_a_hand_written_two_layer_forward():
  """The ATP release's BN-Adapt: each BatchNorm mixes its running statistics with the
  unbiased statistics of its own input, which the mixed layers before it produced."""
  from fedjax_shift.adapters.bn_adapt import bn_adapt
  module = models.MODELS.get('bn_mlp')(NUM_CLASSES, hidden=(5, 4))
  variables = models.init(module, jax.random.key(2), jnp.zeros((1, 3)))
  rng = np.random.default_rng(3)
  variables = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), jnp.float32)
                           if a.ndim else a, variables)
  variables['batch_stats'] = jax.tree.map(jnp.abs, variables['batch_stats'])  # var > 0
  x = rng.normal(size=(6, 3)).astype(np.float32)
  prior = 0.4   # p = N / (N + B): N = 4 at B = 6
  p, s = variables['params'], variables['batch_stats']

  def mixed_norm(h, bn, stats):
    mean = prior * np.asarray(stats['mean']) + (1 - prior) * h.mean(0)
    var = prior * np.asarray(stats['var']) + (1 - prior) * h.var(0, ddof=1)
    return (h - mean) / np.sqrt(var + 1e-5) * np.asarray(bn['scale']) + np.asarray(bn['bias'])

  dense = lambda h, layer: h @ np.asarray(layer['kernel']) + np.asarray(layer['bias'])
  enc, stats = p['encoder'], s['encoder']
  h = np.maximum(mixed_norm(dense(x, enc['Dense_0']), enc['BatchNorm_0'],
                            stats['BatchNorm_0']), 0)
  h = np.maximum(mixed_norm(dense(h, enc['Dense_1']), enc['BatchNorm_1'],
                            stats['BatchNorm_1']), 0)
  expected = dense(h, p['head'])
  adapter = bn_adapt(module, 6, 4.0, 'layerwise')
  _, logits = adapter.step(adapter.init(variables, None),
                           AdaptBatch(jnp.asarray(x), jnp.ones(6)))
  np.testing.assert_allclose(logits, expected, **backend_tolerance(1e-4, 1e-5))
  # The default 'batch' mixing differs from the second layer on.
  _, batch_logits = bn_adapt(module, 6, 4.0).step(
      variables, AdaptBatch(jnp.asarray(x), jnp.ones(6)))
  assert not np.allclose(batch_logits, expected, atol=1e-3)


def test_crop_flip_views_are_crops_of_the_symmetrically_padded_image_maybe_flipped():
  from fedjax_shift.data.augment import crop_flip
  image = jnp.asarray(np.random.default_rng(4).random((28, 28, 1)), jnp.float32)
  padded = np.pad(np.asarray(image), ((4, 4), (4, 4), (0, 0)), mode='symmetric')
  candidates = [crop for r in range(9) for c in range(9)
                for crop in (padded[r:r + 28, c:c + 28], padded[r:r + 28, c:c + 28][:, ::-1])]
  flips = 0
  for index in range(12):
    view = np.asarray(crop_flip(jax.random.key(index), image))
    matches = [k for k, crop in enumerate(candidates) if np.array_equal(view, crop)]
    assert matches, index
    flips += matches[0] % 2
  assert 0 < flips < 12   # both flipped and unflipped views occur
  views = augment_many(jax.random.key(0), image, 5, 'crop_flip')
  chex.assert_shape(views, (5, 28, 28, 1))


def test_sgd_option_takes_a_plain_gradient_step_on_the_selected_parameters():
  """Tent and SHOT with optimizer='sgd' (the ATP release's baselines): θ' = θ − η∇L."""
  from fedjax_shift.adapters.tent import tent
  module, variables, _ = setup()
  x = jnp.asarray(np.random.default_rng(5).random((4, 4, 4, 1)), jnp.float32)
  batch = AdaptBatch(x, jnp.ones(4))
  adapter = tent(module, 0.1, 'after', 'sgd')
  state, _ = adapter.step(adapter.init(variables, jax.random.key(0)), batch)

  def loss(params):
    logits = models.apply(module, {**variables, 'params': params}, x, 'batch_stats')[0]
    return losses.weighted_entropy(logits, jnp.ones(4))

  grads = jax.grad(loss)(variables['params'])
  bn = variables['params']['encoder']['BatchNorm_0']
  expected = jax.tree.map(lambda v, g: v - 0.1 * g, bn, grads['encoder']['BatchNorm_0'])
  chex.assert_trees_all_close(state.variables['params']['encoder']['BatchNorm_0'], expected,
                              **backend_tolerance(1e-5, 1e-6))
  chex.assert_trees_all_equal(state.variables['params']['head'], variables['params']['head'])


ATP_RELEASE = {'tent': {'optimizer': 'sgd', 'learning_rate': 0.1, 'predict': 'after'},
               'shot': {'optimizer': 'sgd', 'learning_rate': 0.1, 'pseudo_label_weight': 0.0},
               'memo': {'num_augmentations': 4, 'augmentation': 'crop_flip',
                        'learning_rate': 0.1},
               'bbse': {'projection': 'simplex'},
               'bn_adapt': {'mixing': 'layerwise'}}


@pytest.mark.parametrize('name', sorted(ATP_RELEASE))
def test_atp_release_options_vmapped_equal_a_loop_over_clients(name):
  module, variables, context = setup()
  section = ml_collections.ConfigDict({**ADAPTERS.defaults(name).to_dict(),
                                       **ATP_RELEASE[name]})
  run = build_test_time(ADAPTERS.get(name)(module, section, context), 4, 'episodic')
  data, _, _ = toy_clients([8, 6, 3], num_classes=NUM_CLASSES, pad_to=10)
  together = run(variables, data, jax.random.key(3))
  chex.assert_tree_all_finite(together['loss'])
  for k in range(data.num_clients):
    one = run(variables, data.take([k]), jax.random.key(3), jnp.array([k]))
    np.testing.assert_allclose(together['loss'][k], one['loss'][0],
                               **backend_tolerance(2e-5, 1e-5))


def test_upfl_tent_steps_every_parameter_and_predicts_after_the_step():
  """The UPFL paper's TENT (configs/fedtta.py:tent): on a BatchNorm-free MLP, one SGD
  step on the client's whole batch of the entropy in bits, clipped at global norm 10,
  weight decay 1e-4 added after the clip, then a forward pass with the stepped model."""
  from fedjax_shift.adapters.tent import tent
  module = models.MODELS.get('mlp')(NUM_CLASSES, hidden=(8,))
  variables = models.init(module, jax.random.key(1), jnp.zeros((1, 4, 4, 1)))
  x = jnp.asarray(np.random.default_rng(6).random((5, 4, 4, 1)) * 3, jnp.float32)
  batch = AdaptBatch(x, jnp.ones(5))
  run = lambda lr, clip=10.0: tent(module, lr, 'after', 'sgd', 'all', clip, 1e-4, 'bits')

  def predict(adapter):
    return adapter.step(adapter.init(variables, jax.random.key(0)), batch)[1]

  def entropy_bits(params):
    logits = models.apply(module, {'params': params}, x, 'batch_stats')[0]
    return losses.weighted_entropy(logits, jnp.ones(5)) / np.log(2.0)

  for clip in (10.0, 0.01):     # 0.01: the clip binds (the gradient's norm is larger)
    grads = jax.grad(entropy_bits)(variables['params'])
    norm = np.sqrt(sum(float(jnp.sum(g ** 2)) for g in jax.tree.leaves(grads)))
    factor = min(1.0, clip / norm)
    stepped = jax.tree.map(lambda p, g: p - 0.1 * (factor * g + 1e-4 * p),
                           variables['params'], grads)
    expected = models.apply(module, {'params': stepped}, x)[0]
    np.testing.assert_allclose(predict(run(0.1, clip)), expected, **backend_tolerance(1e-5, 1e-6))
  assert norm > 0.01
  unadapted = models.apply(module, variables, x)[0]
  np.testing.assert_allclose(predict(run(0.0)), unadapted, **backend_tolerance(1e-6, 1e-7))
  assert not np.allclose(predict(run(0.1)), unadapted, atol=1e-4)


def test_fedtta_tent_variant_is_the_papers_tent_on_the_same_mlp():
  from configs import fedtta as fedtta_configs
  config = fedtta_configs.get_config('tent')
  main = fedtta_configs.get_config()
  assert config.model == main.model and config.model.name == 'mlp'
  hparams = config.adapters.tent
  assert (hparams.parameters, hparams.optimizer, hparams.learning_rate, hparams.clip,
          hparams.weight_decay, hparams.predict) == ('all', 'sgd', 0.1, 10.0, 1e-4, 'after')
  iclr = fedtta_configs.get_config('tent_iclr')
  assert iclr.model.name == 'bn_mlp' and iclr.adapters.tent.parameters == 'batch_norm'
