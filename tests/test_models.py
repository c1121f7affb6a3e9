"""Models: encoder/head split, ATP module counts, BatchNorm modes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_shift import models


@pytest.mark.parametrize('name,shape,modules', [
    ('mlp', (2, 28, 28, 1), 6), ('bn_mlp', (2, 28, 28, 1), 14),
    ('atp_cnn', (2, 32, 32, 3), 23),      # REFERENCE.md: the ATP CNN has 23 modules
    ('evolve_cnn', (2, 28, 28, 1), 20),
    ('resnet18', (2, 32, 32, 3), 102),    # REFERENCE.md: ResNet-18 has 102 modules
    # WRN-16-4: stem + 6 blocks × (2 conv + 2 BN × 4) + 3 projections + BN × 4 + head 2
    ('wide_resnet', (2, 32, 32, 1), 70),
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
