"""UPFL: unsupervised personalisation of new clients (FedTTA, Ye et al., UPFL 2023 Sec. 4.1.1).

The source is partitioned over ``num_clients`` (the paper: 100 clients, pathological,
at most 2 classes each); a random ``new_client_fraction`` (50 %) of them are new
clients that take no part in training and bring only unlabelled data. Each training
client's examples are split train / validation 85 : 15.

Two shifts of the paper on top (``config.data`` fields):
  new_client_alpha > 0   Table 2, degrees of distribution shift (Sec. 4.3): the source
                         is first split into a training pool and a new-client pool
                         (``new_client_fraction`` of the examples); the training pool
                         goes to the training clients by ``data.partition`` (the
                         paper: Dirichlet α = 0.1), the new pool to the new clients by
                         Dirichlet(``new_client_alpha``) (0.01 … 0.5).
  train_rotations,       concept shift (Sec. 4.5, App. F): each training client's
  new_rotations          images are rotated by one angle of train_rotations (0, 30,
                         60 degrees), each new client's by one of new_rotations (15,
                         45), counter-clockwise; ``rotation_choice`` 'random' draws
                         each client's angle uniformly (App. F: "randomly selected …
                         with equal probability"), 'cycle' gives client k
                         angles[k mod len]. App. F's clients hold a random sample of
                         ``sample_examples`` = 1,000 digits, IID over 50 clients.

A public unlabelled set (HeteroFedTTA's D_p, Sec. 3.4) when ``public_source`` is set:
'holdout' takes ``public_examples`` digits out of the source before partitioning (no
client holds them), 'uci_digits' draws them from the UCI digits (another writer
population, framed as MNIST's: the digit in the central 20/28, a zero margin). The
indices are in ``info['public']``; ``public_set(data_config, info)`` returns the images
and their labels (the labels only to score a method's knowledge, never to train).

Splits (all with max(training, new) clients; the shorter side is padded with clients
holding no examples, which carry weight 0 in every mean):
  'train'  the training clients' 85 %
  'val'    the training clients' 15 % (the paper's validation accuracy)
  'test'   the new clients, all of their examples (the paper's test accuracy); client k
           of this split is new client k, not training client k — ``info['new_clients']``
           names the split. The federated pipeline scores a personalised method there
           as PFL-Sampled / PFL-Ensemble (core/evaluation.build_new_client_evaluate).
A new client's labels are only read to score predictions (adapters see x only). A new
client with no examples (padding, or an empty Dirichlet draw) counts 0 in every sum and
is left out of the mean over clients.
"""
from __future__ import annotations

import ml_collections
import numpy as np

from fedjax_shift.benchmarks.base import (BENCHMARKS, Benchmark, check_partition, check_source,
                                          load_source, partition)
from fedjax_shift.data import partitions, sources
from fedjax_shift.data.federated import split_clients, stack_clients
from fedjax_shift.registry import (NONNEGATIVE, NONNEGATIVE_INT, interval, one_of, require,
                                   sequence_of)


def check(data_config: ml_collections.ConfigDict) -> None:
  check_source(data_config)
  check_partition(data_config)
  fraction = data_config.new_client_fraction
  new = int(round(fraction * data_config.num_clients))
  require(1 <= new < data_config.num_clients, 'data.new_client_fraction',
          f'{fraction} of {data_config.num_clients} clients leaves no training or no new '
          f'client')
  if data_config.public_source:
    require(data_config.public_examples >= 1, 'data.public_examples',
            f'must be >= 1 with data.public_source={data_config.public_source!r}, got '
            f'{data_config.public_examples}')
  require(bool(data_config.train_rotations) == bool(data_config.new_rotations),
          'data.train_rotations', 'concept shift needs both train_rotations and '
          'new_rotations (or neither)')


def client_indices(labels: np.ndarray, data_config: ml_collections.ConfigDict, num_classes: int,
                   rng: np.random.Generator, groups=None):
  """(training clients' index arrays, new clients' index arrays) into ``labels``, and
  their client ids (of the partition of all clients; with ``new_client_alpha`` the
  training clients are 0 … T−1 and the new clients T … K−1). ``groups``: each
  example's writer, for the 'natural' partition."""
  num_clients = data_config.num_clients
  num_new = int(round(data_config.new_client_fraction * num_clients))
  if not data_config.new_client_alpha:
    parts = partition(labels, data_config, num_classes, rng, groups=groups)
    order = rng.permutation(len(parts))
    train_ids, new_ids = np.sort(order[num_new:]), np.sort(order[:num_new])
    return [parts[k] for k in train_ids], [parts[k] for k in new_ids], train_ids, new_ids
  order = rng.permutation(len(labels))
  cut = int(round(data_config.new_client_fraction * len(labels)))
  new_pool, train_pool = np.sort(order[:cut]), np.sort(order[cut:])
  train_parts = partition(labels[train_pool], data_config, num_classes, rng,
                          num_clients - num_new,
                          None if groups is None else groups[train_pool])
  new_parts = partitions.dirichlet(labels[new_pool], num_new, data_config.new_client_alpha,
                                   rng, min_examples=0)
  num_train = num_clients - num_new
  return ([train_pool[p] for p in train_parts], [new_pool[p] for p in new_parts],
          np.arange(num_train), num_train + np.arange(num_new))


PUBLIC_SOURCES = ('', 'holdout', 'uci_digits')
UCI_DIGITS = 1797


def public_indices(data_config: ml_collections.ConfigDict, num_source: int, seed: int
                   ) -> np.ndarray:
  """The public set's sorted indices (numpy generator [seed, 37]) into the source
  ('holdout') or the UCI digits; empty without ``public_source``."""
  source = data_config.public_source
  if not source:
    return np.zeros((0,), np.int64)
  available = num_source if source == 'holdout' else UCI_DIGITS
  count = data_config.public_examples
  if count > available:
    raise ValueError(f'config.data.public_examples={count}: {source} has only {available} '
                     f'examples' + (' (and the clients need some)' if source == 'holdout' else ''))
  return np.sort(np.random.default_rng([seed, 37]).permutation(available)[:count])


def public_set(data_config: ml_collections.ConfigDict, info: dict):
  """(x [P, ...], y [P]) of the benchmark's public set (``info['public']``)."""
  public = info.get('public')
  if not public:
    raise ValueError('the benchmark has no public set: set config.data.upfl.public_source')
  indices = np.asarray(public['indices'], np.int64)
  size = data_config.image_size or 28
  if public['source'] == 'holdout':
    src = load_source(data_config)
    return src.x[indices], src.y[indices]
  src = sources.uci_digits_mnist_frame(size)
  x = src.x[indices]
  if data_config.channels:
    x = sources.to_channels(x, data_config.channels)
  return x, src.y[indices]


ROTATION_CHOICES = ('cycle', 'random')


def client_angles(num_clients: int, angles, choice: str, rng: np.random.Generator
                  ) -> np.ndarray:
  """[num_clients] degrees: angles[k mod len] ('cycle') or uniform draws ('random');
  empty when ``angles`` is."""
  if not len(angles):
    return np.zeros((0,))
  angles = np.asarray(angles, np.float64)
  if choice == 'random':
    return angles[rng.integers(len(angles), size=num_clients)]
  return angles[np.arange(num_clients) % len(angles)]


def rotated(xs, angles):
  """Client k's images rotated by angles[k] degrees (none when angles is empty)."""
  if not len(angles):
    return list(xs)
  return [sources.rotate(x, float(angle)) for x, angle in zip(xs, angles)]


@BENCHMARKS.register('upfl', defaults={
    'new_client_fraction': 0.5,     # FedTTA Sec. 4.1.1: 50 % training / 50 % new clients
    'validation_fraction': 0.15,    # training clients: train / validation 85 : 15
    'new_client_alpha': 0.0,        # Table 2: new clients' Dirichlet α (0 = no own split)
    'train_rotations': (),          # Sec. 4.5 concept shift: (0, 30, 60)
    'new_rotations': (),            #   and (15, 45) degrees
    'rotation_choice': 'cycle',     # a client's angle: 'cycle' | 'random' (App. F)
    'sample_examples': 0,           # App. F: a random sample of 1,000 digits (0: all)
    'public_source': '',            # HeteroFedTTA's D_p: '' | 'holdout' | 'uci_digits'
    'public_examples': 0,           # |D_p|
}, ranges={
    'new_client_fraction': interval(0, 1, low_open=True, high_open=True),
    'validation_fraction': interval(0, 1, high_open=True),   # 0: no 'val' split
    'new_client_alpha': NONNEGATIVE,   # 0: new clients partitioned with the training ones
    'train_rotations': sequence_of(interval()),   # degrees; both or neither (check)
    'new_rotations': sequence_of(interval()),
    'rotation_choice': one_of(*ROTATION_CHOICES),
    'sample_examples': NONNEGATIVE_INT,           # 0: every example of the source
    'public_source': one_of(*PUBLIC_SOURCES),
    'public_examples': NONNEGATIVE_INT,           # >= 1 with a public_source (check)
}, check=check, pipelines=('federated', 'hetero'), partitioned=True)
def upfl(data_config: ml_collections.ConfigDict, seed: int) -> Benchmark:
  rng = np.random.default_rng([seed, 19])
  src = load_source(data_config)
  if data_config.partition == 'pathological' and \
      data_config.classes_per_client > src.num_classes:
    raise ValueError(f'config.data.classes_per_client={data_config.classes_per_client}: '
                     f'the source has only {src.num_classes} classes')
  public = public_indices(data_config, len(src.y), seed)
  pool = np.arange(len(src.y))
  if data_config.public_source == 'holdout':   # no client holds a public digit
    pool = np.setdiff1d(pool, public)
  if data_config.sample_examples:
    if data_config.sample_examples > len(pool):
      raise ValueError(f'config.data.sample_examples={data_config.sample_examples}: the '
                       f'source has only {len(pool)} examples for the clients')
    pool = np.sort(np.random.default_rng([seed, 41]).permutation(pool)
                   [:data_config.sample_examples])
  train_parts, new_parts, train_ids, new_ids = client_indices(
      src.y[pool], data_config, src.num_classes, rng,
      None if src.groups is None else src.groups[pool])
  train_parts, new_parts = [pool[p] for p in train_parts], [pool[p] for p in new_parts]
  partitions.check_disjoint(train_parts + new_parts)
  val = data_config.validation_fraction
  fractions = {'train': 1.0 - val, 'val': val} if val else {'train': 1.0}
  angle_rng = np.random.default_rng([seed, 43])
  train_angles = client_angles(len(train_parts), data_config.train_rotations,
                               data_config.rotation_choice, angle_rng)
  new_angles = client_angles(len(new_parts), data_config.new_rotations,
                             data_config.rotation_choice, angle_rng)
  train_x = rotated([src.x[p] for p in train_parts], train_angles)
  splits_xy = split_clients(train_x, [src.y[p] for p in train_parts], fractions, rng)
  splits_xy['test'] = (rotated([src.x[p] for p in new_parts], new_angles),
                       [src.y[p] for p in new_parts])
  width = max(len(train_parts), len(new_parts))
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
  if data_config.public_source:
    info['public'] = {'source': data_config.public_source, 'indices': public.tolist()}
  if data_config.train_rotations:
    info['rotations'] = {'train': [float(a) for a in data_config.train_rotations],
                         'test': [float(a) for a in data_config.new_rotations],
                         'choice': data_config.rotation_choice,
                         'train_clients': train_angles.tolist(),
                         'test_clients': new_angles.tolist()}
  return Benchmark(splits, src.num_classes, tuple(example_shape), info)
