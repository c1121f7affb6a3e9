"""UPFL: unsupervised personalisation of new clients (FedTTA, fedtta_upfl.txt Sec. 4.1.1).

The source is partitioned over ``num_clients`` (the paper: 100 clients, pathological,
at most 2 classes each); a random ``new_client_fraction`` (50 %) of them are new
clients that take no part in training and bring only unlabelled data. Each training
client's examples are split train / validation 85 : 15.

Splits (all with max(training, new) clients; the shorter side is padded with clients
holding no examples, which carry weight 0 in every mean):
  'train'  the training clients' 85 %
  'val'    the training clients' 15 % (the paper's validation accuracy)
  'test'   the new clients, all of their examples (the paper's test accuracy); client k
           of this split is new client k, not training client k — ``info['new_clients']``
           names the split, and the federated pipeline refuses methods that would pair a
           training client's personal model with it.
A new client's labels are only read to score predictions (adapters see x only).
"""
from __future__ import annotations

import ml_collections
import numpy as np

from fedjax_shift.benchmarks.base import (BENCHMARKS, Benchmark, check_partition, check_source,
                                          load_source, partition)
from fedjax_shift.data import partitions
from fedjax_shift.data.federated import split_clients, stack_clients
from fedjax_shift.registry import require


def check(data_config: ml_collections.ConfigDict) -> None:
  check_source(data_config)
  check_partition(data_config)
  fraction = data_config.new_client_fraction
  require(0 < fraction < 1, 'data.new_client_fraction', f'must be in (0, 1), got {fraction}')
  new = int(round(fraction * data_config.num_clients))
  require(1 <= new < data_config.num_clients, 'data.new_client_fraction',
          f'{fraction} of {data_config.num_clients} clients leaves no training or no new '
          f'client')
  require(0 <= data_config.validation_fraction < 1, 'data.validation_fraction',
          f'must be in [0, 1), got {data_config.validation_fraction}')


@BENCHMARKS.register('upfl', defaults={
    'new_client_fraction': 0.5,     # FedTTA Sec. 4.1.1: 50 % training / 50 % new clients
    'validation_fraction': 0.15,    # training clients: train / validation 85 : 15
}, check=check, pipelines=('federated',))
def upfl(data_config: ml_collections.ConfigDict, seed: int) -> Benchmark:
  rng = np.random.default_rng([seed, 19])
  src = load_source(data_config)
  if data_config.partition == 'pathological' and \
      data_config.classes_per_client > src.num_classes:
    raise ValueError(f'config.data.classes_per_client={data_config.classes_per_client}: '
                     f'the source has only {src.num_classes} classes')
  parts = partition(src.y, data_config, src.num_classes, rng)
  partitions.check_disjoint(parts)
  order = rng.permutation(len(parts))
  num_new = int(round(data_config.new_client_fraction * len(parts)))
  train_ids, new_ids = np.sort(order[num_new:]), np.sort(order[:num_new])
  val = data_config.validation_fraction
  fractions = {'train': 1.0 - val, 'val': val} if val else {'train': 1.0}
  splits_xy = split_clients([src.x[parts[k]] for k in train_ids],
                            [src.y[parts[k]] for k in train_ids], fractions, rng)
  splits_xy['test'] = ([src.x[parts[k]] for k in new_ids], [src.y[parts[k]] for k in new_ids])
  width = max(len(train_ids), len(new_ids))
  example_shape = src.x.shape[1:]
  empty_x = np.zeros((0,) + example_shape, src.x.dtype)
  empty_y = np.zeros((0,), src.y.dtype)
  splits = {}
  for name, (xs, ys) in splits_xy.items():
    pad = width - len(xs)
    splits[name] = stack_clients(list(xs) + [empty_x] * pad, list(ys) + [empty_y] * pad,
                                 example_shape=example_shape)
  info = {'source': data_config.source, 'partition': data_config.partition,
          'training_clients': train_ids.tolist(), 'new_clients': {'test': new_ids.tolist()}}
  return Benchmark(splits, src.num_classes, tuple(example_shape), info)
