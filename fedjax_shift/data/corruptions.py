"""CIFAR-10-C style corruptions (Hendrycks & Dietterich, ICLR 2019) in numpy.

All 19 corruptions of CIFAR-10-C: the 15 'source' ones and the 4 held out by ATP
(speckle noise, gaussian blur, saturate, spatter; the ATP authors' code). Severity
constants follow the CIFAR-10 version of Hendrycks' make_cifar_c.py; where the
original needs assets or ImageMagick (frost images, snow/motion blur through Wand,
spatter's liquid layer) the texture is generated procedurally with the same blend
constants. Images are float [B, H, W, C] in [0, 1], C = 1 (grayscale) or 3 (colour);
the output has the same shape and range. Every function is deterministic given the
numpy Generator passed in.

Grayscale: colour operations act on intensity. ``brightness`` shifts intensity;
``saturate`` scales the distance from mid-grey (the intensity analogue of HSV
saturation, which would otherwise be the identity on grey images).
"""
from __future__ import annotations

from typing import Callable, Dict, Sequence, Tuple

import numpy as np
from scipy import ndimage

Corruption = Callable[[np.ndarray, int, np.random.Generator], np.ndarray]

SOURCE_CORRUPTIONS = (
    'gaussian_noise', 'shot_noise', 'impulse_noise', 'defocus_blur', 'glass_blur',
    'motion_blur', 'zoom_blur', 'snow', 'frost', 'fog', 'brightness', 'contrast',
    'elastic_transform', 'pixelate', 'jpeg_compression')
# Held out for target clients in ATP (the authors' code).
HELDOUT_CORRUPTIONS = ('speckle_noise', 'gaussian_blur', 'saturate', 'spatter')
ALL_CORRUPTIONS = SOURCE_CORRUPTIONS + HELDOUT_CORRUPTIONS


def _clip(x):
  return np.clip(x, 0.0, 1.0).astype(np.float32)


def _spatial_filter(x, fn, **kwargs):
  """Applies a 2-D filter per image and channel of [B, H, W, C]."""
  out = np.empty_like(x)
  for b in range(x.shape[0]):
    for c in range(x.shape[-1]):
      out[b, :, :, c] = fn(x[b, :, :, c], **kwargs)
  return out


def _convolve(x, kernel):
  return _spatial_filter(x, ndimage.convolve, weights=kernel, mode='reflect')


def _blur(x, sigma):
  return ndimage.gaussian_filter(x, sigma=(0, sigma, sigma, 0), mode='reflect')


def gaussian_noise(x, severity, rng):
  c = [0.04, 0.06, .08, .09, .10][severity - 1]
  return _clip(x + rng.normal(size=x.shape, scale=c))


def shot_noise(x, severity, rng):
  c = [500, 250, 100, 75, 50][severity - 1]
  return _clip(rng.poisson(x * c) / c)


def impulse_noise(x, severity, rng):
  c = [.01, .02, .03, .05, .07][severity - 1]
  u = rng.random(x.shape)
  out = x.copy()
  out[u < c / 2] = 0.0
  out[(u >= c / 2) & (u < c)] = 1.0
  return _clip(out)


def speckle_noise(x, severity, rng):
  c = [.06, .1, .12, .16, .2][severity - 1]
  return _clip(x + x * rng.normal(size=x.shape, scale=c))


def gaussian_blur(x, severity, rng):
  del rng
  c = [.4, .6, 0.7, .8, 1][severity - 1]
  return _clip(_blur(x, c))


def _disk(radius, alias_blur):
  size = max(3, int(np.ceil(radius)) * 2 + 1)
  coords = np.arange(size) - size // 2
  xx, yy = np.meshgrid(coords, coords)
  kernel = ((xx ** 2 + yy ** 2) <= radius ** 2 + 0.5).astype(np.float32)
  kernel /= kernel.sum()
  return ndimage.gaussian_filter(kernel, sigma=alias_blur)


def defocus_blur(x, severity, rng):
  del rng
  c = [(0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (1, 0.2), (1.5, 0.1)][severity - 1]
  return _clip(_convolve(x, _disk(*c)))


def glass_blur(x, severity, rng):
  c = [(0.05, 1, 1), (0.25, 1, 1), (0.4, 1, 1), (0.25, 1, 2), (0.4, 1, 2)][severity - 1]
  sigma, max_delta, iterations = c
  out = _blur(x, sigma)
  batch, height, width, _ = x.shape
  rows = np.arange(height)[:, None].repeat(width, 1)
  cols = np.arange(width)[None, :].repeat(height, 0)
  bidx = np.arange(batch)[:, None, None]
  for _ in range(iterations):
    # Swap each pixel with a random neighbour within max_delta (vectorised version
    # of the original per-pixel loop).
    dr = rng.integers(-max_delta, max_delta + 1, size=(batch, height, width))
    dc = rng.integers(-max_delta, max_delta + 1, size=(batch, height, width))
    src_r = np.clip(rows + dr, 0, height - 1)
    src_c = np.clip(cols + dc, 0, width - 1)
    out = out[bidx, src_r, src_c]
  return _clip(_blur(out, sigma))


def _line_kernel(length, angle_deg):
  size = int(length) * 2 + 1
  kernel = np.zeros((size, size), np.float32)
  centre = size // 2
  t = np.linspace(-length, length, 4 * size)
  rr = np.round(centre + t * np.sin(np.deg2rad(angle_deg))).astype(int)
  cc = np.round(centre + t * np.cos(np.deg2rad(angle_deg))).astype(int)
  kernel[rr.clip(0, size - 1), cc.clip(0, size - 1)] = 1.0
  return kernel / kernel.sum()


def motion_blur(x, severity, rng):
  # Original: Wand motion_blur(radius=c0, sigma=c1, angle~U(-45,45)). Here a line
  # kernel whose half-length is the Wand sigma, scaled to the image size.
  c = [(10, 1), (10, 1.5), (10, 2), (10, 2.5), (12, 3)][severity - 1]
  scale = x.shape[1] / 32.0
  out = np.empty_like(x)
  for b in range(x.shape[0]):
    kernel = _line_kernel(max(1.0, c[1] * scale), rng.uniform(-45, 45))
    out[b] = _convolve(x[b:b + 1], kernel)[0]
  return _clip(out)


def _centre_zoom(img, factor):
  height, width = img.shape[:2]
  ch, cw = int(np.ceil(height / factor)), int(np.ceil(width / factor))
  top, left = (height - ch) // 2, (width - cw) // 2
  crop = img[top:top + ch, left:left + cw]
  zoomed = ndimage.zoom(crop, (factor, factor, 1), order=1)
  zt, zl = (zoomed.shape[0] - height) // 2, (zoomed.shape[1] - width) // 2
  return zoomed[zt:zt + height, zl:zl + width]


def zoom_blur(x, severity, rng):
  del rng
  stop = [1.06, 1.11, 1.16, 1.21, 1.26][severity - 1]
  factors = np.arange(1, stop, 0.01)
  out = x.copy()
  for b in range(x.shape[0]):
    for factor in factors[1:]:
      out[b] += _centre_zoom(x[b], factor)
  return _clip(out / len(factors))


def _plasma(size, wibble_decay, rng):
  """Diamond-square plasma fractal in [0, 1], [size, size] (size a power of 2)."""
  maparray = np.zeros((size, size), np.float64)
  step = size
  wibble = 100.0
  maparray[0, 0] = 0

  def wibbled_mean(array):
    return array / 4 + wibble * rng.uniform(-wibble, wibble, array.shape)

  while step >= 2:
    half = step // 2
    corner = maparray[0:size:step, 0:size:step]
    square = corner + np.roll(corner, -1, 0)
    square = square + np.roll(square, -1, 1)
    maparray[half:size:step, half:size:step] = wibbled_mean(square)
    corner = maparray[0:size:step, 0:size:step]
    centre = maparray[half:size:step, half:size:step]
    ldr = corner + np.roll(corner, 1, 0)
    lru = centre + np.roll(centre, -1, 1)
    maparray[0:size:step, half:size:step] = wibbled_mean(ldr + lru + np.roll(lru, 1, 1))
    ltsum = corner + np.roll(corner, 1, 1)
    tdu = centre + np.roll(centre, -1, 0)
    maparray[half:size:step, 0:size:step] = wibbled_mean(ltsum + tdu + np.roll(tdu, 1, 0))
    step //= 2
    wibble /= wibble_decay
  maparray -= maparray.min()
  return maparray / max(maparray.max(), 1e-12)


def _texture(x, wibble_decay, rng):
  height, width = x.shape[1:3]
  size = 1 << int(np.ceil(np.log2(max(height, width))))
  return np.stack([_plasma(size, wibble_decay, rng)[:height, :width]
                   for _ in range(x.shape[0])])[..., None]


def fog(x, severity, rng):
  c = [(.2, 3), (.5, 3), (.75, 2.5), (1, 2), (1.5, 1.75)][severity - 1]
  max_val = x.max(axis=(1, 2, 3), keepdims=True)
  out = x + c[0] * _texture(x, c[1], rng)
  return _clip(out * max_val / (max_val + c[0]))


def frost(x, severity, rng):
  # Original blends a crop of photographed frost; here a sharpened plasma texture.
  c = [(1, 0.2), (1, 0.3), (0.9, 0.4), (0.85, 0.4), (0.75, 0.45)][severity - 1]
  texture = _texture(x, 1.5, rng) ** 2
  texture = np.clip(texture + 0.3 * rng.random(texture.shape), 0, 1)
  return _clip(c[0] * x + c[1] * texture)


def snow(x, severity, rng):
  c = [(0.1, 0.2, 1, 0.6, 8, 3, 0.95), (0.1, 0.2, 1, 0.5, 10, 4, 0.9),
       (0.15, 0.3, 1.75, 0.55, 10, 4, 0.9), (0.25, 0.3, 2.25, 0.6, 12, 6, 0.85),
       (0.3, 0.3, 1.25, 0.65, 14, 12, 0.8)][severity - 1]
  loc, scale, zoom, threshold, _, blur_sigma, blend = c
  batch, height, width, _ = x.shape
  layer = rng.normal(size=(batch, height, width), loc=loc, scale=scale)
  layer = np.stack([_centre_zoom(l[..., None], zoom)[..., 0] for l in layer])
  layer[layer < threshold] = 0
  scale_to_img = height / 32.0
  flakes = np.empty_like(layer)
  for b in range(batch):
    kernel = _line_kernel(max(1.0, blur_sigma * scale_to_img / 2),
                          rng.uniform(-135, -45))
    flakes[b] = ndimage.convolve(layer[b], kernel, mode='reflect')
  flakes = flakes[..., None]
  grey = x.mean(-1, keepdims=True)
  out = blend * x + (1 - blend) * np.maximum(x, grey * 1.5 + 0.5)
  return _clip(out + flakes + np.rot90(flakes, k=2, axes=(1, 2)))


def spatter(x, severity, rng):
  # Original: liquid layer from thresholded, blurred noise (mud for severity >= 4 is
  # replaced by the same dark-blob layer). Constants (loc, scale, sigma, threshold,
  # intensity, mud) from the CIFAR version.
  c = [(0.62, 0.1, 0.7, 0.7, 0.5, 0), (0.65, 0.1, 0.8, 0.7, 0.5, 0),
       (0.65, 0.3, 1, 0.69, 0.5, 0), (0.65, 0.1, 0.7, 0.69, 0.6, 1),
       (0.65, 0.1, 0.5, 0.68, 0.6, 1)][severity - 1]
  loc, scale, sigma, threshold, intensity, mud = c
  liquid = rng.normal(size=x.shape[:3], loc=loc, scale=scale)
  liquid = ndimage.gaussian_filter(liquid, sigma=(0, sigma, sigma))
  liquid[liquid < threshold] = 0
  liquid = liquid[..., None]
  if mud:
    colour = np.array([63, 42, 20], np.float32)[:x.shape[-1]] / 255.0
    if x.shape[-1] == 1:
      colour = np.array([0.2], np.float32)
    mask = (liquid > 0).astype(np.float32)
    return _clip(x * (1 - mask * intensity) + mask * intensity * colour)
  colour = np.array([175, 238, 238], np.float32)[:x.shape[-1]] / 255.0
  if x.shape[-1] == 1:
    colour = np.array([0.85], np.float32)
  return _clip(x + intensity * liquid * colour)


def _hsv_shift(x, channel, scale, offset):
  """Scales and shifts one HSV channel of colour images [B, H, W, 3]."""
  from matplotlib import colors
  hsv = colors.rgb_to_hsv(np.clip(x, 0, 1))
  hsv[..., channel] = np.clip(hsv[..., channel] * scale + offset, 0, 1)
  return colors.hsv_to_rgb(hsv)


def brightness(x, severity, rng):
  del rng
  c = [.05, .1, .15, .2, .3][severity - 1]
  if x.shape[-1] == 1:
    return _clip(x + c)
  return _clip(_hsv_shift(x, 2, 1.0, c))


def saturate(x, severity, rng):
  del rng
  c = [(0.3, 0), (0.1, 0), (1.5, 0), (2, 0.1), (2.5, 0.2)][severity - 1]
  if x.shape[-1] == 1:
    # Intensity analogue: scale the distance from mid-grey, push it out by c1.
    return _clip(0.5 + (x - 0.5) * c[0] + c[1] * np.sign(x - 0.5))
  return _clip(_hsv_shift(x, 1, c[0], c[1]))


def contrast(x, severity, rng):
  del rng
  c = [.75, .5, .4, .3, 0.15][severity - 1]
  means = x.mean(axis=(1, 2, 3), keepdims=True)
  return _clip((x - means) * c + means)


def elastic_transform(x, severity, rng):
  # (alpha, sigma, affine) as fractions of the image size (CIFAR constants).
  c = [(0, 0, 0.08), (0.05, 0.2, 0.07), (0.08, 0.06, 0.06),
       (0.1, 0.04, 0.05), (0.1, 0.03, 0.03)][severity - 1]
  batch, height, width, channels = x.shape
  alpha, sigma, affine = (v * height for v in c)
  out = np.empty_like(x)
  rows, cols = np.meshgrid(np.arange(height), np.arange(width), indexing='ij')
  for b in range(batch):
    shift = rng.uniform(-affine, affine, size=2) * 0.5
    dr = ndimage.gaussian_filter(rng.uniform(-1, 1, (height, width)), max(sigma, 1e-3),
                                 mode='reflect') * alpha + shift[0]
    dc = ndimage.gaussian_filter(rng.uniform(-1, 1, (height, width)), max(sigma, 1e-3),
                                 mode='reflect') * alpha + shift[1]
    for ch in range(channels):
      out[b, :, :, ch] = ndimage.map_coordinates(
          x[b, :, :, ch], [rows + dr, cols + dc], order=1, mode='reflect')
  return _clip(out)


def pixelate(x, severity, rng):
  del rng
  c = [0.95, 0.9, 0.85, 0.75, 0.65][severity - 1]
  height, width = x.shape[1:3]
  small_h, small_w = max(1, int(height * c)), max(1, int(width * c))
  row_idx = (np.arange(small_h) * height / small_h).astype(int)
  col_idx = (np.arange(small_w) * width / small_w).astype(int)
  small = x[:, row_idx][:, :, col_idx]
  up_rows = (np.arange(height) * small_h / height).astype(int)
  up_cols = (np.arange(width) * small_w / width).astype(int)
  return _clip(small[:, up_rows][:, :, up_cols])


def jpeg_compression(x, severity, rng):
  del rng
  import io
  from PIL import Image
  quality = [80, 65, 58, 50, 40][severity - 1]
  out = np.empty_like(x)
  for b in range(x.shape[0]):
    img = (x[b] * 255).round().astype(np.uint8)
    pil = Image.fromarray(img[..., 0] if x.shape[-1] == 1 else img)
    buffer = io.BytesIO()
    pil.save(buffer, 'JPEG', quality=quality)
    decoded = np.asarray(Image.open(buffer), np.float32) / 255.0
    out[b] = decoded.reshape(x.shape[1:])
  return _clip(out)


CORRUPTIONS: Dict[str, Corruption] = {name: globals()[name] for name in ALL_CORRUPTIONS}


def corrupt(images: np.ndarray, name: str, severity: int, seed: int) -> np.ndarray:
  """Applies corruption ``name`` at ``severity`` (1-5) to images [B, H, W, C] in [0, 1].

  Deterministic in ``seed``. Returns float32 [B, H, W, C] in [0, 1].
  """
  if name not in CORRUPTIONS:
    raise ValueError(f'unknown corruption {name!r}; choose from {sorted(CORRUPTIONS)}')
  if not (isinstance(severity, (int, np.integer)) and 1 <= severity <= 5):
    raise ValueError(f'corruption severity must be an integer in 1..5, got {severity!r}')
  images = np.asarray(images, np.float32)
  if images.ndim != 4 or images.shape[-1] not in (1, 3):
    raise ValueError(f'images must be [B, H, W, 1 or 3], got shape {images.shape}')
  if images.shape[0] == 0:
    return images.copy()
  rng = np.random.default_rng([seed, ALL_CORRUPTIONS.index(name), severity])
  return CORRUPTIONS[name](images, int(severity), rng)


def corrupt_each_example(images: np.ndarray, names: Sequence[str], severity: int, seed: int,
                         rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
  """One corruption drawn from ``names`` (uniformly, with ``rng``) for each of the
  images [B, H, W, C], as FedTHE's corrupted test sets draw them: the images of each
  corruption go through ``corrupt`` together with ``seed``. Returns (float32
  [B, H, W, C], the index into ``names`` of each image's corruption [B])."""
  chosen = rng.integers(0, len(names), len(images))
  out = np.asarray(images, np.float32).copy()
  for index, name in enumerate(names):
    where = chosen == index
    if where.any():
      out[where] = corrupt(images[where], name, severity, seed)
  return out, chosen

