"""Evolving distribution shifts (FedEvolve, Sec. 5.1).

A sequence of M + 1 domains S_1 … S_{M+1} whose distribution drifts in one
direction; the first M are the source domains every client trains on, in time
order, and S_{M+1} is the future target domain each client is tested on.

Layout: the 'train' split holds each client's source data in domain-major blocks,
x [K, M·n, ...] where block m (positions m·n … m·n + n − 1) is domain m+1, padded
and masked inside each block; ``info['num_domains'] = M`` and
``info['domain_size'] = n`` tell methods (FedEvolve, FedEvp) where the blocks are.
'test' holds each client's examples of the target domain. Every other method sees
ordinary FederatedData.

Label heterogeneity (the standard per-class split): for each class, the shares of
its examples that the K clients get are drawn once from Dirichlet(α) over the clients
(α = inf: equal shares) and used in every domain, so a client's label mix stays fixed
while its input distribution evolves.

* ``rotated_digits``: the embedded real MNIST digits split into M + 1 equal random
  domains, domain m rotated by m·step degrees (RMNIST: 12 domains 0°–165°, step 15°).
* ``circle``: 30 Gaussian domains of 1,000 points along a half circle of radius 10,
  label inside the circle (FedEvolve App. C.2; ``circle_generator='annulus'``: the
  earlier uniform annulus, label radius > 5).
* ``timed_images``: Portraits or Caltran read from a user folder
  (``sources.timed_image_folder``), one domain per time bin (``TIMED_SOURCES``).
"""
from __future__ import annotations

import logging
from typing import List, Tuple

import ml_collections
import numpy as np

from fedjax_shift.benchmarks.base import (BENCHMARKS, Benchmark, check_dirichlet, check_source,
                                          load_source)
from fedjax_shift.data import sources
from fedjax_shift.data.federated import FederatedData, stack_clients
from fedjax_shift.registry import NONNEGATIVE_INT, POSITIVE_INT, interval, one_of, require

log = logging.getLogger('fedjax_shift')


def client_proportions(num_clients: int, num_classes: int, alpha: float,
                       rng: np.random.Generator) -> np.ndarray:
  """[C, K]: for each class, the share of its examples each client gets."""
  if not alpha > 0:
    raise ValueError(f'config.data.dirichlet_alpha: must be > 0 (or inf), got {alpha}')
  if alpha == float('inf'):
    return np.full((num_classes, num_clients), 1.0 / num_clients)
  return rng.dirichlet(np.full(num_clients, alpha), size=num_classes)


def split_domain(labels: np.ndarray, proportions: np.ndarray, rng: np.random.Generator
                 ) -> List[np.ndarray]:
  """Indices of one domain's examples for each client (each example once)."""
  num_classes, num_clients = proportions.shape
  parts = [[] for _ in range(num_clients)]
  for c in range(num_classes):
    idx = rng.permutation(np.nonzero(labels == c)[0])
    cuts = (np.cumsum(proportions[c])[:-1] * len(idx)).round().astype(int)
    for k, piece in enumerate(np.split(idx, cuts)):
      parts[k].extend(piece.tolist())
  return [np.asarray(sorted(p), dtype=np.int64) for p in parts]


def absent_from_last_source(domains_y: List[np.ndarray], num_classes: int) -> List[int]:
  """Classes of the target domain with no example in the last source domain S_M at
  any client. FedEvolve predicts with prototypes of S_M: such a class has no
  prototype, is marked absent (prototypes.py) and is never predicted — its target
  examples count as errors, never as a NaN prototype. Logged as a warning."""
  absent = sorted(set(np.unique(domains_y[-1]).tolist()) -
                  set(np.unique(domains_y[-2]).tolist()))
  if absent:
    log.warning('classes %s of the target domain have no example in the last source domain '
                '(S_M) at any client: FedEvolve has no prototype for them and never predicts '
                'them (of %d classes)', absent, num_classes)
  return absent


def domain_blocks(domains_x: List[np.ndarray], domains_y: List[np.ndarray], num_clients: int,
                  num_classes: int, alpha: float, rng: np.random.Generator
                  ) -> Tuple[FederatedData, FederatedData, int]:
  """(train over source domains in domain-major blocks, test = last domain, n)."""
  if len(domains_x) < 2:
    raise ValueError(f'an evolving benchmark needs at least one source domain and one '
                     f'target domain; got {len(domains_x)} domain(s)')
  smallest = min(len(y) for y in domains_y)
  if num_clients > smallest:
    raise ValueError(f'config.data.num_clients={num_clients} exceeds the {smallest} examples of '
                     f'the smallest domain: every client could not hold data of every domain')
  proportions = client_proportions(num_clients, num_classes, alpha, rng)
  per_domain = [split_domain(y, proportions, rng) for y in domains_y]
  for m, parts in enumerate(per_domain[:-1]):
    empty = [k for k, p in enumerate(parts) if not len(p)]
    if len(empty) == num_clients:
      raise ValueError(f'source domain {m} has no examples at any client')
  example_shape = domains_x[0].shape[1:]
  size = max(1, max(len(p) for parts in per_domain[:-1] for p in parts))
  blocks_x = np.zeros((num_clients, (len(domains_x) - 1) * size) + example_shape, np.float32)
  blocks_y = np.zeros((num_clients, (len(domains_x) - 1) * size), np.int32)
  mask = np.zeros(blocks_y.shape, bool)
  for m, parts in enumerate(per_domain[:-1]):
    for k, idx in enumerate(parts):
      start = m * size
      blocks_x[k, start:start + len(idx)] = domains_x[m][idx]
      blocks_y[k, start:start + len(idx)] = domains_y[m][idx]
      mask[k, start:start + len(idx)] = True
  train = FederatedData(blocks_x, blocks_y, mask, mask.sum(1).astype(np.int32))
  test_parts = per_domain[-1]
  test = stack_clients([domains_x[-1][p] for p in test_parts],
                       [domains_y[-1][p] for p in test_parts], example_shape=example_shape)
  return train, test, size


def rotation_angles(num_domains: int, step: float, start: float = 0.0) -> List[float]:
  """start, start + step, …: one angle per domain, the last is the target's."""
  if num_domains < 2:
    raise ValueError(f'config.data.num_domains: need >= 2 (sources + the target), got '
                     f'{num_domains}')
  return [start + m * step for m in range(num_domains)]


# The evolving benchmarks' own fields (RMNIST's values; variants set the rest).
EVOLVING_DEFAULTS = {
    'num_domains': 12,                # M + 1 domains, the last is the target (RMNIST: 12)
    'rotation_step': 15.0,            # RMNIST: 0°, 15°, …, 165° (REMNIST: step 8°)
    'rotation_start': 0.0,            # the first domain's angle
}
EVOLVING_RANGES = {
    'num_domains': interval(2, integer=True),   # at least one source and the target
    'rotation_step': interval(),                # degrees, either direction
    'rotation_start': interval(),
}


def check_domains(data_config: ml_collections.ConfigDict) -> None:
  check_dirichlet(data_config)
  require(data_config.num_clients >= 1, 'data.num_clients',
          f'must be >= 1, got {data_config.num_clients}')


def check_rotated(data_config: ml_collections.ConfigDict) -> None:
  check_source(data_config)
  check_domains(data_config)
  split = data_config.split_domains
  require(split == 0 or split >= data_config.num_domains, 'data.split_domains',
          f'0 (split the digits into data.num_domains={data_config.num_domains}) or at least '
          f'data.num_domains (the first ones dropped), got {split}')


@BENCHMARKS.register('rotated_digits', defaults={
    **EVOLVING_DEFAULTS,
    'target_offset': 0.0,     # degrees added to the target's rotation only (Table 13)
    # 0: the digits are split into num_domains equal domains; N >= num_domains: split
    # into N equal domains as for N, the first N − num_domains dropped (Tables 5 / 9:
    # fewer domains at the same per-domain size)
    'split_domains': 0,
}, ranges={**EVOLVING_RANGES, 'target_offset': interval(),
           'split_domains': NONNEGATIVE_INT},   # and 0 or >= num_domains (check)
    check=check_rotated, pipelines=('federated',))
def rotated_digits(data_config: ml_collections.ConfigDict, seed: int) -> Benchmark:
  """RMNIST (FedEvolve Sec. 5.1): ``num_domains`` domains rotated 0, step, 2·step …
  degrees; the last is the target, rotated ``target_offset`` degrees further (App.
  Table 13: an unexpected target, off the schedule). REMNIST: a TFDS emnist/letters
  source, step 8. ``split_domains`` = N > 0 splits the digits as for N domains and
  keeps the last ``num_domains`` pieces (with N = 12, RMNIST's split minus its first
  domains)."""
  rng = np.random.default_rng([seed, 11])
  src = load_source(data_config)
  angles = rotation_angles(data_config.num_domains, data_config.rotation_step,
                           data_config.rotation_start)
  angles[-1] += data_config.target_offset
  order = rng.permutation(len(src.y))
  pieces = np.array_split(order, data_config.split_domains or len(angles))[-len(angles):]
  domains_x = [sources.rotate(src.x[p], angle) for p, angle in zip(pieces, angles)]
  domains_y = [src.y[p] for p in pieces]
  train, test, size = domain_blocks(domains_x, domains_y, data_config.num_clients,
                                    src.num_classes, data_config.dirichlet_alpha, rng)
  info = {'source': data_config.source, 'angles': angles, 'num_domains': len(angles) - 1,
          'domain_size': size, 'target_angle': angles[-1],
          'classes_absent_from_last_source': absent_from_last_source(domains_y,
                                                                     src.num_classes)}
  return Benchmark({'train': train, 'test': test}, src.num_classes, tuple(src.x.shape[1:]),
                   info)


def check_circle(data_config: ml_collections.ConfigDict) -> None:
  require(data_config.source == 'circle', 'data.source',
          f"the circle benchmark generates its data: set 'circle', got {data_config.source!r}")
  check_domains(data_config)
  require(data_config.points_per_domain >= data_config.num_clients, 'data.points_per_domain',
          f'each domain is dealt to data.num_clients={data_config.num_clients} clients: need '
          f'at least that many points, got {data_config.points_per_domain}')


@BENCHMARKS.register('circle', defaults={
    **EVOLVING_DEFAULTS,
    'points_per_domain': 1000,        # App. C.2: 30,000 instances over 30 domains
    'circle_generator': 'gaussian',   # App. C.2's Gaussians; 'annulus': the earlier one
}, ranges={**EVOLVING_RANGES,
           'points_per_domain': POSITIVE_INT,   # and >= data.num_clients (check)
           'circle_generator': one_of(*sources.CIRCLE_GENERATORS)},
    check=check_circle, pipelines=('federated',))
def circle(data_config: ml_collections.ConfigDict, seed: int) -> Benchmark:
  """Circle (FedEvolve Table 3, App. C.2): ``num_domains`` domains of
  ``points_per_domain`` points (``sources.circle``), the last domain the target."""
  rng = np.random.default_rng([seed, 13])
  x, y = sources.circle(data_config.num_domains, data_config.points_per_domain, seed,
                        data_config.circle_generator)
  train, test, size = domain_blocks(list(x), list(y), data_config.num_clients, 2,
                                    data_config.dirichlet_alpha, rng)
  info = {'source': 'circle', 'num_domains': len(x) - 1, 'domain_size': size,
          'classes_absent_from_last_source': absent_from_last_source(list(y), 2)}
  return Benchmark({'train': train, 'test': test}, 2, (2,), info)


def portraits_domain(stamp: dict, num_domains: int) -> int:
  """Portraits (FedEvolve App. C.3): 12-year bins from 1905; 2013 joins the last."""
  if stamp['year'] < 1905:
    raise ValueError(f"Portraits: year {stamp['year']} precedes 1905, the first bin")
  return min((stamp['year'] - 1905) // 12, num_domains - 1)


def caltran_domain(stamp: dict, num_domains: int) -> int:
  """Caltran (App. C.4): the day split into ``num_domains`` equal blocks by capture
  hour (12 domains = 2-hour blocks, 22:00–24:00 the target)."""
  if 24 % num_domains:
    raise ValueError(f'Caltran: num_domains must divide 24 hours, got {num_domains}')
  return stamp['hour'] // (24 // num_domains)


# source: (file-name format, channels, default image size, domain of a stamp)
TIMED_SOURCES = {
    'portraits': ('year', 1, 32, portraits_domain),     # 32×32 grey, gender
    'caltran': ('datetime', 3, 224, caltran_domain),    # 3×224×224
}


def check_timed(data_config: ml_collections.ConfigDict) -> None:
  source = data_config.source
  require(source in TIMED_SOURCES, 'data.source',
          f'timed_images reads {sorted(TIMED_SOURCES)}, got {source!r}')
  require(bool(data_config.data_dir), 'data.data_dir',
          f'{source} is not shipped with any package: pass the folder of its images '
          f'(<class>/<file> with the capture time in the name; see '
          f'fedjax_shift/data/sources.py TIMESTAMP_FORMATS)')
  check_domains(data_config)


@BENCHMARKS.register('timed_images', defaults=EVOLVING_DEFAULTS, ranges=EVOLVING_RANGES,
                     check=check_timed, pipelines=('federated',))
def timed_images(data_config: ml_collections.ConfigDict, seed: int) -> Benchmark:
  """Portraits / Caltran (FedEvolve Table 3) from ``data_config.data_dir``: images
  binned into ``num_domains`` time domains in order, the last is the target."""
  if data_config.source not in TIMED_SOURCES:
    raise ValueError(f'data.source: timed_images reads {sorted(TIMED_SOURCES)}, got '
                     f'{data_config.source!r}')
  timestamp, channels, default_size, domain_of = TIMED_SOURCES[data_config.source]
  images = sources.timed_image_folder(data_config.data_dir, timestamp,
                                      data_config.image_size or default_size, channels)
  num_domains = data_config.num_domains
  domain = np.asarray([domain_of(stamp, num_domains) for stamp in images.stamps])
  counts = np.bincount(domain, minlength=num_domains)
  if not counts.all():
    raise ValueError(f'{data_config.source} in {data_config.data_dir!r}: time domains '
                     f'{np.nonzero(counts == 0)[0].tolist()} of {num_domains} hold no images '
                     f'(images per domain: {counts.tolist()})')
  rng = np.random.default_rng([seed, 17])
  train, test, size = domain_blocks([images.x[domain == m] for m in range(num_domains)],
                                    [images.y[domain == m] for m in range(num_domains)],
                                    data_config.num_clients, len(images.class_names),
                                    data_config.dirichlet_alpha, rng)
  info = {'source': data_config.source, 'num_domains': num_domains - 1, 'domain_size': size,
          'images_per_domain': counts.tolist(), 'class_names': list(images.class_names),
          'classes_absent_from_last_source': absent_from_last_source(
              [images.y[domain == m] for m in (num_domains - 2, num_domains - 1)],
              len(images.class_names))}
  return Benchmark({'train': train, 'test': test}, len(images.class_names),
                   tuple(images.x.shape[1:]), info)
