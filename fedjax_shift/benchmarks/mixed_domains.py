"""Intra-client heterogeneity from offline digit domains (FedIns Sec. 4.1, Table 1).

Every client holds a mixture of domains (data/digit_domains.py: mnist, uci, mnistm,
synth, and svhn / folder:<name> where the user has them; or TFDS domains such as
DomainNet's, ``tfds:domainnet/real``, ``tfds:domainnet/clipart`` …, read from
``data.data_dir`` and resized to ``data.image_size``; every domain must share one label
space: digits and DomainNet do not mix): client k's domain
proportions are drawn from Dirichlet(``domain_alpha``) over ``data.domains`` (small α:
a few dominant domains; large α: an even mix), then ``client_sizes[k]`` training and
``test_examples`` test examples are drawn from those domains' pools without
replacement, so no example is in two clients or two splits. The default client sizes
are FedIns' CIFAR-100 clients (123, 209, 168, 222, 278 images: the paper's small
clients); ``data.num_clients`` is not read (the clients are ``client_sizes``).

Splits: 'train', 'test' (each client's own mixture) and 'test_<domain>' (client k's
test examples of that domain only, empty for clients without it: the per-domain
columns of the intra-client picture).

FedIns' DomainNet protocol (its authors' code, after FedBN): ``data.classes`` keeps only
those label names of TFDS domains (FedBN's 10 DomainNet classes), ``client_domains=
'one_each'`` gives client k domain k alone (one domain per client, as FedIns Table 1),
and ``test_split`` (a TFDS split, e.g. 'test') tests each client on that split of its
domains — with 'one_each' the whole split of its domain, else ``test_examples`` drawn
from its mixture — instead of on held-back training images.
"""
from __future__ import annotations

import ml_collections
import numpy as np

from fedjax_shift.benchmarks.base import BENCHMARKS, Benchmark
from fedjax_shift.benchmarks.digit_domains import DOMAIN, RESERVE, check_reserve, load_domains
from fedjax_shift.data import digit_domains, sources
from fedjax_shift.data.federated import stack_clients
from fedjax_shift.registry import (POSITIVE, POSITIVE_INT, TEXT, Range, one_of, require,
                                   require_distinct, sequence_of)


# A domain: a digit domain (digit_domains.DOMAIN) or a TFDS one (tfds:domainnet/clipart).
MIXED_DOMAIN = Range(
    f'one of {list(digit_domains.DOMAINS)}, folder:<name> or tfds:<name> with <name> in '
    f'{sorted(sources.TFDS_DATASETS)} (e.g. tfds:domainnet/clipart)',
    lambda value: DOMAIN.accepts(value) or (isinstance(value, str) and value.startswith(
        'tfds:') and value[5:].split('/')[0] in sources.TFDS_DATASETS), 'unknown')
# data.client_sizes (mixed_domains, small_clients): one or more clients' training examples.
CLIENT_SIZES = sequence_of(POSITIVE_INT, 1)


def check(data_config: ml_collections.ConfigDict) -> None:
  domains = tuple(data_config.domains)
  require_distinct(domains, 'data.domains', 'one domain')
  labels = [domain_label(name) for name in domains]
  require(len(set(labels)) == len(labels), 'data.domains',
          f'two domains share the column name: {labels}')
  tfds = [name for name in domains if name.startswith('tfds:')]
  require(not tfds or len(tfds) == len(domains), 'data.domains',
          f'digit domains and TFDS domains have different label spaces: got {domains}')
  check_reserve(data_config)
  if data_config.client_domains == 'one_each':
    require(len(tuple(data_config.client_sizes)) == len(domains), 'data.client_sizes',
            f"client_domains='one_each' gives client k domain k: need one size per domain "
            f'({len(domains)}), got {tuple(data_config.client_sizes)}')
  require(not (data_config.classes or data_config.test_split) or bool(tfds),
          'data.classes' if data_config.classes else 'data.test_split',
          'selects classes / a test split of TFDS domains (tfds:<name>); these domains are '
          f'{domains}')
  require(len(set(data_config.classes)) == len(tuple(data_config.classes)), 'data.classes',
          f'names a class twice: {tuple(data_config.classes)}')


# How a client's domains are chosen: a Dirichlet(domain_alpha) mixture, or client k = domain k.
CLIENT_DOMAINS = ('dirichlet', 'one_each')


def draw_clients(groups, proportions: np.ndarray, sizes, test_examples: int,
                 rng: np.random.Generator, field: str, group_name: str, names=()):
  """Clients drawn from ``groups`` (one array of example indices per group: a domain or
  a class) without replacement: client k takes ``sizes[k]`` train and ``test_examples``
  test indices, multinomial over the groups with ``proportions[k]``. Returns
  {split: [K arrays of indices]}, {split: [K arrays of group ids]}, train counts [K][G].
  Too few examples in a group is an error naming ``field`` and the group (``group_name``
  and its index, and its name where ``names`` gives one, e.g. a class folder)."""
  pools = [list(rng.permutation(g)) for g in groups]
  indices = {'train': [], 'test': []}
  group_ids = {'train': [], 'test': []}
  counts_per_client = []
  for k, size in enumerate(sizes):
    for split, total in (('train', int(size)), ('test', int(test_examples))):
      counts = rng.multinomial(total, proportions[k])
      if split == 'train':
        counts_per_client.append(counts.tolist())
      taken, ids = [], []
      for g, count in enumerate(counts):
        if count > len(pools[g]):
          named = f' ({names[g]!r})' if g < len(names) else ''
          raise ValueError(f'config.{field}: {group_name} {g}{named} has too few examples left for '
                           f'client {k}\'s {split} draw ({count} needed, {len(pools[g])} left); '
                           f'raise it or lower data.client_sizes / data.test_examples')
        taken += [pools[g].pop() for _ in range(count)]
        ids += [g] * int(count)
      indices[split].append(np.asarray(taken, np.int64))
      group_ids[split].append(np.asarray(ids, np.int64))
  return indices, group_ids, counts_per_client


def domain_label(name: str) -> str:
  """A domain's name in split and column names: 'tfds:domainnet/clipart' -> 'clipart',
  'folder:usps' -> 'usps', 'mnist' -> 'mnist'."""
  return name.split(':', 1)[-1].split('/')[-1]


def load_mixed(data_config: ml_collections.ConfigDict, seed: int, split: str = ''):
  """{domain: Source}: digit domains (``load_domains``) or TFDS domains (``domain_examples``
  each of ``data.classes`` from ``split``, default ``data.tfds_split``; every example of
  a given ``split``), all at ``data.image_size`` (0: 28, the digits' size)."""
  size = data_config.image_size or digit_domains.SIZE
  if not any(name.startswith('tfds:') for name in data_config.domains):
    out = load_domains(data_config, seed)
  else:
    out = {name: sources.tfds_source(name[5:], split or data_config.tfds_split,
                                     data_config.data_dir or None,
                                     None if split else data_config.domain_examples,
                                     image_size=size, classes=tuple(data_config.classes))
           for name in data_config.domains}
  return {name: src._replace(x=sources.to_channels(sources.resize_images(src.x, size, size), 3))
          for name, src in out.items()}


def pooled(domains: dict):
  """(x, y, [example indices of each domain]) of {domain: Source} concatenated."""
  names = list(domains)
  x = np.concatenate([domains[name].x for name in names])
  y = np.concatenate([domains[name].y for name in names])
  offsets = np.cumsum([0] + [len(domains[name].y) for name in names])
  return x, y, [np.arange(offsets[d], offsets[d + 1]) for d in range(len(names))]


@BENCHMARKS.register('mixed_domains', defaults={
    'domains': ('mnist', 'uci', 'mnistm', 'synth'),   # as digit_domains
    'domain_examples': 1500,                          # as digit_domains
    'client_sizes': (123, 209, 168, 222, 278),        # FedIns Sec. 4.1 (CIFAR-100 clients)
    'domain_alpha': 1.0,                              # Dirichlet over domains per client
    'test_examples': 100,                             # per client, from its own mixture
    'classes': (),                  # TFDS domains: only these label names (e.g. FedBN's 10)
    'client_domains': 'dirichlet',  # 'dirichlet' (domain_alpha) | 'one_each' (client k = domain k)
    'test_split': '',               # '': test images held back from the training pools;
                                    # a TFDS split (e.g. 'test'): tested on that split
    'backbone_reserve': 0.0,        # as digit_domains: each real domain's share kept for
                                    # the pretrained backbone, never dealt to a client
}, ranges={
    'domains': sequence_of(MIXED_DOMAIN, 2),   # distinct, one label space (check)
    'domain_examples': POSITIVE_INT,
    'client_sizes': CLIENT_SIZES,
    'domain_alpha': POSITIVE,
    'test_examples': POSITIVE_INT,
    'classes': sequence_of(TEXT),              # (): every class
    'client_domains': one_of(*CLIENT_DOMAINS),
    'test_split': TEXT,                        # '': held-back training images
    'backbone_reserve': RESERVE,
}, check=check, pipelines=('federated',))
def mixed_domains(data_config: ml_collections.ConfigDict, seed: int) -> Benchmark:
  """See the module docstring. ``info['client_domain_counts']``: [K][domain] train counts."""
  rng = np.random.default_rng([seed, 0])
  domains = load_mixed(data_config, seed)
  names = list(domains)
  x, y, groups = pooled(domains)
  sizes = tuple(data_config.client_sizes)
  if data_config.client_domains == 'one_each':
    proportions = np.eye(len(names))
  else:
    proportions = rng.dirichlet(np.full(len(names), float(data_config.domain_alpha)),
                                len(sizes))
  separate_test = bool(data_config.test_split)
  indices, domain_ids, counts = draw_clients(groups, proportions, sizes,
                                             0 if separate_test else data_config.test_examples,
                                             rng, 'data.domain_examples', 'domain')
  test_x, test_y = x, y
  if separate_test:
    test_x, test_y, test_groups = pooled(load_mixed(data_config, seed, data_config.test_split))
    if data_config.client_domains == 'one_each':   # each client: its domain's whole split
      indices['test'] = list(test_groups)
      domain_ids['test'] = [np.full(len(g), d) for d, g in enumerate(test_groups)]
    else:
      test_indices, test_ids, _ = draw_clients(test_groups, proportions, (0,) * len(sizes),
                                               data_config.test_examples, rng,
                                               'data.test_split', 'domain')
      indices['test'], domain_ids['test'] = test_indices['test'], test_ids['test']
  shape = x.shape[1:]
  arrays = {'train': (x, y), 'test': (test_x, test_y)}
  out = {split: stack_clients([arrays[split][0][i] for i in parts],
                              [arrays[split][1][i] for i in parts], example_shape=shape)
         for split, parts in indices.items()}
  for d, name in enumerate(names):
    parts = [i[ids == d] for i, ids in zip(indices['test'], domain_ids['test'])]
    out[f'test_{domain_label(name)}'] = stack_clients(
        [test_x[i] for i in parts], [test_y[i] for i in parts],
        pad_to=out['test'].max_examples, example_shape=shape)
  info = {'domains': [domain_label(name) for name in names], 'client_domain_counts': counts,
          'domain_proportions': proportions.round(4).tolist()}
  return Benchmark(out, domains[names[0]].num_classes, shape, info)
