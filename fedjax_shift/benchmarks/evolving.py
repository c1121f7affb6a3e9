"""Evolving distribution shifts (FedEvolve, fedevolve.txt Sec. 5.1; REFERENCE.md).

A sequence of M + 1 domains S_1 … S_{M+1} whose distribution drifts in one
direction; the first M are the source domains every client trains on, in time
order, and S_{M+1} is the future target domain each client is tested on.

Layout: the 'train' split holds each client's source data in domain-major blocks,
x [K, M·n, ...] where block m (positions m·n … m·n + n − 1) is domain m+1, padded
and masked inside each block; ``info['num_domains'] = M`` and
``info['domain_size'] = n`` tell methods (FedEvolve, FedEvp) where the blocks are.
'test' holds each client's examples of the target domain. Every other method sees
ordinary FederatedData.

Label heterogeneity: each client draws one class-proportion vector from
Dirichlet(α) (α = inf: IID) and keeps it in every domain, so a client's label
distribution is fixed while its input distribution evolves.

* ``rotated_digits``: the embedded real MNIST digits split into M + 1 equal random
  domains, domain m rotated by m·step degrees (RMNIST: 12 domains 0°–165°, step 15°).
* ``circle``: 30 domains × 100 points on a half circle (CIDA), label radius > 5.
"""
from __future__ import annotations

from typing import List, Tuple

import ml_collections
import numpy as np

from fedjax_shift.benchmarks import BENCHMARKS, Benchmark, load_source
from fedjax_shift.data import sources
from fedjax_shift.data.federated import FederatedData, stack_clients


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


def rotation_angles(num_domains: int, step: float) -> List[float]:
  if num_domains < 2:
    raise ValueError(f'config.data.num_domains: need >= 2 (sources + the target), got '
                     f'{num_domains}')
  return [m * step for m in range(num_domains)]


@BENCHMARKS.register('rotated_digits')
def rotated_digits(data_config: ml_collections.ConfigDict, seed: int) -> Benchmark:
  """RMNIST (FedEvolve Sec. 5.1): ``num_domains`` domains rotated 0, step, 2·step …
  degrees; the last is the target. REMNIST: a TFDS emnist/letters source, step 8."""
  rng = np.random.default_rng([seed, 11])
  src = load_source(data_config)
  angles = rotation_angles(data_config.num_domains, data_config.rotation_step)
  order = rng.permutation(len(src.y))
  pieces = np.array_split(order, len(angles))
  domains_x = [sources.rotate(src.x[p], angle) for p, angle in zip(pieces, angles)]
  domains_y = [src.y[p] for p in pieces]
  train, test, size = domain_blocks(domains_x, domains_y, data_config.num_clients,
                                    src.num_classes, data_config.dirichlet_alpha, rng)
  info = {'source': data_config.source, 'angles': angles, 'num_domains': len(angles) - 1,
          'domain_size': size, 'target_angle': angles[-1]}
  return Benchmark({'train': train, 'test': test}, src.num_classes, tuple(src.x.shape[1:]),
                   info)


@BENCHMARKS.register('circle')
def circle(data_config: ml_collections.ConfigDict, seed: int) -> Benchmark:
  """Circle (CIDA; FedEvolve Table 3): 30 domains × 100 points, last domain = target."""
  rng = np.random.default_rng([seed, 13])
  x, y = sources.circle(data_config.num_domains, data_config.points_per_domain, seed)
  train, test, size = domain_blocks(list(x), list(y), data_config.num_clients, 2,
                                    data_config.dirichlet_alpha, rng)
  info = {'source': 'circle', 'num_domains': len(x) - 1, 'domain_size': size}
  return Benchmark({'train': train, 'test': test}, 2, (2,), info)
