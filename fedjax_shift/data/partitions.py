"""Label-skew partitions: which example goes to which client.

Each function takes labels [M] and a numpy Generator and returns a list of K index
arrays. Dirichlet and pathological assign every example exactly once; the step
partition draws a fixed number per class and per client without replacement.
"""
from __future__ import annotations

import math
from typing import List

import numpy as np


MIN_EXAMPLES_RULES = ('redraw', 'top_up')


def dirichlet(labels: np.ndarray, num_clients: int, alpha: float,
              rng: np.random.Generator, min_examples: int = 2, rule: str = 'redraw',
              max_tries: int = 1000) -> List[np.ndarray]:
  """Dirichlet(α) label skew (Hsu et al. 2019), as used by FedTHE/FedEvolve.

  For each class, its examples are split over clients with proportions drawn from
  Dir(α·1_K). α = inf gives a uniform (IID) split. Every client gets at least
  ``min_examples``: ``rule='redraw'`` draws again until a draw gives them (the
  partitioners of the papers' code; at most ``max_tries`` draws), ``'top_up'`` by
  construction from one draw (``top_up``: clients left short take random examples from
  the largest). A draw is vectorised over clients: 100,000 clients take seconds.
  """
  if not alpha > 0:
    raise ValueError(f'dirichlet alpha must be > 0, got {alpha}')
  if num_clients < 1:
    raise ValueError(f'num_clients must be >= 1, got {num_clients}')
  if rule not in MIN_EXAMPLES_RULES:
    raise ValueError(f'unknown minimum rule {rule!r}; choose from {list(MIN_EXAMPLES_RULES)}')
  labels = np.asarray(labels)
  if len(labels) < num_clients * min_examples:
    raise ValueError(f'{len(labels)} examples cannot give {num_clients} clients '
                     f'at least {min_examples} each')
  if math.isinf(alpha):
    order = rng.permutation(len(labels))
    return [np.sort(part) for part in np.array_split(order, num_clients)]
  classes = np.unique(labels)
  for _ in range(max_tries if rule == 'redraw' else 1):
    owner = np.empty(len(labels), np.int64)
    for c in classes:
      idx = rng.permutation(np.nonzero(labels == c)[0])
      proportions = rng.dirichlet(np.full(num_clients, alpha))
      cuts = (np.cumsum(proportions) * len(idx)).astype(int)[:-1]
      owner[idx] = np.repeat(np.arange(num_clients), np.diff(cuts, prepend=0,
                                                              append=len(idx)))
    if rule == 'top_up':
      owner = top_up(owner, num_clients, min_examples, rng)
    if np.bincount(owner, minlength=num_clients).min() >= min_examples:
      return clients_of(owner, num_clients)
  raise ValueError(f'dirichlet alpha={alpha}: no partition of {len(labels)} examples over '
                   f'{num_clients} clients with >= {min_examples} examples per client in '
                   f'{max_tries} draws; lower config.data.min_examples_per_client, or set '
                   f"config.data.min_examples_rule='top_up' to meet it by construction")


def clients_of(owner: np.ndarray, num_clients: int) -> List[np.ndarray]:
  """K ascending index arrays from each example's client ``owner`` [M]."""
  order = np.argsort(owner, kind='stable')
  return np.split(order, np.cumsum(np.bincount(owner, minlength=num_clients))[:-1])


def top_up(owner: np.ndarray, num_clients: int, min_examples: int,
           rng: np.random.Generator) -> np.ndarray:
  """``owner`` [M] with every client holding at least ``min_examples``: the missing
  examples are taken at random from the largest clients (levelled down together, never
  below ``min_examples``) and dealt to the clients short of it. Unchanged when no
  client is short (no draw from ``rng`` then)."""
  counts = np.bincount(owner, minlength=num_clients)
  short = np.maximum(min_examples - counts, 0)
  need = int(short.sum())
  if need == 0:
    return owner
  # The highest level t whose surplus above it covers the need: each client above t+1
  # gives down to t+1, then the first clients at t+1 one more each, until ``need``.
  surplus = lambda level: int(np.maximum(counts - level, 0).sum())
  low, high = min_examples, int(counts.max())
  while low < high:
    mid = (low + high + 1) // 2
    low, high = (mid, high) if surplus(mid) >= need else (low, mid - 1)
  give = np.maximum(counts - (low + 1), 0)
  at_level = np.flatnonzero(counts >= low + 1)
  give[at_level[:need - int(give.sum())]] += 1
  owner = owner.copy()
  taken = np.concatenate([rng.choice(part, int(n), replace=False)
                          for part, n in zip(clients_of(owner, num_clients), give) if n])
  owner[taken] = np.repeat(np.arange(num_clients), short)
  return owner


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


def label_shifted_order(labels: np.ndarray, concentration: float, rng: np.random.Generator,
                        num_slots: int = 0) -> np.ndarray:
  """A non-i.i.d. test stream in time: a permutation [M] of the examples (RoTTA's
  temporally correlated stream, Yuan et al., CVPR 2023, Sec. 5.1; the authors'
  ``LabelDirichletDomainSequence``). Time is cut into ``num_slots`` slots (0: one per
  class); each class's examples, in their given order, are shared over the slots with
  proportions drawn from Dir(``concentration`` · 1), and a slot lists its classes'
  shares one class after another, in an order drawn for that slot. RoTTA's γ = 0.1
  gives slots of nearly one class each; a large concentration, balanced slots."""
  if not concentration > 0:
    raise ValueError(f'the stream\'s Dirichlet concentration must be > 0, got {concentration}')
  labels = np.asarray(labels)
  classes = np.unique(labels)
  num_slots = num_slots or len(classes)
  slots: List[List[np.ndarray]] = [[] for _ in range(num_slots)]
  for c, shares in zip(classes, rng.dirichlet(np.full(num_slots, concentration),
                                              len(classes))):
    members = np.nonzero(labels == c)[0]
    cuts = (np.cumsum(shares)[:-1] * len(members)).astype(int)
    for slot, part in zip(slots, np.split(members, cuts)):
      slot.append(part)
  return np.concatenate([np.concatenate([slot[i] for i in rng.permutation(len(slot))])
                         for slot in slots]).astype(np.int64)


def check_disjoint(parts: List[np.ndarray]) -> None:
  """Raises if any example is assigned to two clients."""
  allidx = np.concatenate(parts) if parts else np.zeros(0, int)
  if len(np.unique(allidx)) != len(allidx):
    raise ValueError('partition assigns an example to more than one client')
