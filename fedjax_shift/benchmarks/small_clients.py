"""Label shift over a few small clients (FedIns Sec. 4.1: CIFAR-100 split into five
clients of 123, 209, 168, 222 and 278 images, Tiny-ImageNet into five of 322–509).

The pooled ``data.source`` (an embedded source, ``tfds:cifar100`` … from
``data.data_dir``, or ``folder:<path>``: class folders under ``data.data_dir`` resized to
``data.image_size``, e.g. ``folder:tiny-imagenet-200/train``) is dealt out without replacement: client k's class proportions are
drawn from Dirichlet(``data.dirichlet_alpha``), then ``client_sizes[k]`` training and
``test_examples`` test images are drawn from those classes (its test set follows its own
label distribution). Tiny-ImageNet is not in TFDS: it comes from its folder.
"""
from __future__ import annotations

import ml_collections
import numpy as np

from fedjax_shift.benchmarks.base import BENCHMARKS, Benchmark, check_source, load_source
from fedjax_shift.benchmarks.mixed_domains import check_client_sizes, draw_clients
from fedjax_shift.data.federated import stack_clients
from fedjax_shift.registry import require


def check(data_config: ml_collections.ConfigDict) -> None:
  check_source(data_config)
  check_client_sizes(data_config)
  require(data_config.dirichlet_alpha > 0, 'data.dirichlet_alpha',
          f'must be > 0, got {data_config.dirichlet_alpha}')


@BENCHMARKS.register('small_clients', defaults={
    'client_sizes': (123, 209, 168, 222, 278),   # as mixed_domains (FedIns' CIFAR-100)
    'test_examples': 100,                        # as mixed_domains
}, check=check, pipelines=('federated',))
def small_clients(data_config: ml_collections.ConfigDict, seed: int) -> Benchmark:
  """See the module docstring. ``info['client_class_counts']``: [K][class] train counts."""
  rng = np.random.default_rng([seed, 0])
  src = load_source(data_config)
  classes = [np.flatnonzero(src.y == c) for c in range(src.num_classes)]
  sizes = tuple(data_config.client_sizes)
  proportions = rng.dirichlet(np.full(src.num_classes, float(data_config.dirichlet_alpha)),
                              len(sizes))
  indices, _, counts = draw_clients(classes, proportions, sizes, data_config.test_examples, rng,
                                    'data.source', 'class')
  shape = src.x.shape[1:]
  splits = {split: stack_clients([src.x[i] for i in parts], [src.y[i] for i in parts],
                                 example_shape=shape)
            for split, parts in indices.items()}
  return Benchmark(splits, src.num_classes, shape, {'client_class_counts': counts})
