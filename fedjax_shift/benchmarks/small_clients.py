"""Label shift over a few small clients (FedIns Sec. 4.1: CIFAR-100 split into five
clients of 123, 209, 168, 222 and 278 images, Tiny-ImageNet into five of 322–509).

The pooled ``data.source`` (an embedded source, ``tfds:cifar100`` … from
``data.data_dir``, or ``folder:<path>``: class folders under ``data.data_dir`` resized to
``data.image_size``, e.g. ``folder:tiny-imagenet-200/train``) is dealt out without replacement: client k's class proportions are
drawn from Dirichlet(``data.dirichlet_alpha``), then ``client_sizes[k]`` training and
``test_examples`` test images are drawn from those classes (its test set follows its own
label distribution). Tiny-ImageNet is not in TFDS: it comes from its folder.

The FedIns authors' code instead (``images_per_class`` > 0): the first
``images_per_class`` images of each class (10: 1,000 CIFAR-100 images, which give the
paper's client sizes) are dealt over ``data.num_clients`` clients, each class split by
proportions drawn from Dirichlet(``dirichlet_alpha``) over the clients (β = 0.2), so the
client sizes follow from the draw (``client_sizes`` is not read). ``test_split`` (a TFDS
split, e.g. 'test'): every client is tested on a share of that whole split, so the
pooled 'test' accuracy of the global model is its accuracy on the dataset's test set,
as the authors evaluate (the per-client test sets then mean nothing personal).
"""
from __future__ import annotations

import ml_collections
import numpy as np

from fedjax_shift.benchmarks.base import BENCHMARKS, Benchmark, check_source, load_source
from fedjax_shift.benchmarks.mixed_domains import CLIENT_SIZES, draw_clients
from fedjax_shift.data.federated import stack_clients
from fedjax_shift.registry import NONNEGATIVE_INT, POSITIVE_INT, TEXT, require


def check(data_config: ml_collections.ConfigDict) -> None:
  check_source(data_config)
  require(data_config.dirichlet_alpha > 0, 'data.dirichlet_alpha',
          f'must be > 0, got {data_config.dirichlet_alpha}')
  if data_config.images_per_class:
    require(data_config.num_clients >= 1, 'data.num_clients',
            f'must be >= 1, got {data_config.num_clients}')
  split, source = data_config.test_split, data_config.source
  require(not split or (source.startswith('tfds:') and not split.startswith('folder:')) or
          (source.startswith('folder:') and split.startswith('folder:')),
          'data.test_split', f'is a split of a TFDS source (tfds:<name>) or, for a folder: '
          f'source, folder:<path> under data.data_dir; got {split!r} for source {source!r}')
  require(bool(split) or not data_config.images_per_class, 'data.test_split',
          'data.images_per_class deals every image it takes to training: name the test data '
          '(a TFDS split, or folder:<path>, e.g. folder:tiny-imagenet-200/val)')


def per_class_clients(labels: np.ndarray, num_classes: int, per_class: int, num_clients: int,
                      alpha: float, rng: np.random.Generator, names=()):
  """The FedIns authors' partition: the first ``per_class`` examples of each class, each
  class split over the clients by Dirichlet(α) proportions. Returns [K index arrays]."""
  parts = [[] for _ in range(num_clients)]
  for c in range(num_classes):
    idx = np.flatnonzero(labels == c)[:per_class]
    if len(idx) < per_class:
      named = f' ({names[c]!r})' if c < len(names) else ''
      raise ValueError(f'config.data.images_per_class={per_class}: class {c}{named} has only '
                       f'{len(idx)} examples')
    cuts = (np.cumsum(rng.dirichlet(np.full(num_clients, alpha)))[:-1] * len(idx))
    for k, piece in enumerate(np.split(idx, cuts.round().astype(int))):
      parts[k].extend(piece.tolist())
  return [np.asarray(sorted(p), np.int64) for p in parts]


@BENCHMARKS.register('small_clients', defaults={
    'client_sizes': (123, 209, 168, 222, 278),   # as mixed_domains (FedIns' CIFAR-100)
    'test_examples': 100,                        # as mixed_domains
    'images_per_class': 0,   # > 0: the FedIns authors' first-N-per-class Dirichlet split
    'test_split': '',        # '': per-client test draws; a TFDS split: that whole split
}, ranges={'client_sizes': CLIENT_SIZES, 'test_examples': POSITIVE_INT,
           'images_per_class': NONNEGATIVE_INT,   # 0: client_sizes
           'test_split': TEXT},                   # of a TFDS source only (check)
    check=check, pipelines=('federated',))
def small_clients(data_config: ml_collections.ConfigDict, seed: int) -> Benchmark:
  """See the module docstring. ``info['client_class_counts']``: [K][class] train counts."""
  rng = np.random.default_rng([seed, 0])
  src = load_source(data_config)
  classes = [np.flatnonzero(src.y == c) for c in range(src.num_classes)]
  alpha = float(data_config.dirichlet_alpha)
  if data_config.images_per_class:
    train = per_class_clients(src.y, src.num_classes, data_config.images_per_class,
                              data_config.num_clients, alpha, rng, src.class_names)
    indices = {'train': train}
    counts = [np.bincount(src.y[i], minlength=src.num_classes).tolist() for i in train]
  else:
    sizes = tuple(data_config.client_sizes)
    proportions = rng.dirichlet(np.full(src.num_classes, alpha), len(sizes))
    indices, _, counts = draw_clients(classes, proportions, sizes,
                                      0 if data_config.test_split else data_config.test_examples,
                                      rng, 'data.source', 'class', src.class_names)
  shape = src.x.shape[1:]
  arrays = {split: (src.x, src.y) for split in ('train', 'test')}
  if data_config.test_split:   # the whole split, dealt in order over the clients
    test = (load_source(override_split(data_config, data_config.test_split))
            if data_config.source.startswith('tfds:') else
            load_source(override_source(data_config, data_config.test_split),
                        class_names=src.class_names))
    arrays['test'] = (test.x, test.y)
    indices['test'] = np.array_split(np.arange(len(test.y)), len(indices['train']))
  splits = {split: stack_clients([arrays[split][0][i] for i in parts],
                                 [arrays[split][1][i] for i in parts], example_shape=shape)
            for split, parts in indices.items()}
  return Benchmark(splits, src.num_classes, shape, {'client_class_counts': counts})


def override_source(data_config: ml_collections.ConfigDict, source: str):
  """``data_config`` reading the folder source ``source``, every example of it."""
  config = ml_collections.ConfigDict(data_config.to_dict())
  config.source, config.max_examples = source, 0
  return config


def override_split(data_config: ml_collections.ConfigDict, split: str):
  """``data_config`` reading TFDS split ``split``, every example of it."""
  config = ml_collections.ConfigDict(data_config.to_dict())
  config.tfds_split, config.max_examples = split, 0
  return config
