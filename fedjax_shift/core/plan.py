"""The round's plan for a population's client sizes, computed on the host before
compiling: how many local steps each client takes (``population_steps``), the cohorts a
round is likely to draw (``simulate_cohorts``), how wide the vmapped groups of the
sorted cohort are (``fit_client_chunk``), and the few
padded sizes clients are cut to (``group_bounds``, ``likely_group_bounds``,
``fit_example_buckets``, ``plan_group_examples``), so that a round scans about the
steps its clients really take instead of every client to the population's largest.
"""
from __future__ import annotations

from typing import Tuple

import numpy as np

from fedjax_shift.core.local import LocalSchedule


def population_steps(schedule: LocalSchedule, num_examples: np.ndarray) -> np.ndarray:
  """[K] local steps of each client of a population under ``schedule`` (host numpy;
  ``client_num_steps`` without straggler budgets)."""
  num_examples = np.asarray(num_examples, np.int64)
  if schedule.num_steps > 0:
    steps = np.full_like(num_examples, schedule.num_steps)
  else:
    steps = -(-schedule.num_epochs * num_examples // schedule.batch_size)
  return np.where(num_examples > 0, steps, 0)


def simulate_cohorts(num_examples: np.ndarray, cohort_size: int, sampling: str = 'uniform',
                     draws: int = 1024, seed: int = 0) -> np.ndarray:
  """[draws, C] client sizes of ``draws`` cohorts of C drawn from ``num_examples`` [K] as
  ``core/round.sample_cohort`` draws them (``sampling``: 'uniform', or 'num_examples'
  for probability ∝ size; the top C of K random keys), each sorted most first; a fixed
  ``seed``, so that a plan is a function of the population. With C ≥ K the cohort is
  the population: [1, K]."""
  sizes = np.asarray(num_examples, np.int64)
  clients = sizes.size
  if clients == 0 or cohort_size < 1:
    raise ValueError(f'a cohort needs a population and a size; got {clients} clients and '
                     f'cohort_size={cohort_size}')
  if cohort_size >= clients:
    return np.sort(sizes)[::-1][None, :]
  rng = np.random.default_rng(seed)
  log_probs = None
  if sampling == 'num_examples':
    with np.errstate(divide='ignore'):
      log_probs = np.log(sizes / max(sizes.sum(), 1))
  cohorts = []
  batch = max(1, min(draws, 2 ** 21 // clients))   # 16 MB of keys at a time
  for done in range(0, draws, batch):
    scores = rng.random((min(batch, draws - done), clients))
    if log_probs is not None:   # Gumbel keys: the top C are a draw ∝ size
      scores = log_probs - np.log(-np.log(np.maximum(scores, 1e-300)))
    drawn = np.argpartition(-scores, cohort_size - 1, axis=1)[:, :cohort_size]
    cohorts.append(-np.sort(-sizes[drawn], axis=1))
  return np.concatenate(cohorts)


# config.engine.max_scanned's default: the widest groups whose scanned local steps stay
# within 1.2 × the real ones.
MAX_SCANNED = 1.2


def fit_client_chunk(cohort_steps: np.ndarray, max_scanned: float = MAX_SCANNED,
                     multiple: int = 1) -> int:
  """The widest group ``RoundConfig.client_chunk`` (0: the whole cohort) whose
  expected scanned steps stay within ``max_scanned`` × the real ones.

  cohort_steps: [D, C] local steps of the clients of D likely cohorts, each sorted
  most first (``simulate_cohorts``; [C]: one cohort). Scanned steps of a width c: Σ
  over groups of c × the group's largest count, averaged over the cohorts; widths are
  multiples of ``multiple`` (the devices of a client mesh). Fewer, wider groups cost
  fewer loop iterations; narrower ones waste fewer steps.
  """
  cohorts = np.atleast_2d(np.asarray(cohort_steps, np.int64))
  cohort_size = cohorts.shape[1]
  if cohorts.size == 0:
    raise ValueError('fit_client_chunk needs a cohort of at least one client')
  real = max(float(cohorts.sum(1).mean()), 1.0)
  for width in range(cohort_size, 0, -1):
    if width % multiple and width != cohort_size:
      continue
    scanned = width * float(cohorts[:, ::width].sum(1).mean())
    if scanned <= max_scanned * real:
      return 0 if width >= cohort_size else width
  return multiple if multiple < cohort_size else 0


def check_example_buckets(buckets, largest: int, field: str = 'example_buckets') -> None:
  """Refuses a bucket list that is empty, not strictly ascending, non-positive, or
  whose last bucket cannot hold the ``largest`` client, naming ``field``."""
  buckets = tuple(int(b) for b in buckets)
  if not buckets:
    raise ValueError(f'{field} is empty: give ascending padded sizes, the last >= the '
                     f'largest client ({largest})')
  if min(buckets) < 1:
    raise ValueError(f'{field}={buckets}: every bucket must be a positive example count')
  if any(low >= high for low, high in zip(buckets, buckets[1:])):
    raise ValueError(f'{field}={buckets} must be strictly ascending')
  if buckets[-1] < largest:
    raise ValueError(f'{field}={buckets}: the last bucket must hold the largest client '
                     f'({largest} examples)')


def group_bounds(num_examples: np.ndarray, cohort_size: int, width: int) -> np.ndarray:
  """[ceil(C/width)] the most examples a client of each group of a cohort sorted by
  examples (most first) can hold: group g starts at the cohort's (g·width)-th largest
  client, and a cohort of C clients drawn from the population ``num_examples`` [K]
  has no (g·width)-th largest client larger than the population's (g·width)-th
  largest."""
  sizes = np.sort(np.asarray(num_examples, np.int64))[::-1]
  starts = np.arange(0, cohort_size, width)
  return np.maximum(sizes[np.minimum(starts, sizes.size - 1)], 1)


def likely_group_bounds(cohorts: np.ndarray, width: int) -> np.ndarray:
  """[ceil(C/width)] group bounds that the cohorts a round draws almost always hold: per
  group, the largest (g·width)-th largest client of the likely ``cohorts`` [D, C]
  (``simulate_cohorts``, 1,024 of them by default). A cohort that exceeds them runs
  at ``group_bounds`` (the round's fallback)."""
  return np.maximum(np.asarray(cohorts)[:, ::width].max(axis=0), 1)


def fit_example_buckets(bounds: np.ndarray, width: int, max_shapes: int = 4,
                        min_saving: float = 0.0) -> Tuple[int, ...]:
  """At most ``max_shapes`` padded sizes, ascending, for groups of ``width`` clients
  whose sizes are bounded by ``bounds`` [G] (non-increasing, ``group_bounds``): chosen
  by dynamic programming to minimise the examples a round copies, each size serving a
  run of consecutive groups at the run's first (largest) bound. Each size costs a
  compilation of the client update, so a size is added only while it saves at least
  ``min_saving`` copied examples per round."""
  bounds = [int(b) for b in bounds]
  groups = len(bounds)
  most = max(1, min(max_shapes, groups))
  # cost[j][g]: the least examples copied for groups g.. with at most j sizes.
  cost = [[float('inf')] * (groups + 1) for _ in range(most + 1)]
  choice = [[groups] * (groups + 1) for _ in range(most + 1)]
  for j in range(most + 1):
    cost[j][groups] = 0.0
  for j in range(1, most + 1):
    for g in range(groups - 1, -1, -1):
      for h in range(g + 1, groups + 1):
        total = bounds[g] * width * (h - g) + cost[j - 1][h]
        if total < cost[j][g]:
          cost[j][g], choice[j][g] = total, h
  shapes = 1
  while shapes < most and cost[shapes][0] - cost[shapes + 1][0] >= max(min_saving, 1e-9):
    shapes += 1
  sizes, g, j = [], 0, shapes
  while g < groups:
    sizes.append(bounds[g])
    g, j = choice[j][g], j - 1
  return tuple(sorted(set(sizes)))


def plan_group_examples(bounds: np.ndarray, buckets: Tuple[int, ...],
                        field: str = 'example_buckets') -> Tuple[int, ...]:
  """``RoundConfig.group_examples``: each group's bound [G] rounded up to the smallest
  of ``buckets`` (ascending, checked as ``field``) that holds it."""
  check_example_buckets(buckets, int(np.max(bounds)), field)
  ladder = np.asarray(buckets)
  return tuple(int(ladder[np.searchsorted(ladder, bound)]) for bound in bounds)
