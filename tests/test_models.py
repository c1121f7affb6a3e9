"""Models: encoder/head split, ATP module counts, BatchNorm modes."""
import chex
import ml_collections
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_shift import models


@pytest.mark.parametrize('name,shape,modules', [
    ('mlp', (2, 28, 28, 1), 6), ('bn_mlp', (2, 28, 28, 1), 14),
    ('atp_cnn', (2, 32, 32, 3), 23),      # the authors' code: the ATP CNN has 23 modules
    ('evolve_cnn', (2, 28, 28, 1), 20),
    ('resnet18', (2, 32, 32, 3), 102),    # the authors' code: ResNet-18 has 102 modules
    # WRN-16-4: stem + 6 blocks × (2 conv + 2 BN × 4) + 3 projections + BN × 4 + head 2
    ('wide_resnet', (2, 32, 32, 1), 70),
    ('lenet5', (2, 28, 28, 1), 8),        # 2 conv + 2 Dense + head, kernel and bias each
])
def test_encoder_head_split_and_module_count(name, shape, modules):
  module = models.MODELS.get(name)(10)
  variables = models.init(module, jax.random.key(0), jnp.zeros(shape))
  assert set(variables['params']) == {'encoder', 'head'}
  assert len(jax.tree_util.tree_leaves(variables)) == modules
  x = jax.random.normal(jax.random.key(1), shape)
  logits, _ = models.apply(module, variables, x)
  features = module.apply(variables, x, method=module.features)
  head = module.apply(variables, features, method=lambda m, f: m.head(f))
  np.testing.assert_allclose(head, logits, rtol=1e-5, atol=1e-5)


def test_head_with_hidden_layers_is_fedevolve_circle_classifier():
  """FedEvolve App. C.2's Circle MLP: the representation 2×256, 256×256, 256×256 and the
  classifier 256×64, 64×2; by hand (2·256 + 256) + 2·(256·256 + 256) + (256·64 + 64) +
  (64·2 + 2) = 148,930 parameters. ``features`` is the 256-wide representation,
  ``models.head`` runs both classifier layers, and a head of a kernel and a bias alone
  (a prototype head put in its place) is linear on the representation."""
  module = models.create(ml_collections.ConfigDict(
      {'name': 'mlp', 'hidden': (256, 256, 256), 'head_hidden': (64,)}), 2)
  variables = models.init(module, jax.random.key(0), jnp.zeros((1, 2)))
  assert models.num_parameters(variables['params']) == 148_930
  assert models.layer_order(module, (2,)) == ('encoder/Dense_0', 'encoder/Dense_1',
                                              'encoder/Dense_2', 'head/hidden_0', 'head')
  x = jax.random.normal(jax.random.key(1), (5, 2))
  features = models.features(module, variables, x)
  chex.assert_shape(features, (5, 256))
  assert models.feature_dim(variables) == 256
  head = variables['params']['head']
  hidden = jax.nn.relu(features @ head['hidden_0']['kernel'] + head['hidden_0']['bias'])
  expected = hidden @ head['kernel'] + head['bias']
  np.testing.assert_allclose(models.apply(module, variables, x)[0], expected, rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(models.head(variables, features), expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(models.head_hidden(variables, features), hidden, rtol=1e-6)
  kernel = jax.random.normal(jax.random.key(2), (256, 2))
  prototype = {'params': {'encoder': variables['params']['encoder'],
                          'head': {'kernel': kernel, 'bias': jnp.array([1.0, -1.0])}}}
  np.testing.assert_allclose(models.apply(module, prototype, x)[0],
                             features @ kernel + jnp.array([1.0, -1.0]), rtol=1e-5, atol=1e-5)
  assert models.feature_dim(prototype) == 256


def test_batch_norm_modes():
  module = models.MODELS.get('bn_mlp')(3, hidden=(8,))
  variables = models.init(module, jax.random.key(0), jnp.zeros((4, 5)))
  x = 3.0 + jax.random.normal(jax.random.key(1), (16, 5))
  eval_logits, same = models.apply(module, variables, x, 'eval')
  assert same is variables
  batch_logits, unchanged = models.apply(module, variables, x, 'batch_stats')
  assert unchanged is variables
  train_logits, updated = models.apply(module, variables, x, 'train')
  np.testing.assert_allclose(batch_logits, train_logits, rtol=1e-6)
  assert not np.allclose(eval_logits, batch_logits)  # running (init) vs batch statistics
  old_mean = variables['batch_stats']['encoder']['BatchNorm_0']['mean']
  new_mean = updated['batch_stats']['encoder']['BatchNorm_0']['mean']
  # momentum 0.9, running mean starts at 0: new running mean = 0.1 · batch mean of the
  # first Dense layer's outputs.
  dense = variables['params']['encoder']['Dense_0']
  batch_mean = (x @ dense['kernel'] + dense['bias']).mean(0)
  np.testing.assert_allclose(old_mean, 0.0)
  np.testing.assert_allclose(new_mean, 0.1 * batch_mean, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match='unknown model mode'):
    models.apply(module, variables, x, 'bogus')


def test_wide_resnet_16_4_parameter_count():
  # Zagoruyko & Komodakis (2016) list WRN-16-4 at 2.7M parameters; this count is
  # that network with bias-free convolutions and 1×1 projection shortcuts, 10 classes.
  module = models.MODELS.get('wide_resnet')(10)
  variables = models.init(module, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
  assert models.num_parameters(variables['params']) == 2_748_890


@pytest.mark.parametrize('channels,count', [((16, 32), 1_068_266), ((64, 128), 4_409_738)])
def test_lenet5_parameter_count_equals_the_upfl_authors_cifar_models(channels, count):
  # CIFAR10_LeNet5_small / _big of the UPFL authors' code, by hand: conv 3·c1·25 + c1,
  # conv c1·c2·25 + c2, Linear c2·8·8·512 + 512, Linear 512·10 + 10.
  c1, c2 = channels
  assert count == (3 * c1 * 25 + c1) + (c1 * c2 * 25 + c2) + (c2 * 64 * 512 + 512) + 5130
  module = models.MODELS.get('lenet5')(10, channels=channels)
  variables = models.init(module, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
  assert models.num_parameters(variables['params']) == count


def _loss(module, variables, x):
  logits, _ = models.apply(module, variables, x, 'train')
  return jnp.sum(jnp.sin(logits))  # a loss whose gradient touches every logit


@pytest.mark.parametrize('impl', ['patches', 'lax_patch_grad'])
@pytest.mark.parametrize('name,shape,extra', [
    ('atp_cnn', (3, 18, 18, 3), {}),       # VALID 3×3, no bias (18: the least size it takes)
    ('evolve_cnn', (3, 16, 16, 1), {}),    # SAME, stride 2, bias
    # padding 1, stride 2, 1×1 projections (slow: wide_resnet covers strided projections)
    pytest.param('resnet18', (2, 16, 16, 3), {}, marks=pytest.mark.slow),
    # pre-activation, 1×1 projections with and without stride: WRN-10-2 (one block per
    # stage; stage 1 widens 16 → 32) has every convolution of WRN-16-4, the slow case
    ('wide_resnet', (2, 16, 16, 1), {'depth': 10, 'widen': 2}),
    pytest.param('wide_resnet', (2, 16, 16, 1), {}, marks=pytest.mark.slow),
])
def test_conv_impl_equals_lax_values_and_gradients(name, shape, extra, impl):
  """Same parameters (names, shapes, init); outputs and gradients equal to 1e-9 in
  float64, where the only difference left — the order of the same sums — is below
  it (in float32, BatchNorm over a batch of 2–3 amplifies that order to ~1e-4)."""
  lax_module = models.MODELS.get(name)(10, conv='lax', **extra)
  patch_module = models.MODELS.get(name)(10, conv=impl, **extra)
  x32 = jax.random.normal(jax.random.key(1), shape)
  # every function compiled once: op by op, init and the float64 gradients took minutes
  init = {m: jax.jit(lambda key, x, m=m: models.init(m, key, x))
          for m in (patch_module, lax_module)}
  variables32 = init[lax_module](jax.random.key(0), x32)
  chex.assert_trees_all_equal(variables32, init[patch_module](jax.random.key(0), x32))
  outputs = {m: jax.jit(lambda v, x, m=m: models.apply(m, v, x)[0])
             for m in (patch_module, lax_module)}
  grads = {m: jax.jit(jax.grad(lambda v, x, m=m: _loss(m, v, x)))
           for m in (patch_module, lax_module)}
  np.testing.assert_allclose(outputs[patch_module](variables32, x32),
                             outputs[lax_module](variables32, x32), rtol=1e-3, atol=1e-4)
  with jax.enable_x64(True):
    x = x32.astype(jnp.float64)
    variables = jax.tree.map(lambda a: a.astype(jnp.float64), variables32)
    np.testing.assert_allclose(outputs[patch_module](variables, x),
                               outputs[lax_module](variables, x), rtol=1e-9, atol=1e-12)
    chex.assert_trees_all_close(grads[patch_module](variables, x),
                                grads[lax_module](variables, x), rtol=1e-9, atol=1e-12)


def test_patches_convolution_vmapped_over_clients_is_a_batched_matmul():
  """Vmapped over per-client kernels, 'lax' lowers to a grouped convolution and
  'patches' to none; both give the per-client results."""
  from fedjax_shift.models.classifiers import patches_conv
  x = jax.random.normal(jax.random.key(0), (4, 2, 9, 9, 3))      # 4 clients
  kernels = jax.random.normal(jax.random.key(1), (4, 3, 3, 3, 5))
  dims = ('NHWC', 'HWIO', 'NHWC')
  lax_conv = jax.vmap(lambda x, k: jax.lax.conv_general_dilated(x, k, (2, 2), 'SAME',
                                                                dimension_numbers=dims))
  patch_conv = jax.vmap(lambda x, k: patches_conv(x, k, (2, 2), 'SAME'))
  np.testing.assert_allclose(patch_conv(x, kernels), lax_conv(x, kernels), rtol=1e-4,
                             atol=1e-5)
  assert 'feature_group_count=4' in jax.jit(lax_conv).lower(x, kernels).as_text() or \
      'feature_group_count = 4' in jax.jit(lax_conv).lower(x, kernels).as_text()
  text = jax.jit(patch_conv).lower(x, kernels).as_text()
  assert 'feature_group_count = 4' not in text and 'feature_group_count=4' not in text


def test_conv_choice_auto_and_bad_values():
  assert models.conv_impl('auto') == ('lax_patch_grad' if jax.default_backend() == 'cpu'
                                      else 'patches')
  with pytest.raises(ValueError, match=r"config.model.conv: unknown 'fft'"):
    models.conv_impl('fft')
  import ml_collections
  with pytest.raises(ValueError, match=r"config.model.conv='patches': model 'mlp' has no"):
    models.create(ml_collections.ConfigDict({'name': 'mlp', 'conv': 'patches'}), 10)


# Layers in the order the model defines them, read from the forward pass, on variables
# that went through a tree map (JAX sorts dict keys: 'BatchNorm_0' < 'Conv_0' < 'Dense_0').
@pytest.mark.parametrize('name, shape, extra, first, last, count', [
    ('mlp', (28, 28, 1), {}, 'encoder/Dense_0', 'encoder/Dense_1', 3),
    ('bn_mlp', (28, 28, 1), {}, 'encoder/Dense_0', 'encoder/BatchNorm_1', 5),
    ('atp_cnn', (32, 32, 3), {}, 'encoder/Conv_0', 'encoder/BatchNorm_3', 9),
    ('evolve_cnn', (28, 28, 1), {}, 'encoder/Conv_0', 'encoder/Dense_0', 10),
    ('resnet18', (32, 32, 3), {}, 'encoder/Conv_0', 'encoder/ResidualBlock_7/BatchNorm_1', 41),
    ('vit', (4, 4, 3), {'patch_size': 2, 'width': 8, 'depth': 1, 'heads': 2, 'mlp_dim': 8},
     'encoder/embedding', 'encoder/encoder_norm', 12),
])
def test_layer_order_is_the_definition_order_not_dict_order(name, shape, extra, first, last,
                                                            count):
  from flax import traverse_util
  module = models.create(ml_collections.ConfigDict({'name': name, **extra}), 10)
  order = models.layer_order(module, shape)
  assert len(order) == count and order[-1] == 'head'
  variables = models.init(module, jax.random.key(0), jnp.zeros((1, *shape)))
  mapped = jax.tree.map(lambda leaf: leaf, variables['params'])   # keys sorted now
  flat = traverse_util.flatten_dict(mapped)
  assert {'/'.join(p[:-1]) for p in flat} == set(order)
  for block, layer in (('first', first), ('last', last), (0, order[0]), (-1, 'head')):
    selected = {'/'.join(p[:-1]) for p in flat
                if models.layer_selector(module, shape, block, 'block')(p)}
    assert selected == {layer}, (block, selected)
  with pytest.raises(ValueError, match=r"block: 'encoder/Nope_0' names no layer of this model; "
                                       r"its layers, in order: \['" + order[0]):
    models.layer_selector(module, shape, 'encoder/Nope_0', 'block')


def _imagenet_resnet18():
  module = models.MODELS.get('resnet18')(10, stem='imagenet')
  variables = models.init(module, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
  return module, variables


def test_torchvision_resnet18_weights_load_with_their_names_layout_and_statistics(tmp_path):
  """A .npz of torchvision's state-dict names loads into the imagenet-stem ResNet-18:
  every array by name, kernels [O, I, kh, kw] → [kh, kw, I, O], BatchNorm running
  statistics into batch_stats; the stem's output at one position equals the sum a
  PyTorch convolution computes (cross-correlation, padding 3, stride 2)."""
  from fedjax_shift.models import torchvision_resnet
  from fedjax_shift.models.classifiers import Conv
  module, variables = _imagenet_resnet18()
  rng = np.random.default_rng(0)
  encoder = {c: jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(np.float32),
                             variables[c]['encoder']) for c in ('params', 'batch_stats')}
  path = str(tmp_path / 'resnet18.npz')
  torchvision_resnet.save_npz(path, encoder)
  stored = dict(np.load(path))
  assert stored['conv1.weight'].shape == (64, 3, 7, 7)
  assert stored['layer2.0.downsample.0.weight'].shape == (128, 64, 1, 1)
  assert stored['layer4.1.bn2.running_var'].shape == (512,)
  assert len(stored) == 20 * 4 + 20   # 20 BatchNorms × 4 arrays, 20 convolutions
  stored['fc.weight'] = np.zeros((1000, 512), np.float32)   # a head is not read
  np.savez(path, **stored)
  loaded = torchvision_resnet.load_npz(path, module.encoder, jnp.zeros((1, 32, 32, 3)))
  chex.assert_trees_all_equal(loaded, jax.tree.map(jnp.asarray, encoder))
  kernel = loaded['params']['Conv_0']['kernel']
  assert float(kernel[2, 5, 1, 7]) == float(stored['conv1.weight'][7, 1, 2, 5])
  x = rng.standard_normal((1, 32, 32, 3)).astype(np.float32)
  out = Conv(64, (7, 7), (2, 2), padding=3, use_bias=False).apply({'params': {'kernel': kernel}}, x)
  padded = np.pad(x[0], ((3, 3), (3, 3), (0, 0)))
  weight = stored['conv1.weight']                              # [O, I, kh, kw]
  expected = np.einsum('hwi,oihw->o', padded[2:9, 4:11], weight)   # output row 1, column 2
  np.testing.assert_allclose(out[0, 1, 2], expected, rtol=1e-4, atol=1e-4)
  # The other stem, a missing array and a wrong shape are errors naming them.
  cifar = models.MODELS.get('resnet18')(10)
  with pytest.raises(ValueError, match='stem = "imagenet"'):
    torchvision_resnet.load_npz(path, cifar.encoder, jnp.zeros((1, 32, 32, 3)))
  del stored['layer3.1.bn1.running_mean']
  np.savez(path, **stored)
  with pytest.raises(ValueError, match=r"no parameter 'layer3.1.bn1.running_mean'.*"
                                       r"ResidualBlock_5/BatchNorm_0/mean"):
    torchvision_resnet.load_npz(path, module.encoder, jnp.zeros((1, 32, 32, 3)))


def test_a_batch_norm_backbone_replaces_the_encoders_parameters_and_statistics(tmp_path):
  from fedjax_shift.algorithms.base import ServerState
  from fedjax_shift.models import torchvision_resnet
  from fedjax_shift.pipelines import pretrain
  module, variables = _imagenet_resnet18()
  encoder = {c: jax.tree.map(lambda a: a + 1.0, variables[c]['encoder'])
             for c in ('params', 'batch_stats')}
  path = str(tmp_path / 'resnet18.npz')
  torchvision_resnet.save_npz(path, encoder)
  loaded = pretrain.load_encoder(path, module, jnp.zeros((1, 32, 32, 3)))
  state = pretrain.with_backbone(ServerState(variables, (), 0), loaded, 'fedavg')
  for collection in ('params', 'batch_stats'):
    chex.assert_trees_all_close(state.variables[collection]['encoder'], encoder[collection])
  chex.assert_trees_all_equal(state.variables['params']['head'], variables['params']['head'])
  mlp = models.MODELS.get('mlp')(10)
  with pytest.raises(ValueError, match=r'backbone.weights: .*a torchvision ResNet-18'):
    pretrain.load_encoder(path, mlp, jnp.zeros((1, 28, 28, 1)))


def test_conv_initialises_as_nn_conv_with_and_without_x64():
  """The library's Conv has nn.Conv's parameters: float32 by default and the same
  numbers for a seed whether or not x64 is on (its kernel once drew float64 numbers
  from other random bits under x64), equal to nn.Conv's own initialisation."""
  from flax import linen as nn
  from fedjax_shift.models.classifiers import Conv
  x = jnp.zeros((1, 6, 6, 3))
  ours = Conv(4, (3, 3)).init(jax.random.key(0), x)
  reference = nn.Conv(4, (3, 3)).init(jax.random.key(0), x)
  chex.assert_trees_all_equal(ours, reference)
  with jax.enable_x64(True):
    wide = Conv(4, (3, 3)).init(jax.random.key(0), x.astype(jnp.float64))
  chex.assert_trees_all_equal_dtypes(wide, ours)
  chex.assert_trees_all_equal(wide, ours)
