"""Training-time augmentation (`config.client.augmentation`): the augmentations, the
local step that applies them, the configs that set them and the checks on them."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_shift.algorithms import base
from fedjax_shift.core import algorithm as alg
from fedjax_shift.core import local
from fedjax_shift.data import augment
from fedjax_shift import metrics as metrics_lib
from helpers import tiny_config

from configs import fedins as fedins_config


def _ramp_images(count, size=8):
  """[count, size, size, 1]: every row a left-to-right ramp, shifted per image, so a
  mirror is never the image itself."""
  cols = jnp.arange(size, dtype=jnp.float32) / size
  return jnp.stack([jnp.broadcast_to((cols + 0.01 * i)[None, :, None], (size, size, 1))
                    for i in range(count)])


def test_no_augmentation_is_the_batch_itself():
  x = _ramp_images(3)
  assert augment.augment_batch(jax.random.key(0), x, ()) is x


def test_flip_gives_each_image_or_its_mirror_and_both_occur():
  x = _ramp_images(64)
  out = augment.augment_batch(jax.random.key(1), x, ('horizontal_flip',))
  chex.assert_shape(out, x.shape)
  same = jnp.all(out == x, axis=(1, 2, 3))
  mirrored = jnp.all(out == x[:, :, ::-1], axis=(1, 2, 3))
  assert bool(jnp.all(same | mirrored))
  # 64 fair coins: both sides come up (probability of one side only is 2 / 2**64)
  assert 0 < int(jnp.sum(mirrored)) < 64


@pytest.mark.parametrize('name,limit', [('rotate15', 15.0), ('rotate30', 30.0)])
def test_rotation_is_rotate_by_a_uniform_angle_within_its_limit(name, limit):
  """rotate<d>(key, image) = rotate(image, u) with u = U(−d, d) drawn from key."""
  image = _ramp_images(1, 16)[0]
  for seed in range(4):
    key = jax.random.key(seed)
    angle = float(jax.random.uniform(key, (), minval=-limit, maxval=limit))
    assert abs(angle) <= limit
    chex.assert_trees_all_close(augment.VIEW_AUGMENTATIONS.get(name)(key, image),
                                augment.rotate(image, angle), atol=1e-6)
  chex.assert_trees_all_close(augment.rotate(image, 0.0), image, atol=1e-6)


def test_augmentation_of_vector_inputs_is_refused():
  with pytest.raises(ValueError, match=r'config.client.augmentation .* needs images'):
    augment.augment_batch(jax.random.key(0), jnp.ones((4, 2)), ('horizontal_flip',))


def _linear_loss(params, model_state, x, y, weight, rng):
  del rng
  logits = x.reshape(x.shape[0], -1) @ params['w']
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
  return local.masked_mean(losses, weight), model_state


def test_local_step_trains_on_the_augmented_batch_as_a_hand_written_step():
  """Two SGD steps of batch 4 with flip + rotate15 equal the same steps written out:
  each batch gathered in the client's order, augmented with the key
  fold_in(fold_in(rng, 2), step), then one gradient step; without augmentation the
  result differs."""
  names = ('horizontal_flip', 'rotate15')
  x = _ramp_images(8)
  y = jnp.arange(8) % 3
  data = alg.ClientData(x, y, jnp.ones(8, bool), jnp.int32(8), jnp.int32(2 ** 30))
  params = {'w': 0.1 * jax.random.normal(jax.random.key(3), (64, 3))}
  optimizer = optax.sgd(0.5)
  rng = jax.random.key(7)
  schedule = local.LocalSchedule(batch_size=4, num_epochs=1, num_steps=0, max_examples=8,
                                 augmentation=names)
  trained, _, _, metrics = local.local_train(_linear_loss, optimizer, params, {}, data, rng,
                                             schedule)
  assert float(metrics['num_steps']) == 2

  order = local.example_order(jax.random.fold_in(rng, 0), data.mask)
  expected = params
  for step in range(2):
    idx = order[step * 4:(step + 1) * 4]
    batch = augment.augment_batch(jax.random.fold_in(jax.random.fold_in(rng, 2), step),
                                  x[idx], names)
    grads = jax.grad(lambda p: _linear_loss(p, {}, batch, y[idx], jnp.ones(4), None)[0])(
        expected)
    expected = jax.tree.map(lambda p, g: p - 0.5 * g, expected, grads)
  chex.assert_trees_all_close(trained, expected, rtol=1e-5, atol=1e-6)

  plain, _, _, _ = local.local_train(_linear_loss, optimizer, params, {}, data, rng,
                                     schedule._replace(augmentation=()))
  assert float(jnp.max(jnp.abs(plain['w'] - trained['w']))) > 1e-4


def test_build_context_passes_the_client_augmentation_to_the_schedule():
  config = tiny_config(**{'client.augmentation': ('horizontal_flip',)})
  context = base.build_context(config, None, max_examples=8)
  assert context.schedule.augmentation == ('horizontal_flip',)
  assert base.build_context(tiny_config(), None, 8).schedule.augmentation == ()


def test_unknown_augmentation_is_refused_naming_the_field():
  config = tiny_config(**{'client.augmentation': ('horizontal_flip', 'spin')})
  with pytest.raises(ValueError, match=r"client.augmentation: unknown augmentation 'spin'"):
    base.check_training(config)


def test_fedins_variants_use_the_authors_training_augmentation():
  """CIFAR-100: flip + ±15°; DomainNet: flip + ±30°; Tiny-ImageNet and the default
  protocol: none (as the authors' train transforms)."""
  assert tuple(fedins_config.get_config('cifar100').client.augmentation) == (
      'horizontal_flip', 'rotate15')
  assert tuple(fedins_config.get_config('domainnet').client.augmentation) == (
      'horizontal_flip', 'rotate30')
  assert tuple(fedins_config.get_config('tiny_imagenet').client.augmentation) == ()
  assert tuple(fedins_config.get_config().client.augmentation) == ()


def test_a_run_recorded_before_the_field_existed_matches_only_its_old_behaviour():
  """A run.json without client.augmentation trained without augmentation: it matches a
  configuration with () and not one that augments."""
  recorded = {'client.learning_rate': '0.1'}
  assert metrics_lib.changed_fields(recorded, {'client.learning_rate': '0.1',
                                           'client.augmentation': '[]'}) == []
  changed = metrics_lib.changed_fields(recorded, {'client.learning_rate': '0.1',
                                              'client.augmentation': '["horizontal_flip"]'})
  assert changed == ['client.augmentation: [] → ["horizontal_flip"]']
  # a record that has the field is compared as recorded
  assert metrics_lib.changed_fields({'client.augmentation': '["rotate15"]'},
                                {'client.augmentation': '[]'}) != []
  np.testing.assert_equal(metrics_lib.FIELDS_ADDED_AT['client.augmentation'], '[]')


def test_cifar100_variant_trains_end_to_end_with_its_augmentation_on_mock_data(tmp_path):
  """configs/fedins.py:cifar100,tiny on TFDS mock data: the backbone is pretrained at
  the clients' 32 px (a 28-px backbone's patch grid would not fit the ViT of 32-px
  inputs) and FedAvg trains with flip + rotate15 to a results table."""
  import tensorflow_datasets as tfds
  from fedjax_shift import pipelines
  from fedjax_shift.pipelines import pretrain
  config = fedins_config.get_config('cifar100,tiny')
  config.algorithms = ('fedavg',)
  assert pretrain.source_data(config)[0][0].shape[1:3] == (32, 32)
  assert pretrain.backbone_fields(config)['image_size'] == 32
  assert 'image_size' not in pretrain.backbone_fields(fedins_config.get_config('tiny'))
  with tfds.testing.mock_data(num_examples=3000):
    results = pipelines.run(config, str(tmp_path))
  rows = results.records['table']['rows']
  assert [row[0] for row in rows] == ['fedavg']
  assert 0.0 <= float(rows[0][1]) <= 100.0
