"""The TTA benchmarks' baselines (SAR, CoTTA, LAME, PL, conjugate PL): one step of each
against a reference written from its equations (float64 where it is a computation of
its own), and what each does with a batch it cannot use."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

from fedjax_shift import models
from fedjax_shift.adapters import SourceContext
from fedjax_shift.adapters import lame as lame_lib
from fedjax_shift.adapters.conjugate_pl import conjugate_loss, conjugate_pl
from fedjax_shift.adapters.cotta import cotta
from fedjax_shift.adapters.pseudo_label import pl
from fedjax_shift.adapters.sar import is_norm_path, sar
from fedjax_shift.adapters.tent import tent
from fedjax_shift.core.test_time import AdaptBatch, build_test_time
from fedjax_shift.core import evaluation
from fedjax_shift.parts import losses
from helpers import toy_clients

NUM_CLASSES = 3


def setup(batch=6, seed=0):
  module = models.MODELS.get('bn_mlp')(NUM_CLASSES, hidden=(8,))
  variables = models.init(module, jax.random.key(seed), jnp.zeros((1, 4, 4, 1)))
  x = jnp.asarray(np.random.default_rng(seed + 1).random((batch, 4, 4, 1)), jnp.float32)
  return module, variables, AdaptBatch(x, jnp.ones(batch))


def norm_params(variables):
  return {p: v for p, v in traverse_util.flatten_dict(variables['params']).items()
          if is_norm_path(p)}


def with_norm_params(variables, flat):
  params = traverse_util.flatten_dict(variables['params'])
  return {**variables, 'params': traverse_util.unflatten_dict({**params, **flat})}


def forward(module, variables, x):
  return models.apply(module, variables, x, 'batch_stats')[0]


def to64(tree):
  return jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), tree)


# --- SAR -------------------------------------------------------------------------------

def sar_reference(module, variables, x, margin, rho, lr):
  """SAR's Eq. 2–5 in float64, step by step as the authors' forward_and_adapt_sar: the
  filtered entropy's gradient, the SAM perturbation ε = ρ g / (‖g‖ + 1e-12), the second
  filter and gradient at θ + ε, SGD's first step (momentum buffer = that gradient)."""
  with jax.enable_x64(True):
    variables, x = to64(variables), jnp.asarray(x, jnp.float64)
    theta = norm_params(variables)

    def filtered(theta, first=None):
      ents = losses.entropy(forward(module, with_norm_params(variables, theta), x))
      keep = ents < margin if first is None else first & (ents < margin)
      return jnp.sum(jnp.where(keep, ents, 0.0)) / jnp.sum(keep), keep

    (_, first), g1 = jax.value_and_grad(filtered, has_aux=True)(theta)
    norm = jnp.sqrt(sum(jnp.sum(g ** 2) for g in g1.values()))
    perturbed = {p: theta[p] + rho * g1[p] / (norm + 1e-12) for p in theta}
    (second_loss, second), g2 = jax.value_and_grad(filtered, has_aux=True)(perturbed, first)
    stepped = {p: theta[p] - lr * g2[p] for p in theta}
    return stepped, float(second_loss), np.asarray(first), np.asarray(second)


def test_sar_one_step_is_the_filtered_sharpness_aware_update_of_its_equations():
  module, variables, batch = setup()
  ents = np.asarray(losses.entropy(forward(module, variables, batch.x)))
  # E0 between the entropies, so that each filter keeps some examples and drops others
  entropy_margin = float(np.median(ents)) / np.log(NUM_CLASSES) + 1e-4
  context = SourceContext(variables, NUM_CLASSES, 64)
  adapter = sar(module, context, learning_rate=0.5, rho=0.5, entropy_margin=entropy_margin,
                reset_threshold=0.0)
  state, logits = adapter.step(adapter.init(variables, jax.random.key(0)), batch)
  expected, second_loss, first, second = sar_reference(
      module, variables, batch.x, entropy_margin * np.log(NUM_CLASSES), 0.5, 0.5)
  assert 0 < first.sum() < len(first) and second.sum() > 0
  for path, value in norm_params(state.variables).items():
    np.testing.assert_allclose(value, expected[path], rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(float(state.loss_average), second_loss, rtol=1e-5)
  # the prediction is the model's before the update
  np.testing.assert_allclose(logits, forward(module, variables, batch.x), rtol=1e-6)
  assert bool(adapter.took_step(state))


def test_sar_moving_average_and_recovery_to_the_source_model():
  module, variables, batch = setup()
  context = SourceContext(variables, NUM_CLASSES, 64)
  keep_all = dict(learning_rate=0.5, entropy_margin=1.0)     # E0 = ln C: every example
  adapter = sar(module, context, reset_threshold=0.0, **keep_all)
  first, _ = adapter.step(adapter.init(variables, jax.random.key(0)), batch)
  second, _ = adapter.step(first, batch)
  # e_m = 0.9 · e_m + 0.1 · (the batch's second filtered entropy); recompute that entropy
  third = adapter.step(first._replace(loss_average=jnp.float32(jnp.nan)), batch)[0]
  np.testing.assert_allclose(float(second.loss_average),
                             0.9 * float(first.loss_average) + 0.1 * float(third.loss_average),
                             rtol=1e-6)
  # a moving average under the threshold returns the parameters to the source; the
  # momentum stays (the authors' reset does not reach their base SGD's buffers)
  recovering = sar(module, context, reset_threshold=100.0, **keep_all)
  start = recovering.init(variables, jax.random.key(0))
  recovered, _ = recovering.step(recovering.step(start, batch)[0], batch)
  chex.assert_trees_all_equal(recovered.variables, variables)
  assert any(np.any(np.asarray(leaf) != 0) for leaf in jax.tree.leaves(recovered.opt_state))
  assert float(recovered.loss_average) < 100.0     # the average is kept across a recovery


def test_sar_batch_whose_filter_keeps_nothing_adapts_nothing_and_the_metrics_say_so():
  module, variables, batch = setup()
  context = SourceContext(variables, NUM_CLASSES, 4)
  adapter = sar(module, context, learning_rate=0.5, entropy_margin=1e-6)   # E0 ≈ 0
  start = adapter.init(variables, jax.random.key(0))
  state, logits = adapter.step(start, batch)
  chex.assert_trees_all_equal(state.variables, start.variables)
  chex.assert_trees_all_equal(state.opt_state, start.opt_state)
  assert np.isnan(float(state.loss_average)) and not bool(adapter.took_step(state))
  chex.assert_tree_all_finite(logits)
  data, _, _ = toy_clients([8, 0, 6], num_classes=NUM_CLASSES, pad_to=8)
  sums = build_test_time(adapter, 4, 'online')(variables, data, jax.random.key(1))
  np.testing.assert_array_equal(sums['adapted_batches'], [0, 0, 0])
  np.testing.assert_array_equal(sums['batches'], [2, 0, 2])
  flat = evaluation.summarize({'global+sar': {'test': jax.tree.map(np.asarray, sums)}})
  assert flat['global+sar/test/adapted_batches'] == 0.0
  assert np.isfinite(flat['global+sar/test/loss'])
  every = sar(module, context, learning_rate=0.5, entropy_margin=1.0)
  sums = build_test_time(every, 4, 'online')(variables, data, jax.random.key(1))
  np.testing.assert_array_equal(sums['adapted_batches'], [2, 0, 2])


def test_sar_rate_is_the_authors_resnet_rate_at_the_test_batch():
  # 0.00025 from batch 32 up, 0.00025 · 2B / 64 below (their main.py)
  from fedjax_shift.adapters.sar import learning_rate_for
  assert learning_rate_for(0.00025, 64) == 0.00025
  assert learning_rate_for(0.00025, 32) == 0.00025
  assert learning_rate_for(0.00025, 16) == pytest.approx(0.00025 * 2 * 16 / 64)


# --- CoTTA -----------------------------------------------------------------------------

def test_cotta_step_is_the_soft_pseudo_label_step_the_teacher_average_and_the_restore():
  module, variables, batch = setup()
  # p_th = 0: the source model is always confident enough, so the pseudo-label is the
  # teacher's logits on the batch itself (Eq. 2); no restore (p = 0).
  adapter = cotta(module, learning_rate=0.1, restore_probability=0.0,
                  confidence_threshold=0.0, num_augmentations=2)
  state, prediction = adapter.step(adapter.init(variables, jax.random.key(0)), batch)
  teacher_logits = forward(module, variables, batch.x)
  np.testing.assert_allclose(prediction, teacher_logits, rtol=1e-6)

  def loss(params):   # Eq. 4: −Σ softmax(teacher) log softmax(student), mean over the batch
    logits = forward(module, {**variables, 'params': params}, batch.x)
    return jnp.mean(-jnp.sum(jax.nn.softmax(teacher_logits) * jax.nn.log_softmax(logits), -1))

  grads = jax.grad(loss)(variables['params'])
  opt = optax.adam(0.1)
  updates, _ = opt.update(grads, opt.init(variables['params']), variables['params'])
  student = optax.apply_updates(variables['params'], updates)
  chex.assert_trees_all_close(state.student['params'], student, rtol=1e-5, atol=1e-7)
  # Eq. 1: θ' = 0.999 θ' + 0.001 θ, from θ' = θ_0
  expected_teacher = jax.tree.map(lambda t, s: 0.999 * t + 0.001 * s, variables['params'], student)
  chex.assert_trees_all_close(state.teacher['params'], expected_teacher, rtol=1e-6, atol=1e-8)
  # p = 1: every weight returns to the source value after the step; the teacher keeps
  # its average of the stepped student
  restoring = cotta(module, learning_rate=0.1, restore_probability=1.0,
                    confidence_threshold=0.0, num_augmentations=2)
  restored, _ = restoring.step(restoring.init(variables, jax.random.key(0)), batch)
  chex.assert_trees_all_equal(restored.student['params'], variables['params'])
  chex.assert_trees_all_close(restored.teacher['params'], expected_teacher, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize('kind', ['translate_rotate_jitter', 'crop_flip'])
def test_cotta_views_are_one_draw_per_copy_shared_by_the_batch(kind):
  """Copy i is the augmentation of split(key, N)[i] applied to every example alike."""
  from fedjax_shift.adapters.cotta import batch_views
  from fedjax_shift.data.augment import MARGINAL_AUGMENTATIONS
  x = jax.random.uniform(jax.random.key(0), (5, 12, 12, 1))
  views = batch_views(jax.random.key(1), x, 3, kind)
  for i, key in enumerate(jax.random.split(jax.random.key(1), 3)):
    expected = jnp.stack([MARGINAL_AUGMENTATIONS[kind](key, image) for image in x])
    np.testing.assert_allclose(views[i], expected, atol=1e-6)
  assert not np.allclose(views[0], views[1])


@pytest.mark.parametrize('shape', [(4, 10, 10, 3), (4, 7)])
def test_a_batch_augmentation_is_the_one_image_augmentation_of_its_key_on_each_image(shape):
  """augment_shared folds the shift into the rotation and takes each image's mean from the
  padded image: the same images as ``augment`` (colour images; vectors get one jitter)."""
  from fedjax_shift.data.augment import augment, augment_shared
  x = jax.random.uniform(jax.random.key(0), shape)
  key = jax.random.key(5)
  np.testing.assert_allclose(augment_shared(key, x), jnp.stack([augment(key, i) for i in x]),
                             atol=1e-6)


@pytest.mark.parametrize('size', [100_000, 300])
def test_stochastic_restore_puts_back_about_p_of_the_elements_and_leaves_the_rest(size):
  """100,000 elements at p = 0.01 take the gap draw (restore_gaps), 300 one Bernoulli
  draw each: about n·p elements (± 6 binomial standard deviations over 20 keys) hold the
  source's value, the others the weights', and the gaps reach the tensor's end."""
  from fedjax_shift.adapters.cotta import restore_gaps, stochastic_restore
  assert (restore_gaps(size, 0.01) is None) == (size == 300)
  weights, source = jnp.ones(size), -jnp.arange(1, size + 1, dtype=jnp.float32)
  restored = [np.asarray(stochastic_restore(jax.random.key(i), weights, source, 0.01))
              for i in range(20)]
  assert all(np.all((r == 1) | (r == np.asarray(source))) for r in restored)
  count = sum(np.sum(r != 1) for r in restored)
  mean, sd = 20 * size * 0.01, np.sqrt(20 * size * 0.01 * 0.99)
  assert abs(count - mean) < 6 * sd, (count, mean)
  if size == 100_000:   # the last restored position: within the last 2,000 but for 1e-8
    assert all(np.flatnonzero(r != 1).max() > size - 2000 for r in restored)
  chex.assert_trees_all_equal(stochastic_restore(jax.random.key(0), weights, source, 0.0),
                              weights)


def test_restore_gaps_falls_back_where_the_gaps_would_not_cover_the_tensor():
  """The gap draw needs a bounded count and an int32 sum: a dense p, a traced p and a
  tensor so large that the capped gaps could stop short take the Bernoulli draw."""
  from fedjax_shift.adapters.cotta import restore_gaps
  draws, cap = restore_gaps(156_800, 0.01)
  assert 1568 < draws < 1568 + 600 and cap == 156_801     # n·p + the Chernoff margin
  assert restore_gaps(156_800, 0.3) is None
  assert restore_gaps(156_800, jnp.float32(0.01)) is None
  assert restore_gaps(10 ** 8, 1e-6) is None      # cap 8.8e6: (1 − p)^cap = e^−8.8
  assert restore_gaps(2_359_296, 0.01)[1] < 2_359_296     # capped, its tail e^−849


def test_cotta_restores_about_p_of_the_weights_and_averages_views_when_unsure():
  module, variables, batch = setup()
  adapter = cotta(module, learning_rate=0.1, restore_probability=0.3,
                  confidence_threshold=1.0, num_augmentations=3)
  state, prediction = adapter.step(adapter.init(variables, jax.random.key(0)), batch)
  source = np.concatenate([np.ravel(a) for a in jax.tree.leaves(variables['params'])])
  after = np.concatenate([np.ravel(a) for a in jax.tree.leaves(state.student['params'])])
  fraction = np.mean(after == source)
  assert 0.25 < fraction < 0.35, fraction          # of 1,000+ weights, Bernoulli(0.3)
  # p_th = 1: unsure on every batch, so the prediction averages the teacher's logits
  # over the augmented copies (not its logits on the batch)
  assert not np.allclose(prediction, forward(module, variables, batch.x), atol=1e-4)


# --- LAME ------------------------------------------------------------------------------

def lame_reference(probs, features, knn, kind, max_steps=100):
  """The authors' LAME in float64 numpy: the affinity of the L2-normalised features
  ('knn': each example's k nearest others; 'rbf': exp(−d² / 2σ²), σ the mean k-th
  smallest distance counting the example itself), then z ← softmax(log p + W z) from
  z = p until the entropy energy changes by ≤ 1e-8 of itself (from the third step)."""
  features = features / np.linalg.norm(features, axis=1, keepdims=True)
  distance = np.linalg.norm(features[None] - features[:, None], axis=-1)
  if kind == 'rbf':
    sigma = np.sort(distance, axis=1)[:, knn - 1].mean()
    kernel = np.exp(-distance ** 2 / (2 * sigma ** 2))
  else:
    np.fill_diagonal(distance, np.inf)
    kernel = np.zeros_like(distance)
    for i, row in enumerate(distance):
      kernel[i, np.argsort(row)[:knn]] = 1.0
  unary = -np.log(probs + 1e-10)
  z, old = probs.copy(), np.inf
  for i in range(max_steps):
    pairwise = kernel @ z
    exponent = -unary + pairwise
    z = np.exp(exponent - exponent.max(1, keepdims=True))
    z /= z.sum(1, keepdims=True)
    energy = np.sum(unary * z - pairwise * z + z * np.log(np.clip(z, 1e-20, None)))
    if i > 1 and abs(energy - old) <= 1e-8 * abs(old):
      break
    old = energy
  return z, kernel


@pytest.mark.parametrize('kind', ['rbf', 'knn'])
def test_lame_is_the_laplacian_fixed_point_of_the_authors_loop(kind):
  module, variables, batch = setup(batch=12)
  adapter = lame_lib.lame(module, affinity_kind=kind, knn=3)
  _, log_z = adapter.step(adapter.init(variables, None), batch)
  features = np.asarray(models.head_hidden(variables, models.features(module, variables,
                                                                      batch.x)), np.float64)
  probs = np.asarray(jax.nn.softmax(forward_eval(module, variables, batch.x)), np.float64)
  expected, kernel = lame_reference(probs, features, 3, kind)
  np.testing.assert_allclose(np.exp(log_z), expected, atol=1e-5)
  # the answer is a fixed point of Eq. 7: z = softmax(log p + W z)
  z = np.exp(np.asarray(log_z, np.float64))
  again = np.log(probs) + kernel @ z
  again = np.exp(again - again.max(1, keepdims=True))
  np.testing.assert_allclose(z, again / again.sum(1, keepdims=True), atol=1e-4)
  assert not np.allclose(z, probs, atol=1e-3)        # and the outputs did move


def forward_eval(module, variables, x):
  return models.apply(module, variables, x)[0]


def test_lame_wrapped_repeats_take_no_part_in_the_affinity_and_a_lone_example_keeps_p():
  module, variables, batch = setup(batch=6)
  feats = jnp.asarray(np.random.default_rng(3).normal(size=(6, 5)), jnp.float32)
  valid = jnp.array([True, True, True, True, False, False])
  kernel = np.asarray(lame_lib.affinity(lame_lib.normalize(feats), valid, 'knn', 2))
  assert kernel[4:].sum() == 0 and kernel[:, 4:].sum() == 0
  np.testing.assert_array_equal(kernel[:4].sum(1), [2, 2, 2, 2])
  adapter = lame_lib.lame(module, affinity_kind='knn')
  one = AdaptBatch(batch.x, jnp.array([1.0, 0, 0, 0, 0, 0]))
  _, log_z = adapter.step(adapter.init(variables, None), one)
  np.testing.assert_allclose(log_z[0], jax.nn.log_softmax(forward_eval(module, variables,
                                                                        batch.x))[0], atol=1e-6)


# --- PL and conjugate PL ------------------------------------------------------------------

def test_pl_steps_on_the_confident_examples_hard_labels_only():
  module, variables, batch = setup()
  logits = forward(module, variables, batch.x)
  confidence = np.asarray(jnp.max(jax.nn.softmax(logits), -1))
  threshold = float(np.median(confidence))
  adapter = pl(module, learning_rate=0.5, momentum=0.0, threshold=threshold)
  state, prediction = adapter.step(adapter.init(variables, None), batch)
  keep = confidence >= threshold
  labels = jnp.argmax(logits, -1)
  theta = norm_params(variables)

  def loss(theta):     # Lee's Eq. 1 on the confident examples
    out = forward(module, with_norm_params(variables, theta), batch.x)
    ce = optax.softmax_cross_entropy_with_integer_labels(out, labels)
    return jnp.sum(jnp.where(keep, ce, 0.0)) / keep.sum()

  grads = jax.grad(loss)(theta)
  for path, value in norm_params(state.variables).items():
    np.testing.assert_allclose(value, theta[path] - 0.5 * grads[path], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(prediction, logits, rtol=1e-6)
  # a batch with no confident example: no step, counted out of adapted_batches
  timid = pl(module, learning_rate=0.5, threshold=0.999)
  start = timid.init(variables, None)
  unchanged, _ = timid.step(start, batch)
  chex.assert_trees_all_equal(unchanged.variables, start.variables)
  assert not bool(timid.took_step(unchanged)) and bool(adapter.took_step(state))


def test_conjugate_pl_of_the_cross_entropy_is_the_entropy_of_tempered_logits():
  logits = jnp.array([[2.0, -1.0, 0.5], [0.1, 0.1, 3.0]])
  for temperature in (1.0, 2.5):
    np.testing.assert_allclose(conjugate_loss(logits, temperature),
                               losses.entropy(logits / temperature), rtol=1e-6)
  # at T = 1 it is Tent (Adam 1e-3 on the BN affine parameters, predicting before)
  module, variables, _ = setup()
  data, _, _ = toy_clients([8, 5], num_classes=NUM_CLASSES, pad_to=8)
  run = lambda adapter: build_test_time(adapter, 4, 'online')(variables, data,
                                                              jax.random.key(0))
  ours, theirs = run(conjugate_pl(module)), run(tent(module))
  np.testing.assert_array_equal(ours['predictions'], theirs['predictions'])
  np.testing.assert_allclose(ours['loss'], theirs['loss'], rtol=1e-5)


# --- RoTTA ------------------------------------------------------------------------------

class ReferenceCSTU:
  """The authors' CSTU memory (RoTTA's core/utils/memory.py), transcribed: lists per
  class of [x, uncertainty, age]."""

  def __init__(self, capacity, num_class, lambda_t=1.0, lambda_u=1.0):
    self.capacity, self.num_class = capacity, num_class
    self.per_class = capacity / num_class
    self.lambda_t, self.lambda_u = lambda_t, lambda_u
    self.data = [[] for _ in range(num_class)]

  def occupancy(self):
    return sum(len(items) for items in self.data)

  def score(self, age, uncertainty):
    return (self.lambda_t * 1 / (1 + np.exp(-age / self.capacity)) +
            self.lambda_u * uncertainty / np.log(self.num_class))

  def add_instance(self, x, prediction, uncertainty):
    if self.remove_instance(prediction, self.score(0, uncertainty)):
      self.data[prediction].append([x, uncertainty, 0])
    for items in self.data:
      for item in items:
        item[2] += 1

  def remove_instance(self, cls, score):
    if len(self.data[cls]) < self.per_class:
      if self.occupancy() < self.capacity:
        return True
      counts = [len(items) for items in self.data]
      return self.remove_from_classes([c for c, n in enumerate(counts) if n == max(counts)],
                                      score)
    return self.remove_from_classes([cls], score)

  def remove_from_classes(self, classes, score_base):
    best = None
    for cls in classes:
      for index, (_, uncertainty, age) in enumerate(self.data[cls]):
        score = self.score(age, uncertainty)
        if best is None or score >= best[0]:
          best = (score, cls, index)
    if best is None:
      return True
    if best[0] > score_base:
      self.data[best[1]].pop(best[2])
      return True
    return False


def test_rotta_memory_holds_what_the_authors_cstu_holds_over_a_stream():
  from fedjax_shift.adapters.rotta import add_instance, empty_memory
  rng = np.random.default_rng(0)
  capacity, num_classes = 6, 3
  reference = ReferenceCSTU(capacity, num_classes)
  memory = empty_memory(capacity, (2,))
  add = jax.jit(lambda m, x, label, u: add_instance(m, x, label, u, num_classes, 1.0, 1.0))
  # a label-shifted stream: mostly class 0 first, then classes 1 and 2
  labels = np.concatenate([rng.choice(3, 20, p=[0.8, 0.1, 0.1]), rng.choice(3, 20, p=[0.1, 0.45, 0.45])])
  for i, label in enumerate(labels):
    x = np.array([i, label], np.float32)
    uncertainty = float(rng.random())
    reference.add_instance(x, int(label), uncertainty)
    memory = add(memory, jnp.asarray(x), jnp.int32(label), jnp.float32(uncertainty))
    ours = sorted((int(x[0]), float(a)) for x, a, used in
                  zip(np.asarray(memory.x), np.asarray(memory.age), np.asarray(memory.used)) if used)
    theirs = sorted((int(x[0]), float(age)) for items in reference.data for x, _, age in items)
    assert ours == theirs, (i, ours, theirs)
  assert reference.occupancy() == capacity


def test_rotta_robust_batch_norm_mixes_the_kept_statistics_with_the_batchs():
  from fedjax_shift.adapters.rotta import robust_forward
  module, variables, batch = setup()
  variables = {**variables, 'batch_stats': jax.tree.map(lambda s: s + 0.3, variables['batch_stats'])}
  logits, kept = robust_forward(module, variables, batch.x, batch.weight, 0.05)
  # Eq. 3–4 layer by layer: the mixed statistics with prior 1 − α, the biased variance
  np.testing.assert_allclose(logits, models.eval_with_mixed_statistics(
      module, variables, batch.x, 0.95, unbiased=False), rtol=1e-5, atol=1e-6)
  first = variables['batch_stats']['encoder']['BatchNorm_0']
  inputs = batch.x.reshape(len(batch.x), -1) @ variables['params']['encoder']['Dense_0']['kernel'] + \
      variables['params']['encoder']['Dense_0']['bias']
  np.testing.assert_allclose(kept['encoder']['BatchNorm_0']['mean'],
                             0.95 * first['mean'] + 0.05 * inputs.mean(0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(kept['encoder']['BatchNorm_0']['var'],
                             0.95 * first['var'] + 0.05 * inputs.var(0), rtol=1e-5, atol=1e-6)
  # weight 0 examples (wrapped repeats, empty memory slots) are not in the statistics
  half = robust_forward(module, variables, batch.x, jnp.array([1.0, 1, 1, 0, 0, 0]), 0.05)[1]
  only = robust_forward(module, variables, batch.x[:3], jnp.ones(3), 0.05)[1]
  chex.assert_trees_all_close(half, only, rtol=1e-5, atol=1e-6)


def test_rotta_learns_every_update_frequency_examples_and_predicts_with_the_teacher():
  from fedjax_shift.adapters.rotta import rotta
  module, variables, batch = setup(batch=6)
  variables = {**variables, 'batch_stats': jax.tree.map(lambda s: s + 0.3, variables['batch_stats'])}
  adapter = rotta(module, NUM_CLASSES, (4, 4, 1), memory_size=6, update_frequency=4)
  start = adapter.init(variables, jax.random.key(0))
  state, logits = adapter.step(start, batch)
  np.testing.assert_allclose(logits, forward_eval(module, variables, batch.x), rtol=1e-6)
  assert int(state.seen) == 6 and int(jnp.sum(state.memory.used)) >= NUM_CLASSES
  assert int(state.opt_state[0].count) == 1          # one update: after example 4 of 6
  state, _ = adapter.step(state, batch)
  assert int(state.opt_state[0].count) == 3          # after examples 8 and 12
  assert not np.allclose(state.teacher['batch_stats']['encoder']['BatchNorm_0']['mean'],
                         variables['batch_stats']['encoder']['BatchNorm_0']['mean'])
  # F = 64: six examples reach no update; the model stays the source model
  waiting = rotta(module, NUM_CLASSES, (4, 4, 1))
  kept, _ = waiting.step(waiting.init(variables, jax.random.key(0)), batch)
  chex.assert_trees_all_equal(kept.student, variables)


# --- NOTE -------------------------------------------------------------------------------

def conv_bn_model():
  import flax.linen as nn

  class Encoder(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
      x = nn.Conv(3, (3, 3))(x)
      x = nn.BatchNorm(use_running_average=not train)(x)
      return jnp.mean(nn.relu(x), (1, 2))

  module = models.Classifier(Encoder(), num_classes=NUM_CLASSES)
  variables = models.init(module, jax.random.key(0), jnp.zeros((1, 4, 4, 1)))
  variables = {**variables, 'batch_stats': jax.tree.map(lambda s: s + 0.2, variables['batch_stats'])}
  return module, variables


def test_note_iabn_corrects_the_statistics_only_beyond_k_standard_errors():
  from fedjax_shift.adapters.note import iabn_forward
  module, variables = conv_bn_model()
  x = jnp.asarray(np.random.default_rng(2).normal(size=(5, 4, 4, 1)) * [[[[1.0]]], [[[4.0]]],
                                                                          [[[1.0]]], [[[0.2]]],
                                                                          [[[1.0]]]], jnp.float32)
  captured = {}

  def spy(next_fun, args, kwargs, context):
    import flax.linen as nn
    if isinstance(context.module, nn.BatchNorm):
      captured['input'] = args[0]
    return next_fun(*args, **kwargs)

  import flax.linen as nn
  with nn.intercept_methods(spy):
    module.apply(variables, x, train=False)
  h = np.asarray(captured['input'], np.float64)          # [5, 4, 4, 3], L = 16
  stats = variables['batch_stats']['encoder']['BatchNorm_0']
  mean, var = np.asarray(stats['mean'], np.float64), np.asarray(stats['var'], np.float64)
  eps, k, length = 1e-5, 4.0, 16
  mu_i = h.mean((1, 2), keepdims=True)
  var_i = h.var((1, 2), keepdims=True, ddof=1)
  shrink = lambda d, t: np.sign(d) * np.maximum(np.abs(d) - t, 0)
  mu = mean + shrink(mu_i - mean, k * np.sqrt((var + eps) / length))
  sigma2 = np.maximum(var + shrink(var_i - var, k * (var + eps) * np.sqrt(2 / (length - 1))), 0)
  params = variables['params']['encoder']['BatchNorm_0']
  normalised = (h - mu) / np.sqrt(sigma2 + eps) * np.asarray(params['scale']) + np.asarray(params['bias'])
  logits = np.maximum(normalised, 0).mean((1, 2)) @ np.asarray(variables['params']['head']['kernel']) + \
      np.asarray(variables['params']['head']['bias'])
  ours, kept = iabn_forward(module, variables, x, jnp.ones(5), k, 0.01, train=False)
  np.testing.assert_allclose(ours, logits, rtol=1e-4, atol=1e-5)
  chex.assert_trees_all_equal(kept, variables['batch_stats'])
  # with k = ∞ nothing is corrected: BatchNorm on the running statistics
  plain, _ = iabn_forward(module, variables, x, jnp.ones(5), float('inf'), 0.01, train=False)
  np.testing.assert_allclose(plain, forward_eval(module, variables, x), rtol=1e-5, atol=1e-6)
  # in training the layer statistics are the batch's (unbiased), the running ones move 1 %
  _, moved = iabn_forward(module, variables, x, jnp.ones(5), k, 0.01, train=True)
  np.testing.assert_allclose(moved['encoder']['BatchNorm_0']['var'],
                             0.99 * var + 0.01 * h.reshape(-1, 3).var(0, ddof=1), rtol=1e-5)


def test_note_pbrs_keeps_classes_balanced_and_each_of_a_class_with_probability_m_over_n():
  from fedjax_shift.adapters.note import add_instance, empty_reservoir
  add = jax.jit(lambda r, x, label, key: add_instance(r, x, label, key, NUM_CLASSES))
  # a stream of one class: a reservoir sample, each of n examples kept with probability M/n
  def keep_single_class(seed, capacity=4, n=12):
    reservoir = empty_reservoir(capacity, (1,), NUM_CLASSES)
    for i in range(n):
      reservoir = add(reservoir, jnp.array([float(i)]), jnp.int32(0),
                      jax.random.fold_in(jax.random.key(seed), i))
    return np.asarray(reservoir.x[:, 0]).astype(int)
  kept = np.zeros(12)
  for seed in range(600):
    kept[keep_single_class(seed)] += 1
  np.testing.assert_allclose(kept / 600, 4 / 12, atol=0.07)
  # a label-shifted stream: class 0 first fills the memory, then the others take places
  # from the largest class until the classes hold 2, 2, 2
  reservoir = empty_reservoir(6, (1,), NUM_CLASSES)
  stream = [0] * 10 + [1, 2] * 6
  for i, label in enumerate(stream):
    reservoir = add(reservoir, jnp.array([float(i)]), jnp.int32(label), jax.random.key(i))
  counts = np.bincount(np.asarray(reservoir.label)[np.asarray(reservoir.used)], minlength=3)
  np.testing.assert_array_equal(counts, [2, 2, 2])


def test_note_learns_on_its_memory_every_update_frequency_examples():
  from fedjax_shift.adapters.note import note
  module, variables, batch = setup(batch=6)
  adapter = note(module, NUM_CLASSES, (4, 4, 1), memory_size=6, update_frequency=4,
                 learning_rate=0.1)
  state, logits = adapter.step(adapter.init(variables, jax.random.key(0)), batch)
  # a dense model: IABN is BatchNorm, the batch predicted with the running statistics
  np.testing.assert_allclose(logits, forward_eval(module, variables, batch.x), rtol=1e-6)
  assert int(state.opt_state[0].count) == 1 and int(jnp.sum(state.reservoir.used)) == 6
  assert not np.allclose(state.variables['batch_stats']['encoder']['BatchNorm_0']['mean'],
                         variables['batch_stats']['encoder']['BatchNorm_0']['mean'])
  state, _ = adapter.step(state, batch)
  assert int(state.opt_state[0].count) == 3


@pytest.mark.parametrize('name', ['rotta', 'note'])
def test_memory_adapters_count_the_batches_that_reach_an_update(name):
  """Batches of 4 with an update every 6 examples: the stream's totals 4, 8, 12, 16, 20,
  24 cross a multiple of 6 on batches 1, 2, 4 and 5 (0-based), so 4 of the 6 batches
  adapt; a client of 8 examples (its batches 2 … 5 wrap, weight 0) adapts on batch 1."""
  from fedjax_shift.adapters import ADAPTERS
  import ml_collections
  module, variables, _ = setup()
  section = ml_collections.ConfigDict({**ADAPTERS.defaults(name).to_dict(),
                                       'memory_size': 6, 'update_frequency': 6})
  adapter = ADAPTERS.get(name)(module, section, SourceContext(variables, NUM_CLASSES, 4,
                                                              input_shape=(4, 4, 1)))
  data, _, _ = toy_clients([24, 8], num_classes=NUM_CLASSES, pad_to=24)
  sums = build_test_time(adapter, 4, 'online')(variables, data, jax.random.key(0))
  np.testing.assert_array_equal(sums['adapted_batches'], [4, 1])
  np.testing.assert_array_equal(sums['batches'], [6, 2])


@pytest.mark.parametrize('name, field, value, mode', [
    ('note', 'memory_size', 32, 'online'), ('note', 'update_frequency', 32, 'online'),
    ('rotta', 'update_frequency', 32, 'online'), ('note', 'update_frequency', 8, 'episodic')])
def test_a_memory_or_update_longer_than_the_stream_is_refused_before_compiling(name, field,
                                                                               value, mode):
  """24 test examples online (one batch of 4 episodic): a memory or update period longer
  than that would never adapt, and is refused naming the field."""
  from fedjax_shift.adapters import ADAPTERS
  import ml_collections
  module, variables, _ = setup()
  section = ml_collections.ConfigDict({**ADAPTERS.defaults(name).to_dict(),
                                       'memory_size': 4, 'update_frequency': 4})
  section[field] = value
  adapter = ADAPTERS.get(name)(module, section, SourceContext(variables, NUM_CLASSES, 4,
                                                              input_shape=(4, 4, 1)))
  data, _, _ = toy_clients([24], num_classes=NUM_CLASSES)
  with pytest.raises(ValueError, match=f'config.adapters.{name}.{field} = {value} is longer '
                                       'than the test stream'):
    jax.eval_shape(lambda: build_test_time(adapter, 4, mode)(variables, data,
                                                             jax.random.key(0)))


# --- the time-limited stream -------------------------------------------------------------

@pytest.mark.parametrize('name', ['tent', 'sar', 'cotta', 'rotta', 'note', 'lame', 'pl'])
def test_time_limited_stream_adapts_every_kth_batch_and_predicts_the_rest_with_the_current_model(name):
  """With stream rate C = 2.5 an adapter adapts on batches 0, 3, 6, … (⌈C⌉ = 3) and
  predicts the two between with its current model: a hand-run loop of step / predict."""
  from fedjax_shift.adapters import ADAPTERS
  import ml_collections
  module, variables, _ = setup()
  variables = {**variables, 'batch_stats': jax.tree.map(lambda s: s + 0.3, variables['batch_stats'])}
  section = ml_collections.ConfigDict({**ADAPTERS.defaults(name).to_dict(),
                                       **{'cotta': {'num_augmentations': 2},
                                          'rotta': {'memory_size': 6, 'update_frequency': 4},
                                          'note': {'memory_size': 6, 'update_frequency': 4},
                                          'sar': {'entropy_margin': 1.0},
                                          'pl': {'threshold': 0.34}}.get(name, {})})
  context = SourceContext(variables, NUM_CLASSES, 4, input_shape=(4, 4, 1))
  adapter = ADAPTERS.get(name)(module, section, context)
  data, xs, _ = toy_clients([24], num_classes=NUM_CLASSES)          # 6 batches of 4
  sums = build_test_time(adapter, 4, 'online', stream_rate=2.5)(variables, data,
                                                                  jax.random.key(0))
  state = adapter.init(variables, jax.random.fold_in(jax.random.key(0), 0))
  expected = []
  for t in range(6):
    batch = AdaptBatch(jnp.asarray(xs[0][4 * t:4 * t + 4]), jnp.ones(4))
    if t % 3 == 0:
      state, logits = adapter.step(state, batch)
    else:
      logits = adapter.predict(state, batch)
    expected.append(np.argmax(logits, -1))
  np.testing.assert_array_equal(sums['predictions'][0], np.concatenate(expected))
  plain = build_test_time(adapter, 4, 'online')(variables, data, jax.random.key(0))
  every = build_test_time(adapter, 4, 'online', stream_rate=1.0)(variables, data,
                                                                  jax.random.key(0))
  np.testing.assert_array_equal(every['predictions'], plain['predictions'])


def test_time_limited_stream_refuses_what_it_cannot_run():
  from fedjax_shift.adapters.no_adapt import no_adapt
  module, variables, _ = setup()
  with pytest.raises(ValueError, match='stream_rate: must be 0'):
    build_test_time(tent(module), 4, 'online', stream_rate=0.5)
  with pytest.raises(ValueError, match="mode 'episodic' cannot run it"):
    build_test_time(tent(module), 4, 'episodic', stream_rate=2.0)
  with pytest.raises(ValueError, match='cannot predict without adapting'):
    build_test_time(no_adapt(module), 4, 'online', stream_rate=2.0)


def atp_stream_config():
  from configs import atp as atp_configs
  config = atp_configs.get_config('digits_hybrid,tiny')
  config.tta.rows = ('no_adapt', 'tent', 'memo')
  config.tta.stream_rows = ('tent',)
  config.tta.stream_rate = 2.0
  return config


@pytest.mark.parametrize('field, value, message', [
    ('stream_rate', 0.0, 'config.tta.stream_rate'),
    ('stream_rate', 0.5, 'config.tta.stream_rate'),
    ('stream_rows', ('tent', 'tent'), 'config.tta.stream_rows'),
    ('stream_rows', ('sar',), "'sar' is not a row"),
    ('stream_rows', ('memo',), "mode 'episodic' cannot run it"),
    ('stream_rows', ('no_adapt',), 'no_adapt cannot predict without adapting'),
])
def test_atp_time_limited_rows_are_refused_before_anything_trains(field, value, message,
                                                                   tmp_path):
  from fedjax_shift import config as config_lib
  config = atp_stream_config()
  if field == 'stream_rows' and value == ('no_adapt',):
    config.tta.mode.no_adapt = 'online'
  config.tta[field] = value
  with pytest.raises(ValueError, match=message):
    config_lib.validate(config, str(tmp_path))


@pytest.mark.parametrize('name, field, value, message', [
    ('rotta', 'memory_size', 4, 'less than one example of each'),
    ('note', 'memory_size', 100000, 'longer than the test stream')])
def test_atp_adapter_rows_the_data_cannot_hold_are_refused_before_pretraining(
    name, field, value, message, tmp_path):
  import os
  from fedjax_shift import pipelines
  config = atp_stream_config()
  config.tta.rows = ('no_adapt', name)
  config.tta.stream_rows = ()
  config.adapters[name][field] = value
  with pytest.raises(ValueError, match=f"tta.rows \\('{name}'\\).*{field}.*{message}"):
    pipelines.run(config, str(tmp_path))
  assert not any('pretrain' in dirs for _, dirs, _ in os.walk(tmp_path))


def test_atp_time_limited_rows_give_a_table_beside_table_1(tmp_path):
  import json
  import os
  from fedjax_shift import pipelines
  config = atp_stream_config()
  config.tta.rows = ('no_adapt', 'tent')
  out = pipelines.run(config, str(tmp_path))
  assert list(out.records['table1']) == ['no_adapt', 'tent']
  assert 'Tent, time-limited' in out.records['markdown']
  with open(os.path.join(tmp_path, 'results.json')) as f:
    stream = json.load(f)['stream']
  assert list(stream) == ['tent', 'tent@stream']
  assert stream['tent']['hybrid']['0'] == out.records['table1']['tent']['hybrid'][0]
  with open(os.path.join(tmp_path, 'hybrid', 'seed_0', 'test_time.json')) as f:
    rows = json.load(f)['rows']
  assert 0 <= rows['tent@stream']['accuracy'] <= 1 and rows['tent@stream']['seconds'] > 0
  from tests.helpers import launch_module   # the table rebuilt from the workdir has it too
  rebuilt = launch_module('report').build([str(tmp_path)], 'atp')
  assert rebuilt.split('Time-limited online stream')[1] == \
      out.records['markdown'].split('Time-limited online stream')[1]


def test_atp_variants_add_the_baselines_rows_and_their_time_limited_runs(tmp_path):
  from configs import atp as atp_configs
  from fedjax_shift import config as config_lib
  config = atp_configs.get_config('digits_hybrid,tiny,tta_baselines,time_limited')
  assert config.tta.rows[-7:] == ('sar', 'cotta', 'rotta', 'note', 'lame', 'pl', 'conjugate_pl')
  # every online row whose adapter predicts without a step; LAME (episodic), ATP, T3A not
  assert config.tta.stream_rows == ('shot', 'tent', 'eata', 'sar', 'cotta', 'rotta', 'note',
                                    'pl', 'conjugate_pl')
  config_lib.validate(config, str(tmp_path))
