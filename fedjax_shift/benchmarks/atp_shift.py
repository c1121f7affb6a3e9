"""ATP's source/target protocol (Bao et al., NeurIPS 2023, Sec. 5; the authors' code).

Clients are split into labelled *source* clients (``data.num_clients``, ATP: 240, each 160 train + 40
held-out examples: the global model trains on the former, α on the latter) and
unlabelled *target* clients (ATP: 60, 200 test examples each). Source and target
clients draw from disjoint pools of base images (``data.target_split`` names a
separate TFDS split for the targets, e.g. CIFAR-10 'test'; otherwise 20 % of the
pooled data is held out for them).

Shifts, per client:
  feature  one corruption at one severity (sources: 15 CIFAR-10-C corruptions,
           targets: the 4 held-out ones), class-balanced labels
  label    step_2_16: 2 major classes × 80 and 8 minor × 5 (scaled to the client
           size), clean images
  hybrid   both

The source pool is split once more, in the ratio source_train : source_heldout, into
a training pool and a held-out pool, so no held-out image is, as a base image, another
source client's training image (the authors' partition draws every client's images
without overlap; ``info`` records the pools' sizes). A client's labels are drawn for
all its examples, shuffled, then split into its train and held-out parts.

Each client's examples are drawn without replacement from its pool's per-class
lists while they last; when a class runs out (5,000 embedded digits cannot give
300 × 200 distinct images) examples are drawn again from the whole class list —
the same base image may then appear at several clients, usually under different
corruptions. ``info['reused_examples']`` counts those draws. With
``data.target_corrupted_tfds`` the target images come from TFDS
``cifar10_corrupted/<corruption>_<severity>`` (the real CIFAR-10-C files, whose
rows are the CIFAR-10 test images in order) instead of the numpy corruptions.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Tuple

import ml_collections
import numpy as np

from fedjax_shift.benchmarks.base import (BENCHMARKS, SEVERITY, Benchmark, check_source,
                                          load_source)
from fedjax_shift.data import corruptions, sources
from fedjax_shift.data.federated import FederatedData, stack_clients
from fedjax_shift.registry import (BOOL, FRACTION, POSITIVE_INT, TEXT, one_of, require,
                                   sequence_of)

SHIFTS = ('feature', 'label', 'hybrid')


class ShiftData(NamedTuple):
  source: Benchmark          # splits 'train' (model) and 'val' (α), K_source clients
  target: FederatedData      # K_target unlabelled-at-test clients (labels only score)
  info: dict


def class_counts(total: int, num_classes: int, shift: str, num_major: int, major_count: int,
                 minor_count: int, rng: np.random.Generator) -> np.ndarray:
  """Examples per class for one client of ``total`` examples."""
  if shift == 'feature':
    counts = np.full(num_classes, total // num_classes)
    counts[rng.permutation(num_classes)[:total - counts.sum()]] += 1
    return counts
  weights = np.full(num_classes, float(minor_count))
  weights[rng.choice(num_classes, num_major, replace=False)] = major_count
  counts = np.floor(weights / weights.sum() * total).astype(int)
  counts[np.argsort(-weights, kind='stable')[:total - counts.sum()]] += 1
  return counts


class _Pool:
  """Per-class index lists drawn without replacement, then with reuse; ``members``
  (indices into ``labels``, default all) are the images this pool may give."""

  def __init__(self, name: str, labels: np.ndarray, num_classes: int,
               rng: np.random.Generator, members: np.ndarray | None = None):
    self.name = name
    members = np.arange(len(labels)) if members is None else np.asarray(members)
    self.size = len(members)
    self.all = [members[labels[members] == c] for c in range(num_classes)]
    self.left = [list(rng.permutation(a)) for a in self.all]
    self.rng = rng
    self.reused = 0

  def draw(self, c: int, count: int) -> np.ndarray:
    if count and not len(self.all[c]):
      raise ValueError(f'atp protocol: the {self.name} pool ({self.size} images) has no '
                       f'image of class {c}; use more data or fewer classes')
    fresh = self.left[c][:count]
    del self.left[c][:count]
    extra = count - len(fresh)
    self.reused += int(extra)
    again = self.rng.choice(self.all[c], extra, replace=len(self.all[c]) < extra) if extra else []
    return np.concatenate([np.asarray(fresh, int), np.asarray(again, int)])


def _clients(parts: Tuple[Tuple[_Pool, int], ...], num_clients: int, shift: str,
             names: Tuple[str, ...], severities: Tuple[int, ...], num_classes: int,
             data_config, rng):
  """(per-client indices, corruption names or None, severities). ``parts``: (pool,
  size) of each consecutive part of a client's examples (source: train, held-out);
  the client's class counts are drawn for all of them, its labels shuffled and cut
  into the parts, each part drawn from its own pool."""
  indices, per_names, per_sev = [], [], []
  for _ in range(num_clients):
    counts = class_counts(sum(size for _, size in parts), num_classes, shift,
                          data_config.step_major_classes, data_config.step_major_count,
                          data_config.step_minor_count, rng)
    labels = rng.permutation(np.repeat(np.arange(num_classes), counts))
    idx, start = [], 0
    for pool, size in parts:
      part_counts = np.bincount(labels[start:start + size], minlength=num_classes)
      start += size
      idx.append(rng.permutation(np.concatenate(
          [pool.draw(c, n) for c, n in enumerate(part_counts)])))
    indices.append(np.concatenate(idx))
    if shift == 'label':
      per_names.append(None)
      per_sev.append(0)
    else:
      per_names.append(names[rng.integers(len(names))])
      per_sev.append(int(severities[rng.integers(len(severities))]))
  return indices, per_names, per_sev


def _apply(x: np.ndarray, name, severity: int, seed: int) -> np.ndarray:
  return x if name is None else corruptions.corrupt(x, name, severity, seed)


def _tfds_corrupted(data_config, names, severities, indices) -> List[np.ndarray]:
  """Target images read from TFDS cifar10_corrupted/<name>_<severity> at the
  clients' CIFAR-10 test indices."""
  cache: Dict[str, np.ndarray] = {}
  out = []
  for name, severity, idx in zip(names, severities, indices):
    key = f'cifar10_corrupted/{name}_{severity}'
    if key not in cache:
      cache[key] = sources.tfds_source(key, 'test', data_config.data_dir or None).x
    out.append(cache[key][idx % len(cache[key])])
  return out


def check(data_config: ml_collections.ConfigDict) -> None:
  """The source clients, the data source and the targets' share of ``config.data``."""
  require(data_config.num_clients >= 1, 'data.num_clients',
          f'must be >= 1, got {data_config.num_clients}')
  check_source(data_config)
  require(0 < data_config.target_data_fraction < 1 or bool(data_config.target_split),
          'data.target_data_fraction',
          f'must be in (0, 1), got {data_config.target_data_fraction}')


@BENCHMARKS.register('atp_shift', defaults={
    'shift': 'hybrid',                # 'feature' | 'label' | 'hybrid'
    'num_target_clients': 60,         # ATP: 60 target clients (data.num_clients: 240 sources)
    'source_train': 160,              # ATP: 160 train / 40 held-out per source client
    'source_heldout': 40,
    'target_test': 200,               # ATP: 200 unlabelled test samples per target
    'target_data_fraction': 0.2,      # ATP: 20 % of the data held out for targets
    'target_split': '',               # a separate TFDS split for targets ('test' for CIFAR-10)
    'target_corrupted_tfds': False,   # targets from TFDS cifar10_corrupted
    'source_corruptions': corruptions.SOURCE_CORRUPTIONS,   # ATP: 15 source corruptions
    'target_corruptions': corruptions.HELDOUT_CORRUPTIONS,  # ATP: 4 held-out ones
    'severities': (1, 2, 3, 4, 5),    # one severity per client, drawn uniformly
}, ranges={
    'shift': one_of(*SHIFTS),
    'num_target_clients': POSITIVE_INT, 'source_train': POSITIVE_INT,
    'source_heldout': POSITIVE_INT, 'target_test': POSITIVE_INT,
    'target_data_fraction': FRACTION,   # in (0, 1) unless target_split (check)
    'target_split': TEXT,               # '': the pooled data
    'target_corrupted_tfds': BOOL,
    'source_corruptions': sequence_of(one_of(*corruptions.ALL_CORRUPTIONS), 1),
    'target_corruptions': sequence_of(one_of(*corruptions.ALL_CORRUPTIONS), 1),
    'severities': sequence_of(SEVERITY, 1),
}, check=check, pipelines=('atp',))
def atp_protocol(data_config: ml_collections.ConfigDict, seed: int) -> ShiftData:
  """Source clients (train + held-out) and disjoint target clients under
  ``data_config.shift`` (see the module docstring)."""
  shift = data_config.shift
  rng = np.random.default_rng([seed, 7])
  pooled = load_source(data_config)
  num_classes = pooled.num_classes
  if data_config.target_split:
    source_x, source_y = pooled.x, pooled.y
    target_config = ml_collections.ConfigDict(data_config.to_dict())
    target_config.tfds_split = data_config.target_split
    target_src = load_source(target_config)
    target_x, target_y = target_src.x, target_src.y
  else:
    order = rng.permutation(len(pooled.y))
    cut = int(round(len(order) * (1 - data_config.target_data_fraction)))
    source_x, source_y = pooled.x[order[:cut]], pooled.y[order[:cut]]
    target_x, target_y = pooled.x[order[cut:]], pooled.y[order[cut:]]

  severities = tuple(data_config.severities)
  source_order = rng.permutation(len(source_y))
  heldout_fraction = data_config.source_heldout / (data_config.source_train +
                                                   data_config.source_heldout)
  source_cut = int(round(len(source_order) * (1 - heldout_fraction)))
  train_pool = _Pool('source training', source_y, num_classes, rng, source_order[:source_cut])
  heldout_pool = _Pool('source held-out', source_y, num_classes, rng,
                       source_order[source_cut:])
  s_idx, s_names, s_sev = _clients(
      ((train_pool, data_config.source_train), (heldout_pool, data_config.source_heldout)),
      data_config.num_clients, shift, tuple(data_config.source_corruptions), severities,
      num_classes, data_config, rng)
  target_pool = _Pool('target', target_y, num_classes, rng)
  t_idx, t_names, t_sev = _clients(((target_pool, data_config.target_test),),
                                   data_config.num_target_clients, shift,
                                   tuple(data_config.target_corruptions), severities,
                                   num_classes, data_config, rng)

  train_x, train_y, val_x, val_y = [], [], [], []
  for k, (idx, name, sev) in enumerate(zip(s_idx, s_names, s_sev)):
    x = _apply(source_x[idx], name, sev, seed * 1_000_003 + k)
    cut = data_config.source_train
    train_x.append(x[:cut]); train_y.append(source_y[idx[:cut]])
    val_x.append(x[cut:]); val_y.append(source_y[idx[cut:]])
  if data_config.target_corrupted_tfds and shift != 'label':
    test_x = _tfds_corrupted(data_config, t_names, t_sev, t_idx)
  else:
    test_x = [_apply(target_x[idx], name, sev, seed * 1_000_003 + 500_000 + k)
              for k, (idx, name, sev) in enumerate(zip(t_idx, t_names, t_sev))]
  test_y = [target_y[idx] for idx in t_idx]

  shape = source_x.shape[1:]
  source = Benchmark({'train': stack_clients(train_x, train_y, example_shape=shape),
                      'val': stack_clients(val_x, val_y, example_shape=shape)},
                     num_classes, tuple(shape), {})
  target = stack_clients(test_x, test_y, example_shape=shape)
  info = {'shift': shift, 'source': data_config.source,
          'source_pool': int(len(source_y)), 'target_pool': int(len(target_y)),
          'source_train_pool': train_pool.size, 'source_heldout_pool': heldout_pool.size,
          'reused_examples': {'source_train': int(train_pool.reused),
                              'source_heldout': int(heldout_pool.reused),
                              'target': int(target_pool.reused)},
          'source_corruptions': s_names, 'source_severities': s_sev,
          'target_corruptions': t_names, 'target_severities': t_sev}
  source = source._replace(info=info)
  return ShiftData(source, target, info)
