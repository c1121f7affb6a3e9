"""The SSF ViT (models/vit.py, groundwork for FedIns): re-parameterisation and shapes."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_shift.models import vit


def encoder_and_params():
  encoder = vit.ViTEncoder(patch_size=4, width=16, depth=2, heads=4, mlp_dim=24)
  x = jax.random.normal(jax.random.key(0), (3, 8, 8, 3))
  params = encoder.init(jax.random.key(1), x)['params']
  return encoder, params, x


def random_ssf(encoder, key):
  out = {}
  for i, (point, width) in enumerate(vit.ssf_points(encoder).items()):
    k1, k2 = jax.random.split(jax.random.fold_in(key, i))
    out[point] = (1.0 + 0.3 * jax.random.normal(k1, (width,)),
                  0.3 * jax.random.normal(k2, (width,)))
  return out


def test_identity_ssf_is_the_plain_vit():
  encoder, params, x = encoder_and_params()
  plain = encoder.apply({'params': params}, x)
  chex.assert_shape(plain, (3, 16))
  np.testing.assert_allclose(encoder.apply({'params': params}, x, vit.init_ssf(encoder)), plain,
                             rtol=1e-6, atol=1e-6)


def test_folded_ssf_gives_the_same_features_as_the_unfolded_one():
  # Re-parameterisation (SSF paper, FedIns Sec. 3.2): γ⊙(Wx+b)+β = (W·diag γ)x + γ⊙b+β.
  encoder, params, x = encoder_and_params()
  ssf = random_ssf(encoder, jax.random.key(2))
  unfolded = encoder.apply({'params': params}, x, ssf)
  folded = encoder.apply({'params': vit.fold_ssf(params, ssf)}, x)
  assert not np.allclose(unfolded, encoder.apply({'params': params}, x), atol=1e-3)
  np.testing.assert_allclose(folded, unfolded, rtol=2e-4, atol=2e-4)


def test_per_instance_ssf_equals_each_instance_with_its_own_ssf():
  encoder, params, x = encoder_and_params()
  ssfs = [random_ssf(encoder, jax.random.key(10 + b)) for b in range(3)]
  stacked = {p: (jnp.stack([s[p][0] for s in ssfs]), jnp.stack([s[p][1] for s in ssfs]))
             for p in ssfs[0]}
  batched = encoder.apply({'params': params}, x, stacked)
  for b in range(3):
    one = encoder.apply({'params': params}, x[b:b + 1], ssfs[b])
    np.testing.assert_allclose(batched[b:b + 1], one, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match='per instance'):
    vit.fold_ssf(params, stacked)


def test_image_size_not_divisible_by_the_patch_size_is_an_error():
  encoder = vit.ViTEncoder(patch_size=5, width=16, depth=1, heads=4, mlp_dim=24)
  with pytest.raises(ValueError, match='not divisible by the patch size 5'):
    encoder.init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)))


def test_npz_checkpoint_round_trips_exactly_and_wrong_shapes_name_the_parameter(tmp_path):
  encoder, params, x = encoder_and_params()
  path = str(tmp_path / 'vit.npz')
  vit.save_npz(path, params)
  stored = np.load(path)
  assert 'Transformer/encoderblock_1/MultiHeadDotProductAttention_1/query/kernel' in stored
  assert 'Transformer/posembed_input/pos_embedding' in stored
  loaded = vit.load_npz(path, encoder, x)
  chex.assert_trees_all_equal(loaded, params)
  wider = vit.ViTEncoder(patch_size=4, width=16, depth=2, heads=4, mlp_dim=32)
  with pytest.raises(ValueError, match="'Transformer/encoderblock_0/MlpBlock_3/Dense_0/bias' "
                                       'has shape'):
    vit.load_npz(path, wider, x)
  deeper = vit.ViTEncoder(patch_size=4, width=16, depth=3, heads=4, mlp_dim=24)
  with pytest.raises(ValueError, match="no parameter 'Transformer/encoderblock_2/"):
    vit.load_npz(path, deeper, x)
