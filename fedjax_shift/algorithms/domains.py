"""Domain-major client data of the evolving benchmarks (benchmarks/evolving.py):
block m of a client's [M·n, ...] examples is its data of source domain m+1."""
from __future__ import annotations

from typing import NamedTuple, Tuple

import jax
import jax.numpy as jnp

from fedjax_shift.core.algorithm import ClientData
from fedjax_shift.core.local import example_order


class DomainLayout(NamedTuple):
  num_domains: int   # M source domains
  domain_size: int   # n, padded examples per domain block


def domain_block(data: ClientData, layout: DomainLayout, m) -> Tuple[jax.Array, ...]:
  """(x [n, ...], y [n], mask [n]) of source domain block m (traced m allowed)."""
  start = m * layout.domain_size
  take = lambda a: jax.lax.dynamic_slice_in_dim(a, start, layout.domain_size, 0)
  return take(data.x), take(data.y), take(data.mask)


def domain_batch(data: ClientData, layout: DomainLayout, m, rng: jax.Array, batch_size: int
                 ) -> Tuple[jax.Array, jax.Array, jax.Array]:
  """A random batch of domain m: (x [B, ...], y [B], weight [B]). Real examples
  only (wrapping inside the block's own examples); when the block holds fewer than B
  examples the repeats carry weight 0, and an empty block gives weight 0 throughout."""
  x, y, mask = domain_block(data, layout, m)
  count = jnp.sum(mask)
  order = example_order(rng, mask)
  positions = jnp.arange(batch_size)
  idx = order[positions % jnp.maximum(count, 1)]
  weight = (positions < count).astype(jnp.float32)
  return x[idx], y[idx], weight


# What τ (the schedule's local epochs) counts: 'iterations' of one batch per domain
# (pair), or 'epochs' (FedEvolve App. D: "10 epochs"), each ⌈client's largest source
# domain / B⌉ iterations.
TAU_UNITS = ('iterations', 'epochs')


def local_iterations(layout: DomainLayout, tau: int, unit: str, batch_size: int) -> int:
  """The static scan length: τ iterations, or τ epochs of the largest (padded) block."""
  return tau if unit == 'iterations' else tau * -(-layout.domain_size // batch_size)


def iteration_budget(data: ClientData, layout: DomainLayout, tau: int, unit: str,
                     batch_size: int) -> jax.Array:
  """Iterations this client runs (traced int): min(τ, its step budget) in τ's unit (a
  straggler's budget counts epochs too in 'epochs'), times ⌈its largest source
  domain's examples / B⌉ in 'epochs'; 0 for a client without data."""
  budget = jnp.minimum(tau, data.step_budget)
  if unit == 'epochs':
    counts = data.mask.reshape(layout.num_domains, layout.domain_size).sum(1)
    budget = budget * ((jnp.max(counts) + batch_size - 1) // batch_size)
  return jnp.where(data.num_examples > 0, budget, 0)


def layout_from_info(info: dict, max_examples: int, method: str) -> DomainLayout:
  """M = ``info['num_domains']`` source domains (the benchmark's ``Benchmark.info``);
  n = padded examples / M."""
  if 'num_domains' not in info:
    raise ValueError(f'{method} trains on domain-major client data: use an evolving '
                     f'benchmark (rotated_digits, circle, timed_images); this benchmark\'s '
                     f'info has no num_domains')
  num_sources = int(info['num_domains'])
  if num_sources < 1:
    raise ValueError(f'config.data.num_domains: need >= 2 (sources + target), got '
                     f'{num_sources + 1}')
  layout = DomainLayout(num_sources, max_examples // num_sources)
  check_layout(layout, max_examples)
  return layout


def check_layout(layout: DomainLayout, max_examples: int) -> None:
  if layout.num_domains < 1 or layout.domain_size < 1:
    raise ValueError(f'evolving methods need domain-major client data; got {layout}')
  if layout.num_domains * layout.domain_size != max_examples:
    raise ValueError(f'client data has {max_examples} padded examples, not num_domains × '
                     f'domain_size = {layout.num_domains} × {layout.domain_size}: use an '
                     f'evolving benchmark (rotated_digits, circle)')
