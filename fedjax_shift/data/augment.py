"""Random image augmentations in JAX (vmappable, jit-able): the marginal
distribution MEMO averages over. One call augments one image [H, W, C] in [0, 1]
with a key; all shapes static.

The chain: random translation (reflect-pad 4 px at 32 px, scaled to the image, then
crop), rotation by U(−15°, 15°) (bilinear), contrast and brightness jitter
U(0.7, 1.3) / U(−0.1, 0.1), and clipping to [0, 1]. MEMO used AugMix; these
operations are the geometric and photometric part of it that is cheap in JAX.
Vector inputs (synthetic Circle points) are jittered with Gaussian noise instead.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rotate(image: jax.Array, degrees: jax.Array) -> jax.Array:
  """Bilinear rotation about the centre, edges extended. [H, W, C] -> [H, W, C]."""
  height, width = image.shape[:2]
  theta = jnp.deg2rad(degrees)
  rows, cols = jnp.meshgrid(jnp.arange(height, dtype=jnp.float32),
                            jnp.arange(width, dtype=jnp.float32), indexing='ij')
  cy, cx = (height - 1) / 2.0, (width - 1) / 2.0
  src_r = cy + (rows - cy) * jnp.cos(theta) - (cols - cx) * jnp.sin(theta)
  src_c = cx + (rows - cy) * jnp.sin(theta) + (cols - cx) * jnp.cos(theta)
  channel = lambda ch: jax.scipy.ndimage.map_coordinates(ch, [src_r, src_c], order=1,
                                                         mode='nearest')
  return jax.vmap(channel, in_axes=2, out_axes=2)(image)


VECTOR_NOISE = 0.1


def augment(key: jax.Array, image: jax.Array) -> jax.Array:
  """One random augmentation of ``image`` [H, W, C] (values in [0, 1]). Vector
  inputs [D] (Circle) get Gaussian jitter of standard deviation VECTOR_NOISE."""
  if image.ndim == 1:
    return image + VECTOR_NOISE * jax.random.normal(key, image.shape)
  height, width = image.shape[:2]
  pad = max(1, round(4 * height / 32))
  shift_key, rot_key, con_key, bri_key = jax.random.split(key, 4)
  padded = jnp.pad(image, ((pad, pad), (pad, pad), (0, 0)), mode='reflect')
  offset = jax.random.randint(shift_key, (2,), 0, 2 * pad + 1)
  image = jax.lax.dynamic_slice(padded, (offset[0], offset[1], 0), image.shape)
  image = rotate(image, jax.random.uniform(rot_key, (), minval=-15.0, maxval=15.0))
  mean = jnp.mean(image)
  image = (image - mean) * jax.random.uniform(con_key, (), minval=0.7, maxval=1.3) + mean
  image = image + jax.random.uniform(bri_key, (), minval=-0.1, maxval=0.1)
  return jnp.clip(image, 0.0, 1.0)


def augment_many(key: jax.Array, image: jax.Array, count: int) -> jax.Array:
  """[count, H, W, C] independent augmentations of one image."""
  return jax.vmap(augment, (0, None))(jax.random.split(key, count), image)
