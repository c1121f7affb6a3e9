"""The FedTHE-style benchmark: label-skewed clients, each with its own train / val /
test splits and up to five test sets (FedTHE Sec. 5 and its official code):

  test            in-distribution: the client's own held-out examples
  test_corrupted  the same under one CIFAR-10-C corruption per client (``corruptions``),
                  or one per example (``corruption_draw='example'``, as FedTHE's code)
  test_ooc        out-of-client label shift, another label distribution: with
                  ``ooc_source='pooled'`` (FedTHE's create_dataset) a random 1/(K−1) of
                  the other K−1 clients' pooled test splits; with 'donor' the test
                  split of one other client (a random derangement of the clients)
  test_natural    natural shift: the client's test label counts drawn from another
                  real source (``natural_source``; 'auto': UCI digits, framed as MNIST's,
                  for MNIST clients; CIFAR-10.1 through TFDS for CIFAR-10)
  test_mixture    an equal share of each of the client's other test sets, shuffled

``shift_tests`` chooses among 'ooc', 'natural' and 'mixture' (default none). Every test
set is disjoint from every client's training data: the partition is disjoint, another
client's test split is not in anyone's training split, and the natural source is
another dataset.
"""
from __future__ import annotations

import math

import ml_collections
import numpy as np

from fedjax_shift.benchmarks.base import (BENCHMARKS, SEVERITY, Benchmark, check_partition,
                                          check_source, load_source, partition)
from fedjax_shift.data import corruptions, partitions, sources, store
from fedjax_shift.data.federated import split_positions
from fedjax_shift.registry import FRACTION, Range, one_of, require, sequence_of


def check(data_config: ml_collections.ConfigDict) -> None:
  """Source, partition, splits and corruptions of ``config.data``."""
  check_source(data_config)
  check_partition(data_config)
  if 'natural' in data_config.shift_tests:
    natural_source(data_config)
  fractions = dict(data_config.split_fractions)
  require('test' in fractions or not data_config.shift_tests, 'data.shift_tests',
          f'the shifted test sets are built from each client\'s test split; '
          f'data.split_fractions has none ({fractions})')
  require('train' in fractions and math.isclose(sum(fractions.values()), 1.0),
          'data.split_fractions',
          f'need a "train" split and fractions summing to 1, got {fractions}')


SHIFT_TESTS = ('ooc', 'natural', 'mixture')
CORRUPTION_DRAWS = ('client', 'example')
OOC_SOURCES = ('pooled', 'donor')
# data.source -> the natural shift 'auto' picks (FedTHE: CIFAR-10 -> CIFAR-10.1).
NATURAL_SOURCES = {'mnist_embedded': 'uci_digits', 'tfds:mnist': 'uci_digits',
                   'tfds:cifar10': 'tfds:cifar10_1'}
NATURAL_SOURCE = Range(
    f"'auto', 'uci_digits' or tfds:<name> with <name> in {sorted(sources.TFDS_DATASETS)}",
    lambda value: isinstance(value, str) and (value in ('auto', 'uci_digits') or (
        value.startswith('tfds:') and value[5:].split('/')[0] in sources.TFDS_DATASETS)),
    'unknown')


def natural_source(data_config: ml_collections.ConfigDict) -> str:
  """The natural-shift source of ``data.natural_source`` ('auto' resolved)."""
  name = data_config.natural_source
  if name == 'auto':
    require(data_config.source in NATURAL_SOURCES, 'data.natural_source',
            f'no natural shift is known for data.source={data_config.source!r} (known: '
            f'{NATURAL_SOURCES}); name one ("uci_digits" or "tfds:<name>") or leave '
            f'"natural" out of data.shift_tests')
    name = NATURAL_SOURCES[data_config.source]
  require(name == 'uci_digits' or (name.startswith('tfds:') and
                                   name[5:].split('/')[0] in sources.TFDS_DATASETS),
          'data.natural_source', f'unknown source {name!r}; choose "auto", "uci_digits" or '
          f'tfds:<name> with <name> in {sorted(sources.TFDS_DATASETS)}')
  require(name != data_config.source, 'data.natural_source',
          f'{name!r} is the training source itself, not a shift')
  return name


def load_natural(data_config: ml_collections.ConfigDict, example_shape) -> sources.Source:
  """The natural-shift pool shaped like the training examples. A TFDS source that is
  not prepared offline raises naming ``data.natural_source``."""
  name = natural_source(data_config)
  if name == 'uci_digits':
    src = sources.uci_digits_mnist_frame(example_shape[0])
  else:
    try:
      src = sources.tfds_source(name[5:], 'test', data_config.data_dir or None)
    except FileNotFoundError as err:
      raise FileNotFoundError(f'config.data.natural_source={name!r} is not available '
                              f'offline: {err}') from None
    if src.x.shape[1] != example_shape[0]:
      src = sources.Source(sources.resize_images(src.x, example_shape[0], example_shape[1]),
                           src.y, src.num_classes)
  x = src.x
  if x.shape[-1] != example_shape[-1]:
    x = sources.to_channels(x, example_shape[-1])
  return sources.Source(x.astype(np.float32), src.y, src.num_classes)


def draw_like(labels_per_client, pool_labels: np.ndarray, rng: np.random.Generator):
  """Per client, indices into the pool with the client's label counts: each class's
  pool is permuted once and dealt out in order, starting over only when exhausted
  (so clients share natural examples only when the pool is too small)."""
  order = {c: rng.permutation(np.flatnonzero(pool_labels == c))
           for c in np.unique(pool_labels)}
  cursor = {c: 0 for c in order}
  drawn = []
  for labels in labels_per_client:
    picked = []
    for c in labels:
      if c not in order:
        raise ValueError(f'config.data.natural_source has no example of class {c}')
      picked.append(order[c][cursor[c] % len(order[c])])
      cursor[c] += 1
    drawn.append(np.asarray(picked, np.int64))
  return drawn


def ooc_donors(num_clients: int, rng: np.random.Generator) -> np.ndarray:
  """A random derangement: client k's out-of-client test set is donors[k] != k's
  (the identity for a single client, which has no other client)."""
  if num_clients == 1:
    return np.zeros(1, np.int64)
  while True:
    donors = rng.permutation(num_clients)
    if np.all(donors != np.arange(num_clients)):
      return donors


def pooled_ooc(xs, ys, rng: np.random.Generator):
  """Per client k, a random round(P_k / (K − 1)) of the pool P_k of the other clients'
  test examples (FedTHE's out-of-client test set): ([x_k], [y_k])."""
  num_clients = len(ys)
  out_x, out_y = [], []
  for k in range(num_clients):
    others = [j for j in range(num_clients) if j != k] or [k]
    pool_x = np.concatenate([xs[j] for j in others])
    pool_y = np.concatenate([ys[j] for j in others])
    take = rng.permutation(len(pool_y))[:int(round(len(pool_y) / len(others)))]
    out_x.append(pool_x[take])
    out_y.append(pool_y[take])
  return out_x, out_y


def mixture(test_sets, rng: np.random.Generator):
  """Per client, round(n_s / S) random examples of each of its S test sets s, shuffled:
  ([x_k], [y_k])."""
  xs, ys = [], []
  for k in range(len(test_sets[0][0])):
    parts_x, parts_y = [], []
    for set_x, set_y in test_sets:
      n = len(set_y[k])
      take = rng.permutation(n)[:int(round(n / len(test_sets)))]
      parts_x.append(set_x[k][take])
      parts_y.append(set_y[k][take])
    x, y = np.concatenate(parts_x), np.concatenate(parts_y)
    order = rng.permutation(len(y))
    xs.append(x[order])
    ys.append(y[order])
  return xs, ys


# Each client's splits and its corrupted test split (FedTHE; the digit domains too).
SPLIT_AND_CORRUPTION_DEFAULTS = {
    'split_fractions': {'train': 0.6, 'val': 0.2, 'test': 0.2},   # FedTHE: 60/20/20
    'corruptions': ('gaussian_noise', 'shot_noise', 'impulse_noise', 'defocus_blur',
                    'motion_blur', 'contrast', 'elastic_transform', 'pixelate'),
    'severity': 5,                    # FedTHE corrupted test set: severity 5
}
SPLIT_AND_CORRUPTION_RANGES = {
    'split_fractions': FRACTION,   # each split's; they sum to 1 (check)
    'corruptions': sequence_of(one_of(*corruptions.ALL_CORRUPTIONS)),   # (): no test_corrupted
    'severity': SEVERITY,
}


@BENCHMARKS.register('label_skew_corrupted', defaults={
    **SPLIT_AND_CORRUPTION_DEFAULTS,
    'shift_tests': (),                # any of 'ooc', 'natural', 'mixture' (FedTHE's five)
    'natural_source': 'auto',         # test_natural's source ('auto': by data.source)
    'ooc_source': 'pooled',           # test_ooc: 'pooled' (FedTHE) | 'donor' (one client)
    # test_corrupted: one corruption per 'client' | per 'example' (FedTHE's corr_data)
    'corruption_draw': 'client',
}, ranges={
    **SPLIT_AND_CORRUPTION_RANGES,
    'shift_tests': sequence_of(one_of(*SHIFT_TESTS)),
    'natural_source': NATURAL_SOURCE,
    'ooc_source': one_of(*OOC_SOURCES),
    'corruption_draw': one_of(*CORRUPTION_DRAWS),
}, check=check, pipelines=('federated',), partitioned=True)
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
  parts = partition(src.y, data_config, src.num_classes, rng, groups=src.groups)
  partitions.check_disjoint(parts)
  fractions = dict(data_config.split_fractions)
  positions = split_positions([len(p) for p in parts], fractions, rng)
  split_parts = {name: [part[chosen] for part, chosen in zip(parts, per_client)]
                 for name, per_client in positions.items()}
  example_shape = src.x.shape[1:]
  # Each split stored once, in client order (data/store.py): memory follows the examples.
  splits = {name: store.from_parts(src.x, src.y, chosen, name)
            for name, chosen in split_parts.items()}
  # The test split's per-client arrays, for the shifted test splits built from it.
  shifted = bool(tuple(data_config.corruptions) or tuple(data_config.shift_tests))
  splits_xy = {name: ([src.x[p] for p in chosen], [src.y[p] for p in chosen])
               for name, chosen in split_parts.items() if name == 'test' and shifted}
  info = {'source': data_config.source, 'partition': data_config.partition}
  names = tuple(data_config.corruptions)
  if names and 'test' in splits_xy:
    severity = data_config.severity
    # Drawn with either corruption_draw, so that nothing drawn after it changes.
    per_client = [names[i] for i in rng.integers(0, len(names), len(parts))]
    xs, ys = splits_xy['test']
    if data_config.corruption_draw == 'client':
      corrupted = [corruptions.corrupt(x, name, severity, seed * 100_003 + k)
                   if len(x) else x for k, (x, name) in enumerate(zip(xs, per_client))]
      info['corruption_per_client'] = per_client
    else:
      # A generator of its own: the draw of every other split stays that of 'client'.
      example_rng = np.random.default_rng([seed, 43])
      drawn = [corruptions.corrupt_each_example(x, names, severity, seed * 100_003 + k,
                                                example_rng) for k, x in enumerate(xs)]
      corrupted = [x for x, _ in drawn]
      info['corruptions'] = names
      info['corruption_counts_per_client'] = [
          np.bincount(chosen, minlength=len(names)).tolist() for _, chosen in drawn]
    splits['test_corrupted'] = store.from_clients(corrupted, ys, example_shape, 'test_corrupted')
    info['corruption_draw'] = data_config.corruption_draw
    info['severity'] = severity
  shift_tests = tuple(data_config.shift_tests)
  if shift_tests:
    # A generator of its own, so the splits above stay those of runs without these sets.
    shift_rng = np.random.default_rng([seed, 41])
    test_sets = {'test': splits_xy['test']}
    if 'test_corrupted' in splits:
      test_sets['test_corrupted'] = (corrupted, splits_xy['test'][1])
    if 'ooc' in shift_tests:
      xs, ys = splits_xy['test']
      if data_config.ooc_source == 'pooled':
        test_sets['test_ooc'] = pooled_ooc(xs, ys, shift_rng)
      else:
        donors = ooc_donors(len(parts), shift_rng)
        test_sets['test_ooc'] = ([xs[d] for d in donors], [ys[d] for d in donors])
        info['ooc_donors'] = donors.tolist()
      info['ooc_source'] = data_config.ooc_source
    if 'natural' in shift_tests:
      pool = load_natural(data_config, example_shape)
      drawn = draw_like(splits_xy['test'][1], pool.y, shift_rng)
      test_sets['test_natural'] = ([pool.x[i] for i in drawn], [pool.y[i] for i in drawn])
      info['natural_source'] = natural_source(data_config)
    if 'mixture' in shift_tests:
      test_sets['test_mixture'] = mixture(list(test_sets.values()), shift_rng)
    for name, (xs, ys) in test_sets.items():
      if name not in splits:
        splits[name] = store.from_clients(xs, ys, example_shape, name)
  return Benchmark(splits, src.num_classes, tuple(example_shape), info)

