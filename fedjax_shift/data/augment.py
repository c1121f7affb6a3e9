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

from fedjax_shift.registry import Registry


def rotation_sources(degrees: jax.Array, height: int, width: int):
  """Where each pixel of an image [H, W] rotated about its centre by ``degrees`` comes
  from: source rows and columns, each [H, W] (float, maybe outside the image)."""
  theta = jnp.deg2rad(degrees)
  rows, cols = jnp.meshgrid(jnp.arange(height, dtype=jnp.float32),
                            jnp.arange(width, dtype=jnp.float32), indexing='ij')
  cy, cx = (height - 1) / 2.0, (width - 1) / 2.0
  src_r = cy + (rows - cy) * jnp.cos(theta) - (cols - cx) * jnp.sin(theta)
  src_c = cx + (rows - cy) * jnp.sin(theta) + (cols - cx) * jnp.cos(theta)
  return src_r, src_c


def _bilinear(image: jax.Array, rows: jax.Array, cols: jax.Array) -> jax.Array:
  channel = lambda ch: jax.scipy.ndimage.map_coordinates(ch, [rows, cols], order=1,
                                                         mode='nearest')
  return jax.vmap(channel, in_axes=2, out_axes=2)(image)


def rotate(image: jax.Array, degrees: jax.Array) -> jax.Array:
  """Bilinear rotation about the centre, edges extended. [H, W, C] -> [H, W, C]."""
  return _bilinear(image, *rotation_sources(degrees, *image.shape[:2]))


def bilinear_corners(src_r: jax.Array, src_c: jax.Array, height: int, width: int):
  """The four (rows, cols, weight) terms, each [H', W'], of bilinear sampling at
  (src_r, src_c) with edges extended (``map_coordinates``' order 1, mode 'nearest')."""
  r0, c0 = jnp.floor(src_r), jnp.floor(src_c)
  fr, fc = src_r - r0, src_c - c0
  r0, c0 = r0.astype(jnp.int32), c0.astype(jnp.int32)
  return [(jnp.clip(r0 + dr, 0, height - 1), jnp.clip(c0 + dc, 0, width - 1), wr * wc)
          for dr, wr in ((0, 1 - fr), (1, fr)) for dc, wc in ((0, 1 - fc), (1, fc))]


VECTOR_NOISE = 0.1


def translation_pad(height: int) -> int:
  """The reflect padding of the random translation: 4 px at 32 px, scaled to the image."""
  return max(1, round(4 * height / 32))


def translation_offset(shift_key: jax.Array, pad: int) -> jax.Array:
  """[2] int: the crop's corner in the padded image, uniform in [0, 2·pad]."""
  return jax.random.randint(shift_key, (2,), 0, 2 * pad + 1)


def rotation_angle(rotation_key: jax.Array) -> jax.Array:
  """[] degrees, U(−15°, 15°)."""
  return jax.random.uniform(rotation_key, (), minval=-15.0, maxval=15.0)


def translate_and_rotate(shift_key: jax.Array, rotation_key: jax.Array,
                         image: jax.Array) -> jax.Array:
  """A random translation (reflect-pad 4 px at 32 px, scaled to the image, then crop)
  and a rotation by U(−15°, 15°). [H, W, C] -> [H, W, C]."""
  pad = translation_pad(image.shape[0])
  padded = jnp.pad(image, ((pad, pad), (pad, pad), (0, 0)), mode='reflect')
  offset = translation_offset(shift_key, pad)
  image = jax.lax.dynamic_slice(padded, (offset[0], offset[1], 0), image.shape)
  return rotate(image, rotation_angle(rotation_key))


def jitter(contrast_key: jax.Array, brightness_key: jax.Array, image: jax.Array,
           mean: jax.Array) -> jax.Array:
  """Contrast U(0.7, 1.3) about the image's ``mean`` and brightness U(−0.1, 0.1), then
  clipping to [0, 1]."""
  image = (image - mean) * jax.random.uniform(contrast_key, (), minval=0.7, maxval=1.3) + mean
  image = image + jax.random.uniform(brightness_key, (), minval=-0.1, maxval=0.1)
  return jnp.clip(image, 0.0, 1.0)


def augment(key: jax.Array, image: jax.Array) -> jax.Array:
  """One random augmentation of ``image`` [H, W, C] (values in [0, 1]). Vector
  inputs [D] (Circle) get Gaussian jitter of standard deviation VECTOR_NOISE."""
  if image.ndim == 1:
    return image + VECTOR_NOISE * jax.random.normal(key, image.shape)
  shift_key, rot_key, con_key, bri_key = jax.random.split(key, 4)
  image = translate_and_rotate(shift_key, rot_key, image)
  return jitter(con_key, bri_key, image, jnp.mean(image))


def augment_shared(key: jax.Array, images: jax.Array) -> jax.Array:
  """``augment``'s draw for ``key`` applied to every image of ``images`` [B, H, W, C]
  (a transform of a batch tensor): equal to ``augment(key, image)`` for each image.

  The translation is folded into the rotation's sampling (one bilinear gather from the
  padded batch) and each image's mean is the padded image weighted by how much of each
  pixel the gather takes, so the batch is read once; vector inputs [B, D] all get the
  same jitter."""
  if images.ndim == 2:
    return images + VECTOR_NOISE * jax.random.normal(key, images.shape[1:])
  shift_key, rot_key, con_key, bri_key = jax.random.split(key, 4)
  height, width = images.shape[1:3]
  pad = translation_pad(height)
  padded = jnp.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)), mode='reflect')
  offset = translation_offset(shift_key, pad)
  corners = [(rows + offset[0], cols + offset[1], weight) for rows, cols, weight in
             bilinear_corners(*rotation_sources(rotation_angle(rot_key), height, width),
                              height, width)]
  taken = jnp.zeros(padded.shape[1:3])
  for rows, cols, weight in corners:
    taken = taken.at[rows, cols].add(weight)
  means = jnp.einsum('bhwc,hw->b', padded, taken) / (height * width * images.shape[-1])
  sample = lambda image: sum(image[rows, cols] * weight[..., None]
                             for rows, cols, weight in corners)
  rotated = jax.vmap(sample)(padded)
  return jitter(con_key, bri_key, rotated, means.reshape(-1, 1, 1, 1))


def crop_flip(key: jax.Array, image: jax.Array) -> jax.Array:
  """The ATP authors' MEMO augmentation (their ``preaugment_cifar`` / ``_digit``): a
  random crop of the image padded symmetrically (4 px at sides up to 32 px, a seventh of
  the side above: 32 at 224), then a horizontal flip with probability 1/2 (digits too,
  as theirs). Vector inputs [D] get ``augment``'s Gaussian jitter."""
  if image.ndim == 1:
    return augment(key, image)
  height = image.shape[0]
  pad = 4 if height <= 32 else height // 7
  shift_key, flip_key = jax.random.split(key)
  padded = jnp.pad(image, ((pad, pad), (pad, pad), (0, 0)), mode='symmetric')
  offset = jax.random.randint(shift_key, (2,), 0, 2 * pad + 1)
  image = jax.lax.dynamic_slice(padded, (offset[0], offset[1], 0), image.shape)
  return jnp.where(jax.random.bernoulli(flip_key), image[:, ::-1], image)


# MEMO's augmentation families (``config.adapters.memo.augmentation``).
MARGINAL_AUGMENTATIONS = {'translate_rotate_jitter': augment, 'crop_flip': crop_flip}


def shared_draw(augmentation):
  """A transform of a batch [B, ...] from a one-image ``augmentation``: every image
  gets the draw of the same key."""
  one = jax.vmap(augmentation)
  return lambda key, images: one(jnp.broadcast_to(key, images.shape[:1]), images)


# The same families as transforms of a batch tensor, one draw for the whole batch
# (CoTTA's and RoTTA's augmented copies).
SHARED_AUGMENTATIONS = {'translate_rotate_jitter': augment_shared,
                       'crop_flip': shared_draw(crop_flip)}


def augment_many(key: jax.Array, image: jax.Array, count: int,
                 kind: str = 'translate_rotate_jitter') -> jax.Array:
  """[count, H, W, C] independent augmentations of one image, of the family ``kind``
  (a name of MARGINAL_AUGMENTATIONS)."""
  return jax.vmap(MARGINAL_AUGMENTATIONS[kind], (0, None))(jax.random.split(key, count), image)


# --- Two-view augmentations for contrastive learning (FedICON, SimCLR/SupCon style) ---
# Each entry maps (key, image [H, W, C] in [0, 1]) -> image of the same shape; a view is
# the composition of the configured names in order (``view``). Probabilities and ranges
# are SimCLR's CIFAR settings (Chen et al. 2020, App. A): crop area U(0.2, 1) (SupCon's
# CIFAR crop), aspect ratio U(3/4, 4/3); colour jitter with probability 0.8 and strength
# 0.4 (brightness, contrast, saturation; hue is left out); grayscale with probability 0.2;
# Gaussian blur with probability 0.5, σ ~ U(0.1, 2.0), kernel about a tenth of the side.
VIEW_AUGMENTATIONS: Registry = Registry('augmentation')
CROP_SCALE = (0.2, 1.0)
CROP_RATIO = (3 / 4, 4 / 3)
JITTER_PROB, JITTER_STRENGTH = 0.8, 0.4
GRAYSCALE_PROB = 0.2
BLUR_PROB, BLUR_SIGMA = 0.5, (0.1, 2.0)


def resized_crop(key: jax.Array, image: jax.Array, scale) -> jax.Array:
  """A crop of random area (U(scale) of the image) and aspect ratio (CROP_RATIO,
  log-uniform), resized back to [H, W] bilinearly; the crop is clipped to the image."""
  height, width = image.shape[:2]
  area_key, ratio_key, top_key, left_key = jax.random.split(key, 4)
  area = jax.random.uniform(area_key, (), minval=scale[0], maxval=scale[1])
  log_ratio = jax.random.uniform(ratio_key, (), minval=jnp.log(CROP_RATIO[0]),
                                 maxval=jnp.log(CROP_RATIO[1]))
  ratio = jnp.exp(log_ratio)
  crop_h = jnp.clip(jnp.sqrt(area / ratio) * height, 1.0, height)
  crop_w = jnp.clip(jnp.sqrt(area * ratio) * width, 1.0, width)
  top = jax.random.uniform(top_key, ()) * (height - crop_h)
  left = jax.random.uniform(left_key, ()) * (width - crop_w)
  rows = top + (jnp.arange(height, dtype=jnp.float32) + 0.5) * crop_h / height - 0.5
  cols = left + (jnp.arange(width, dtype=jnp.float32) + 0.5) * crop_w / width - 0.5
  grid_r, grid_c = jnp.meshgrid(rows, cols, indexing='ij')
  return _bilinear(image, grid_r, grid_c)


@VIEW_AUGMENTATIONS.register('random_resized_crop')
def random_resized_crop(key: jax.Array, image: jax.Array) -> jax.Array:
  """SimCLR's crop: area U(CROP_SCALE) = U(0.2, 1), resized back to [H, W]."""
  return resized_crop(key, image, CROP_SCALE)


# Milder views for small digits (not SimCLR's): a crop of area U(0.6, 1) keeps most of
# the stroke, where U(0.2, 1) can leave a fifth of a 28-px digit; or no crop at all,
# MEMO's translation and rotation (``augment``'s geometric part).
MILD_CROP_SCALE = (0.6, 1.0)


@VIEW_AUGMENTATIONS.register('mild_resized_crop')
def mild_resized_crop(key: jax.Array, image: jax.Array) -> jax.Array:
  """A crop of area U(MILD_CROP_SCALE) = U(0.6, 1), resized back to [H, W]."""
  return resized_crop(key, image, MILD_CROP_SCALE)


@VIEW_AUGMENTATIONS.register('translate_rotate')
def translate_rotate(key: jax.Array, image: jax.Array) -> jax.Array:
  """``translate_and_rotate``: a shift of up to 4 px at 32 px and U(−15°, 15°)."""
  shift_key, rotation_key = jax.random.split(key)
  return translate_and_rotate(shift_key, rotation_key, image)


@VIEW_AUGMENTATIONS.register('horizontal_flip')
def horizontal_flip(key: jax.Array, image: jax.Array) -> jax.Array:
  """Mirror left-right with probability 1/2 (off for digits: a mirrored digit is not
  the same digit)."""
  return jnp.where(jax.random.bernoulli(key), image[:, ::-1], image)


# The FedIns authors' training rotations (torchvision ``RandomRotation(15)`` for
# CIFAR-100, ``RandomRotation(30)`` for DomainNet): an angle U(−d°, d°), here bilinear
# with edges extended where torchvision fills the corners black.
@VIEW_AUGMENTATIONS.register('rotate15')
def rotate15(key: jax.Array, image: jax.Array) -> jax.Array:
  """A rotation by U(−15°, 15°) about the centre."""
  return rotate(image, jax.random.uniform(key, (), minval=-15.0, maxval=15.0))


@VIEW_AUGMENTATIONS.register('rotate30')
def rotate30(key: jax.Array, image: jax.Array) -> jax.Array:
  """A rotation by U(−30°, 30°) about the centre."""
  return rotate(image, jax.random.uniform(key, (), minval=-30.0, maxval=30.0))


def _gray(image: jax.Array) -> jax.Array:
  """Luma [H, W, 1] (ITU-R 601 weights; a 1-channel image is its own gray)."""
  if image.shape[-1] == 1:
    return image
  weights = jnp.array([0.299, 0.587, 0.114], image.dtype)
  return jnp.sum(image[..., :3] * weights, axis=-1, keepdims=True)


@VIEW_AUGMENTATIONS.register('colour_jitter')
def colour_jitter(key: jax.Array, image: jax.Array) -> jax.Array:
  """With probability JITTER_PROB: brightness, contrast and saturation factors
  U(1 − s, 1 + s) with s = JITTER_STRENGTH, in that order (saturation is a no-op on
  one channel); clipped to [0, 1]."""
  apply_key, bri_key, con_key, sat_key = jax.random.split(key, 4)
  factor = lambda k: jax.random.uniform(k, (), minval=1 - JITTER_STRENGTH,
                                        maxval=1 + JITTER_STRENGTH)
  out = jnp.clip(image * factor(bri_key), 0.0, 1.0)
  mean = jnp.mean(_gray(out))
  out = jnp.clip((out - mean) * factor(con_key) + mean, 0.0, 1.0)
  out = jnp.clip((out - _gray(out)) * factor(sat_key) + _gray(out), 0.0, 1.0)
  return jnp.where(jax.random.bernoulli(apply_key, JITTER_PROB), out, image)


@VIEW_AUGMENTATIONS.register('grayscale')
def grayscale(key: jax.Array, image: jax.Array) -> jax.Array:
  """With probability GRAYSCALE_PROB, every channel becomes the luma (a no-op on one
  channel)."""
  gray = jnp.broadcast_to(_gray(image), image.shape)
  return jnp.where(jax.random.bernoulli(key, GRAYSCALE_PROB), gray, image)


@VIEW_AUGMENTATIONS.register('gaussian_blur')
def gaussian_blur(key: jax.Array, image: jax.Array) -> jax.Array:
  """With probability BLUR_PROB, a separable Gaussian blur of σ ~ U(BLUR_SIGMA) with an
  odd kernel of about a tenth of the image side (at least 3), edges reflected."""
  apply_key, sigma_key = jax.random.split(key)
  height = image.shape[0]
  radius = max(1, int(round(0.1 * height)) // 2)
  sigma = jax.random.uniform(sigma_key, (), minval=BLUR_SIGMA[0], maxval=BLUR_SIGMA[1])
  taps = jnp.exp(-0.5 * (jnp.arange(-radius, radius + 1, dtype=jnp.float32) / sigma) ** 2)
  taps = taps / jnp.sum(taps)
  padded = jnp.pad(image, ((radius, radius), (radius, radius), (0, 0)), mode='reflect')
  size = 2 * radius + 1
  rows = sum(taps[i] * padded[i:i + image.shape[0]] for i in range(size))
  blurred = sum(taps[i] * rows[:, i:i + image.shape[1]] for i in range(size))
  return jnp.where(jax.random.bernoulli(apply_key, BLUR_PROB), blurred, image)


def check_view_names(names, field: str) -> None:
  """Raises naming ``field`` for an unknown augmentation name."""
  for name in names:
    if name not in VIEW_AUGMENTATIONS:
      raise ValueError(f'{field}: unknown augmentation {name!r}; choose from '
                       f'{VIEW_AUGMENTATIONS.names()}')


def view(key: jax.Array, image: jax.Array, names) -> jax.Array:
  """One random view of ``image`` [H, W, C]: the named augmentations applied in order,
  each with its own key (``fold_in`` of its position). Vector inputs [D] get Gaussian
  jitter (``augment``'s) instead."""
  if image.ndim == 1:
    return augment(key, image)
  for position, name in enumerate(names):
    image = VIEW_AUGMENTATIONS.get(name, 'augmentations')(jax.random.fold_in(key, position),
                                                           image)
  return image


def two_views(key: jax.Array, x: jax.Array, names) -> jax.Array:
  """[2B, ...]: two independent views of every example of x [B, ...]; rows 0..B−1 are
  the first views, B..2B−1 the second (example b's views are rows b and B + b)."""
  first, second = jax.random.split(key)
  many = jax.vmap(lambda k, image: view(k, image, names))
  batch = x.shape[0]
  return jnp.concatenate([many(jax.random.split(first, batch), x),
                          many(jax.random.split(second, batch), x)])


def augment_batch(key: jax.Array, x: jax.Array, names) -> jax.Array:
  """x [B, H, W, C] with every example replaced by one random ``view`` of it (one key
  per example, split from ``key``); x itself when ``names`` is empty. Training-time
  augmentation (``config.client.augmentation``)."""
  if not names:
    return x
  if x.ndim != 4:
    raise ValueError(f'config.client.augmentation {tuple(names)} needs images [B, H, W, C]; '
                     f'got inputs of shape {x.shape}: set it to ()')
  return jax.vmap(lambda k, image: view(k, image, names))(
      jax.random.split(key, x.shape[0]), x).astype(x.dtype)
