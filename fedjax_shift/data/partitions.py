"""Label-skew partitions: which example goes to which client.

Each function takes labels [M] and a numpy Generator and returns a list of K index
arrays. Dirichlet and pathological assign every example exactly once; the step
partition draws a fixed number per class and per client without replacement.
"""
from __future__ import annotations

import math
from typing import List

import numpy as np


def dirichlet(labels: np.ndarray, num_clients: int, alpha: float,
              rng: np.random.Generator, min_examples: int = 2,
              max_tries: int = 1000) -> List[np.ndarray]:
  """Dirichlet(α) label skew (Hsu et al. 2019), as used by FedTHE/FedEvolve.

  For each class, its examples are split over clients with proportions drawn from
  Dir(α·1_K). α = inf gives a uniform (IID) split. Redraws until every client has at
  least ``min_examples`` examples.
  """
  if not alpha > 0:
    raise ValueError(f'dirichlet alpha must be > 0, got {alpha}')
  if num_clients < 1:
    raise ValueError(f'num_clients must be >= 1, got {num_clients}')
  labels = np.asarray(labels)
  if len(labels) < num_clients * min_examples:
    raise ValueError(f'{len(labels)} examples cannot give {num_clients} clients '
                     f'at least {min_examples} each')
  if math.isinf(alpha):
    order = rng.permutation(len(labels))
    return [np.sort(part) for part in np.array_split(order, num_clients)]
  classes = np.unique(labels)
  for _ in range(max_tries):
    parts = [[] for _ in range(num_clients)]
    for c in classes:
      idx = rng.permutation(np.nonzero(labels == c)[0])
      proportions = rng.dirichlet(np.full(num_clients, alpha))
      cuts = (np.cumsum(proportions) * len(idx)).astype(int)[:-1]
      for k, chunk in enumerate(np.split(idx, cuts)):
        parts[k].append(chunk)
    parts = [np.sort(np.concatenate(p)) for p in parts]
    if min(len(p) for p in parts) >= min_examples:
      return parts
  raise ValueError(f'dirichlet alpha={alpha}: no partition of {len(labels)} examples over '
                   f'{num_clients} clients with >= {min_examples} examples per client in '
                   f'{max_tries} draws; lower config.data.min_examples_per_client')


def pathological(labels: np.ndarray, num_clients: int, classes_per_client: int,
                 rng: np.random.Generator) -> List[np.ndarray]:
  """Pathological k-class split (McMahan et al. 2017): sort by label, cut into
  K·k shards, give each client k random shards."""
  if classes_per_client < 1:
    raise ValueError(f'classes_per_client must be >= 1, got {classes_per_client}')
  num_shards = num_clients * classes_per_client
  if len(labels) < num_shards:
    raise ValueError(f'{len(labels)} examples cannot make {num_shards} shards')
  order = np.argsort(np.asarray(labels), kind='stable')
  # Shuffle within each class first so shards are random samples of the class.
  order = order[np.lexsort((rng.random(len(order)), np.asarray(labels)[order]))]
  shards = np.array_split(order, num_shards)
  assignment = rng.permutation(num_shards).reshape(num_clients, classes_per_client)
  return [np.sort(np.concatenate([shards[s] for s in row])) for row in assignment]


def step(labels: np.ndarray, num_clients: int, num_major: int, major_count: int,
         minor_count: int, rng: np.random.Generator,
         num_classes: int | None = None) -> List[np.ndarray]:
  """Step label shift ('step_2_16' in ATP: 2 major classes × 80, others × 5).

  Each client picks ``num_major`` random major classes and draws ``major_count``
  examples of each and ``minor_count`` of every other class, without replacement
  across clients.
  """
  labels = np.asarray(labels)
  num_classes = int(num_classes or labels.max() + 1)
  if not 0 <= num_major <= num_classes:
    raise ValueError(f'num_major must be in [0, {num_classes}], got {num_major}')
  pools = [list(rng.permutation(np.nonzero(labels == c)[0])) for c in range(num_classes)]
  parts = []
  for k in range(num_clients):
    majors = set(rng.choice(num_classes, num_major, replace=False).tolist())
    chosen = []
    for c in range(num_classes):
      count = major_count if c in majors else minor_count
      if len(pools[c]) < count:
        raise ValueError(f'step partition: class {c} runs out of examples at client {k}; '
                         f'use fewer clients or smaller counts')
      chosen.extend(pools[c][:count])
      del pools[c][:count]
    parts.append(np.sort(np.array(chosen, dtype=np.int64)))
  return parts


def natural(groups: np.ndarray, num_clients: int, rng: np.random.Generator
            ) -> List[np.ndarray]:
  """The natural split (LEAF's writers as clients): ``num_clients`` groups of ``groups``
  [M] (each example's writer) drawn without replacement, each client all of its
  writer's examples; every writer when ``num_clients`` is their number."""
  writers = np.unique(groups)
  if not 1 <= num_clients <= len(writers):
    raise ValueError(f'config.data.num_clients={num_clients}: the source has '
                     f'{len(writers)} writers')
  chosen = np.sort(rng.choice(writers, num_clients, replace=False))
  order = np.argsort(groups, kind='stable')
  starts = np.searchsorted(groups[order], chosen)
  ends = np.searchsorted(groups[order], chosen, side='right')
  return [np.sort(order[a:b]) for a, b in zip(starts, ends)]


def check_disjoint(parts: List[np.ndarray]) -> None:
  """Raises if any example is assigned to two clients."""
  allidx = np.concatenate(parts) if parts else np.zeros(0, int)
  if len(np.unique(allidx)) != len(allidx):
    raise ValueError('partition assigns an example to more than one client')
