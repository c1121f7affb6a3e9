"""A Digit-5-style multi-domain benchmark from offline data (FedICON Sec. 5.1, Tables 1,
2 and 4): every client holds one digit domain (data/digit_domains.py: mnist, uci,
mnistm, synth, svhn where TFDS has it prepared, and folder:<name> for a user's images), ``clients_per_domain`` clients per
domain sharing its examples IID, each client's examples split train / val / test by
``split_fractions``.

Covariate shift (``held_out_domain = ''``, Tables 1 and 4): each client's test split
with every example under a CIFAR-10-C corruption drawn for it from ``corruptions`` at
``severity`` ('test_corrupted'). ``info['client_groups']`` names each domain's clients, so the
federated pipeline also reports every split per domain ('test_corrupted_<domain>':
Table 1's columns) from the same per-client sums.

Domain shift (``held_out_domain = <domain>``, Table 2's leave-one-domain-out): that
domain is no client's; its examples are dealt out to the clients as their 'test'
split (so the pooled test accuracy is the held-out domain's), and 'test_own' keeps
each client's own-domain test examples.
"""
from __future__ import annotations

import math

import ml_collections
import numpy as np

from fedjax_shift.benchmarks.base import BENCHMARKS, Benchmark
from fedjax_shift.benchmarks.label_skew import (SPLIT_AND_CORRUPTION_DEFAULTS,
                                                SPLIT_AND_CORRUPTION_RANGES)
from fedjax_shift.data import corruptions, digit_domains
from fedjax_shift.data.federated import split_clients, stack_clients
from fedjax_shift.registry import (POSITIVE_INT, TEXT, Range, interval, require,
                                   require_distinct, sequence_of)


# A digit domain: one of data/digit_domains.py's, or a user's folder of digits.
DOMAIN = Range(f'one of {list(digit_domains.DOMAINS)} or folder:<name> (a user folder '
               f'<data_dir>/<name>/<digit>/: USPS and the real MNIST-M are not on PyPI or in '
               f'TFDS)', lambda value: isinstance(value, str) and (
                   value in digit_domains.DOMAINS or value.startswith('folder:')), 'unknown')
# data.backbone_reserve: a share of each real domain; 1 would leave the clients nothing.
RESERVE = interval(0, 1, high_open=True)


def check(data_config: ml_collections.ConfigDict) -> None:
  domains = tuple(data_config.domains)
  require_distinct(domains, 'data.domains', 'one domain')
  check_reserve(data_config)
  held_out = data_config.held_out_domain
  require(held_out == '' or held_out in domains, 'data.held_out_domain',
          f'must be "" (covariate shift) or one of data.domains {domains}, got {held_out!r}')
  fractions = dict(data_config.split_fractions)
  require('train' in fractions and 'test' in fractions and
          math.isclose(sum(fractions.values()), 1.0), 'data.split_fractions',
          f'need "train" and "test" splits and fractions summing to 1, got {fractions}')
  for name in data_config.corruptions:
    require(name in corruptions.ALL_CORRUPTIONS, 'data.corruptions',
            f'unknown corruption {name!r}; choose from {list(corruptions.ALL_CORRUPTIONS)}')
  require(held_out or len(data_config.corruptions) > 0, 'data.corruptions',
          'the covariate-shift benchmark (data.held_out_domain="") needs corruptions')


def check_reserve(data_config: ml_collections.ConfigDict) -> None:
  """``data.backbone_reserve`` > 0 only with digit domains that have a reserve (the
  real ones) or need none (synth, generated anew)."""
  reserve = data_config.backbone_reserve
  if reserve > 0:
    others = digit_domains.without_reserve(data_config.domains)
    require(not others, 'data.backbone_reserve',
            f'only {list(digit_domains.RESERVABLE)} are split into a backbone and a '
            f'clients\' share (synth draws new images); {others} cannot be')


def load_domains(data_config: ml_collections.ConfigDict, seed: int):
  """{domain: Source} with ``domain_examples`` each (numpy generator [seed, 43])."""
  rng = np.random.default_rng([seed, 43])
  count = data_config.domain_examples
  reserve = data_config.backbone_reserve
  out = {}
  for name in data_config.domains:
    out[name] = digit_domains.domain(name, count, rng, data_config.data_dir or None, reserve,
                                     'clients' if reserve > 0 else 'all')
  return out


@BENCHMARKS.register('digit_domains', defaults={
    'domains': ('mnist', 'uci', 'mnistm', 'synth'),   # Digit-5 without USPS and SVHN
    'domain_examples': 1500,          # examples per domain (UCI has 1,797)
    'clients_per_domain': 1,          # FedICON Table 1: 5 clients, one per domain
    'held_out_domain': '',            # '' covariate shift; a domain: leave-one-domain-out
    # A fraction of each real domain (mnist, uci, mnistm) kept for backbone pretraining
    # (pipelines/pretrain.py draws backbone.domains from it): the clients never see it.
    'backbone_reserve': 0.0,
    **SPLIT_AND_CORRUPTION_DEFAULTS,  # each client's splits, the corrupted test split's
}, ranges={
    **SPLIT_AND_CORRUPTION_RANGES,
    'domains': sequence_of(DOMAIN, 2),      # distinct (check)
    'domain_examples': interval(10, integer=True),
    'clients_per_domain': POSITIVE_INT,
    'held_out_domain': TEXT,                # '' or one of data.domains (check)
    'backbone_reserve': RESERVE,
}, check=check, pipelines=('federated',))
def digit_domains_benchmark(data_config: ml_collections.ConfigDict, seed: int) -> Benchmark:
  """See the module docstring. ``info['client_domain']`` names each client's domain."""
  rng = np.random.default_rng([seed, 0])
  domains = load_domains(data_config, seed)
  held_out = data_config.held_out_domain
  per_domain = data_config.clients_per_domain
  client_domain, xs, ys = [], [], []
  for name, src in domains.items():
    if name == held_out:
      continue
    for part in np.array_split(rng.permutation(len(src.y)), per_domain):
      client_domain.append(name)
      xs.append(src.x[part])
      ys.append(src.y[part])
  splits_xy = split_clients(xs, ys, dict(data_config.split_fractions), rng)
  shape = (digit_domains.SIZE, digit_domains.SIZE, 3)
  splits = {name: stack_clients(x, y, example_shape=shape) for name, (x, y) in splits_xy.items()}
  info = {'domains': list(domains), 'client_domain': client_domain, 'held_out_domain': held_out}
  num_clients = len(client_domain)
  if held_out:
    target = domains[held_out]
    parts = np.array_split(rng.permutation(len(target.y)), num_clients)
    splits['test_own'] = splits['test']
    splits['test'] = stack_clients([target.x[p] for p in parts], [target.y[p] for p in parts],
                                   example_shape=shape)
  else:
    names = tuple(data_config.corruptions)
    test_x, test_y = splits_xy['test']
    corrupted, chosen = [], []
    for k, x in enumerate(test_x):
      # One corruption per test example (not per client: with one client per domain, a
      # per-client draw would make each domain's column one corruption's accuracy).
      out, per_example = corruptions.corrupt_each_example(
          x, names, data_config.severity, seed * 100_003 + k, rng)
      corrupted.append(out)
      chosen.append(np.bincount(per_example, minlength=len(names)).tolist())
    splits['test_corrupted'] = stack_clients(corrupted, test_y, example_shape=shape)
    # Per-domain metrics ('<split>_<domain>', Table 1's columns) from each domain's clients.
    info['client_groups'] = {name: [k for k in range(num_clients) if client_domain[k] == name]
                             for name in domains}
    info['corruptions'] = names
    info['corruption_counts_per_client'] = chosen
    info['severity'] = data_config.severity
  return Benchmark(splits, 10, shape, info)
