"""Named benchmark protocols: which data, shift and partition a run uses.

A benchmark is a function ``(data_config, seed) -> Benchmark``; configs select it
by name (``config.data.benchmark``). Adding one is adding a registered function.
"""
from __future__ import annotations

from typing import Dict, NamedTuple

import ml_collections
import numpy as np

from fedjax_shift.data import corruptions, partitions, sources
from fedjax_shift.data.federated import FederatedData, split_clients, stack_clients
from fedjax_shift.registry import Registry

BENCHMARKS: Registry = Registry('benchmark')

EMBEDDED_SOURCES = ('mnist_embedded', 'uci_digits')
PARTITIONS = ('dirichlet', 'iid', 'pathological', 'step')


class Benchmark(NamedTuple):
  splits: Dict[str, FederatedData]  # split name -> data over the same K clients
  num_classes: int
  example_shape: tuple
  info: dict  # partition statistics, corruptions per client, ...


def load_source(data_config: ml_collections.ConfigDict) -> sources.Source:
  """Pooled source data named by ``data_config.source``, resized if asked."""
  name = data_config.source
  if name == 'mnist_embedded':
    src = sources.mnist_embedded()
  elif name == 'uci_digits':
    src = sources.uci_digits()
  elif name.startswith('tfds:'):
    src = sources.tfds_source(name[len('tfds:'):], data_config.get('tfds_split', 'train'),
                              data_config.get('data_dir') or None,
                              data_config.get('max_examples') or None)
  else:
    raise ValueError(f'data.source: unknown source {name!r}; choose from '
                     f'{list(EMBEDDED_SOURCES)} or "tfds:<name>" with <name> in '
                     f'{sorted(sources.TFDS_DATASETS)}')
  x = src.x
  size = data_config.get('image_size', 0)
  if size and x.shape[1] != size:
    x = sources.resize_images(x, size, size)
  channels = data_config.get('channels', 0)
  if channels:
    x = sources.to_channels(x, channels)
  return sources.Source(x, src.y, src.num_classes)


def partition(labels: np.ndarray, data_config: ml_collections.ConfigDict, num_classes: int,
              rng: np.random.Generator):
  kind = data_config.partition
  num_clients = data_config.num_clients
  if kind == 'dirichlet':
    return partitions.dirichlet(labels, num_clients, data_config.dirichlet_alpha, rng,
                                min_examples=data_config.get('min_examples_per_client', 2))
  if kind == 'iid':
    return partitions.dirichlet(labels, num_clients, float('inf'), rng, min_examples=0)
  if kind == 'pathological':
    return partitions.pathological(labels, num_clients, data_config.classes_per_client, rng)
  if kind == 'step':
    return partitions.step(labels, num_clients, data_config.step_major_classes,
                           data_config.step_major_count, data_config.step_minor_count, rng,
                           num_classes)
  raise ValueError(f'data.partition: unknown partition {kind!r}; choose from {list(PARTITIONS)}')


@BENCHMARKS.register('label_skew_corrupted')
def label_skew_corrupted(data_config: ml_collections.ConfigDict, seed: int) -> Benchmark:
  """Label-skewed clients evaluated on clean and corrupted test splits (FedTHE-style).

  Pooled source data is partitioned over ``num_clients`` (Dirichlet / IID /
  pathological / step); each client's examples are split train/val/test by
  ``split_fractions`` (FedTHE: 60/20/20). ``test_corrupted`` is each client's test
  split under one CIFAR-10-C corruption drawn per client from ``corruptions`` at
  ``severity``.
  """
  rng = np.random.default_rng([seed, 0])
  src = load_source(data_config)
  parts = partition(src.y, data_config, src.num_classes, rng)
  partitions.check_disjoint(parts)
  fractions = dict(data_config.split_fractions)
  splits_xy = split_clients([src.x[p] for p in parts], [src.y[p] for p in parts],
                            fractions, rng)
  example_shape = src.x.shape[1:]
  splits = {name: stack_clients(xs, ys, example_shape=example_shape)
            for name, (xs, ys) in splits_xy.items()}
  info = {'source': data_config.source, 'partition': data_config.partition}
  names = tuple(data_config.get('corruptions', ()))
  if names and 'test' in splits_xy:
    severity = data_config.severity
    per_client = [names[i] for i in rng.integers(0, len(names), len(parts))]
    xs, ys = splits_xy['test']
    corrupted = [corruptions.corrupt(x, name, severity, seed * 100_003 + k)
                 if len(x) else x for k, (x, name) in enumerate(zip(xs, per_client))]
    splits['test_corrupted'] = stack_clients(corrupted, ys, example_shape=example_shape)
    info['corruption_per_client'] = per_client
    info['severity'] = severity
  return Benchmark(splits, src.num_classes, tuple(example_shape), info)

from fedjax_shift.benchmarks import evolving  # noqa: E402,F401  (registers rotated_digits, circle)
