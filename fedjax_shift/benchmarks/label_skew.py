"""The FedTHE-style benchmark: label-skewed clients, clean and corrupted test splits."""
from __future__ import annotations

import math

import ml_collections
import numpy as np

from fedjax_shift.benchmarks.base import (BENCHMARKS, Benchmark, check_partition, check_source,
                                          load_source, partition)
from fedjax_shift.data import corruptions, partitions
from fedjax_shift.data.federated import split_clients, stack_clients
from fedjax_shift.registry import require


def check(data_config: ml_collections.ConfigDict) -> None:
  """Source, partition, splits and corruptions of ``config.data``."""
  check_source(data_config)
  check_partition(data_config)
  severity = data_config.severity
  require(isinstance(severity, int) and 1 <= severity <= 5, 'data.severity',
          f'must be an integer in 1..5, got {severity!r}')
  for name in data_config.corruptions:
    require(name in corruptions.ALL_CORRUPTIONS, 'data.corruptions',
            f'unknown corruption {name!r}; choose from {list(corruptions.ALL_CORRUPTIONS)}')
  fractions = dict(data_config.split_fractions)
  require('train' in fractions and all(v >= 0 for v in fractions.values()) and
          math.isclose(sum(fractions.values()), 1.0), 'data.split_fractions',
          f'need a "train" split and non-negative fractions summing to 1, got {fractions}')


@BENCHMARKS.register('label_skew_corrupted', defaults={
    'split_fractions': {'train': 0.6, 'val': 0.2, 'test': 0.2},   # FedTHE: 60/20/20
    'corruptions': ('gaussian_noise', 'shot_noise', 'impulse_noise', 'defocus_blur',
                    'motion_blur', 'contrast', 'elastic_transform', 'pixelate'),
    'severity': 5,                    # FedTHE corrupted test set: severity 5
}, check=check, pipelines=('federated',))
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
  names = tuple(data_config.corruptions)
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

