"""The test-time adaptation benchmark's data (``config.data.benchmark =
'tta_corruptions'``, the ``tta_bench`` pipeline): a source model's clean training
clients and, held out from them, one test set seen under every corruption of the
CIFAR-10-C set (Hendrycks & Dietterich, ICLR 2019) at one severity, as TTAB (Zhao et
al., ICML 2023) and the online-evaluation benchmark of Alfarra et al. (ICML 2024)
evaluate test-time adapters.

The source (``data.source``) is split once: ``test_fraction`` of it (or the separate
split ``test_split``, e.g. Fashion-MNIST's 10,000 test images) is the test set, the
rest is dealt to ``data.num_clients`` training clients by ``data.partition`` (one
client: a centrally trained source model). Every corruption sees the same test
images, each corrupted with its own seed, so the columns differ by the corruption
alone.
"""
from __future__ import annotations

from typing import Dict, NamedTuple

import ml_collections
import numpy as np

from fedjax_shift.benchmarks.base import (BENCHMARKS, SEVERITY, Benchmark, check_partition,
                                          check_source, load_source, partition)
from fedjax_shift.data import corruptions
from fedjax_shift.data.federated import stack_clients
from fedjax_shift.registry import (FRACTION, NONNEGATIVE_INT, TEXT, one_of, require,
                                   require_distinct, sequence_of)


class CorruptedTests(NamedTuple):
  source: Benchmark                    # the training clients ('train')
  clean_x: np.ndarray                  # [M, ...] the test images
  y: np.ndarray                        # [M]
  corrupted: Dict[str, np.ndarray]     # corruption -> [M, ...], the same images corrupted
  info: dict


def check(data_config: ml_collections.ConfigDict) -> None:
  check_source(data_config)
  check_partition(data_config)
  require_distinct(data_config.corruptions, 'data.corruptions', 'one column per corruption')
  require(0 < data_config.test_fraction < 1 or bool(data_config.test_split),
          'data.test_fraction', f'must be in (0, 1), got {data_config.test_fraction}')


@BENCHMARKS.register('tta_corruptions', defaults={
    'corruptions': corruptions.SOURCE_CORRUPTIONS,   # the 15 of CIFAR-10-C
    'severity': 5,                    # TTAB and Alfarra et al.: severity 5
    'test_fraction': 0.2,             # of the pooled source, held out as the test set
    'test_split': '',                 # a separate split for the test set instead ('test')
    'test_examples': 0,               # the first this many test images (0 = all)
}, ranges={
    'corruptions': sequence_of(one_of(*corruptions.ALL_CORRUPTIONS), 1),
    'severity': SEVERITY,
    'test_fraction': FRACTION,        # in (0, 1) unless test_split (check)
    'test_split': TEXT,
    'test_examples': NONNEGATIVE_INT,
}, check=check, pipelines=('tta_bench',), partitioned=True)
def tta_corruptions(data_config: ml_collections.ConfigDict, seed: int) -> CorruptedTests:
  """The training clients and the corrupted test sets for ``seed`` (which draws the
  test/train split, the partition and every corruption's noise)."""
  rng = np.random.default_rng([seed, 11])
  pooled = load_source(data_config)
  if data_config.test_split:
    test_config = ml_collections.ConfigDict(data_config.to_dict())
    test_config.tfds_split = data_config.test_split
    test = load_source(test_config)
    train_x, train_y = pooled.x, pooled.y
    order = rng.permutation(len(test.y))
    test_x, test_y = test.x[order], test.y[order]
  else:
    order = rng.permutation(len(pooled.y))
    cut = int(round(len(order) * (1 - data_config.test_fraction)))
    train_x, train_y = pooled.x[order[:cut]], pooled.y[order[:cut]]
    test_x, test_y = pooled.x[order[cut:]], pooled.y[order[cut:]]
  if data_config.test_examples:
    test_x, test_y = test_x[:data_config.test_examples], test_y[:data_config.test_examples]
  parts = partition(train_y, data_config, pooled.num_classes, rng)
  shape = tuple(train_x.shape[1:])
  source = Benchmark({'train': stack_clients([train_x[p] for p in parts],
                                             [train_y[p] for p in parts], example_shape=shape)},
                     pooled.num_classes, shape, {})
  clean = np.asarray(test_x, np.float32)
  corrupted = {name: corruptions.corrupt(clean, name, data_config.severity,
                                         seed * 1_000_003 + index)
               for index, name in enumerate(data_config.corruptions)}
  info = {'source': data_config.source, 'train_examples': int(len(train_y)),
          'test_examples': int(len(test_y)), 'clients': len(parts),
          'corruptions': list(data_config.corruptions), 'severity': int(data_config.severity),
          'test_class_counts': np.bincount(test_y, minlength=pooled.num_classes).tolist()}
  return CorruptedTests(source._replace(info=info), clean, np.asarray(test_y, np.int32),
                        corrupted, info)
