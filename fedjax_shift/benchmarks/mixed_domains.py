"""Intra-client heterogeneity from offline digit domains (FedIns Sec. 4.1, Table 1).

Every client holds a mixture of domains (data/digit_domains.py: mnist, uci, mnistm,
synth, and svhn / folder:<name> where the user has them): client k's domain
proportions are drawn from Dirichlet(``domain_alpha``) over ``data.domains`` (small α:
a few dominant domains; large α: an even mix), then ``client_sizes[k]`` training and
``test_examples`` test examples are drawn from those domains' pools without
replacement, so no example is in two clients or two splits. The default client sizes
are FedIns' CIFAR-100 clients (123, 209, 168, 222, 278 images: the paper's small
clients); ``data.num_clients`` is not read (the clients are ``client_sizes``).

Splits: 'train', 'test' (each client's own mixture) and 'test_<domain>' (client k's
test examples of that domain only, empty for clients without it: the per-domain
columns of the intra-client picture).
"""
from __future__ import annotations

import ml_collections
import numpy as np

from fedjax_shift.benchmarks.base import BENCHMARKS, Benchmark
from fedjax_shift.benchmarks.digit_domains import load_domains
from fedjax_shift.data import digit_domains
from fedjax_shift.data.federated import stack_clients
from fedjax_shift.registry import require


def check(data_config: ml_collections.ConfigDict) -> None:
  domains = tuple(data_config.domains)
  require(len(domains) >= 2 and len(set(domains)) == len(domains), 'data.domains',
          f'need at least two distinct domains, got {domains}')
  for name in domains:
    require(name in digit_domains.DOMAINS or name.startswith('folder:'), 'data.domains',
            f'unknown digit domain {name!r}; choose from {list(digit_domains.DOMAINS)} or '
            f'folder:<name>')
  sizes = tuple(data_config.client_sizes)
  require(len(sizes) >= 1 and all(int(s) >= 1 for s in sizes), 'data.client_sizes',
          f'need one or more positive client sizes, got {sizes}')
  require(data_config.domain_alpha > 0, 'data.domain_alpha',
          f'must be > 0, got {data_config.domain_alpha}')
  require(data_config.test_examples >= 1, 'data.test_examples',
          f'must be >= 1, got {data_config.test_examples}')


def draw_counts(proportions: np.ndarray, total: int, rng: np.random.Generator) -> np.ndarray:
  """Multinomial counts of ``total`` examples over the domains."""
  return rng.multinomial(total, proportions)


@BENCHMARKS.register('mixed_domains', defaults={
    'domains': ('mnist', 'uci', 'mnistm', 'synth'),   # as digit_domains
    'domain_examples': 1500,                          # as digit_domains
    'client_sizes': (123, 209, 168, 222, 278),        # FedIns Sec. 4.1 (CIFAR-100 clients)
    'domain_alpha': 1.0,                              # Dirichlet over domains per client
    'test_examples': 100,                             # per client, from its own mixture
}, check=check, pipelines=('federated',))
def mixed_domains(data_config: ml_collections.ConfigDict, seed: int) -> Benchmark:
  """See the module docstring. ``info['client_domain_counts']``: [K][domain] train counts."""
  rng = np.random.default_rng([seed, 0])
  domains = load_domains(data_config, seed)
  names = list(domains)
  sizes = [int(s) for s in data_config.client_sizes]
  orders = {name: list(rng.permutation(len(src.y))) for name, src in domains.items()}
  proportions = rng.dirichlet(np.full(len(names), float(data_config.domain_alpha)), len(sizes))
  splits = {'train': ([], [], []), 'test': ([], [], [])}
  counts_per_client = []
  for k, size in enumerate(sizes):
    for split, total in (('train', size), ('test', int(data_config.test_examples))):
      counts = draw_counts(proportions[k], total, rng)
      xs, ys, ds = [], [], []
      for d, (name, count) in enumerate(zip(names, counts)):
        if count > len(orders[name]):
          raise ValueError(
              f'config.data.domain_examples: domain {name!r} has {len(domains[name].y)} '
              f'examples, too few for the clients\' draws (client {k} {split} needs {count} '
              f'more); raise data.domain_examples or lower data.client_sizes / test_examples')
        take = [orders[name].pop() for _ in range(count)]
        xs.append(domains[name].x[take])
        ys.append(domains[name].y[take])
        ds.append(np.full(count, d))
      if split == 'train':
        counts_per_client.append(counts.tolist())
      for bucket, part in zip(splits[split], (xs, ys, ds)):
        bucket.append(np.concatenate(part))
  shape = (digit_domains.SIZE, digit_domains.SIZE, 3)
  out = {split: stack_clients(xs, ys, example_shape=shape)
         for split, (xs, ys, _) in splits.items()}
  test_x, test_y, test_d = splits['test']
  for d, name in enumerate(names):
    out[f'test_{name}'] = stack_clients([x[dom == d] for x, dom in zip(test_x, test_d)],
                                        [y[dom == d] for y, dom in zip(test_y, test_d)],
                                        pad_to=out['test'].max_examples, example_shape=shape)
  info = {'domains': names, 'client_domain_counts': counts_per_client,
          'domain_proportions': proportions.round(4).tolist()}
  return Benchmark(out, 10, shape, info)
