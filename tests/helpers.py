"""Small shared builders for tests."""
import json
import pathlib

import jax
import ml_collections
import numpy as np

from fedjax_shift.config import apply_variant, base_config
from fedjax_shift.core import plan
from fedjax_shift.core.round import RoundConfig, round_key
from fedjax_shift.data.federated import stack_clients


ON_CPU = jax.default_backend() == 'cpu'


def backend_tolerance(rtol: float, atol: float = 0.0) -> dict:
  """Tolerance for one computation run two ways (vmapped vs per client, scan vs loop).
  On CPU both sum the same float32 terms; on a GPU the two calls may pick different
  convolution / matmul algorithms (an H100 missed rtol 2e-5), so the bound
  there is rtol 2e-3, atol 1e-4."""
  if ON_CPU:
    return dict(rtol=rtol, atol=atol)
  return dict(rtol=max(rtol, 2e-3), atol=max(atol, 1e-4))


def override(config: ml_collections.ConfigDict, **fields) -> ml_collections.ConfigDict:
  """``config`` with dotted ``fields`` set ('client.batch_size'=4); returns it. A
  'data.<field>' of the run's benchmark's own section is set there
  ('data.severity' -> config.data.<benchmark>.severity: ``set_data``)."""
  for key, value in fields.items():
    if key.startswith('data.') and key.count('.') == 1:
      set_data(config.data, **{key[len('data.'):]: value})
      continue
    target = config
    *path, leaf = key.split('.')
    for part in path:
      target = target[part]
    target[leaf] = value
  return config


def set_data(data: ml_collections.ConfigDict, **fields) -> ml_collections.ConfigDict:
  """``data`` (a ``config.data``) with ``fields`` set: a shared field itself, a field of
  the benchmark ``data.benchmark`` (once set) in its section; returns it."""
  if 'benchmark' in fields:
    data.benchmark = fields.pop('benchmark')
  for key, value in fields.items():
    own = data.get(data.benchmark)
    if key not in data and own is not None and key in own:
      own[key] = value
    else:
      data[key] = value
  return data


def tiny_config(**overrides) -> ml_collections.ConfigDict:
  return override(apply_variant(base_config(), 'tiny'), **overrides)


def data_config(**fields) -> ml_collections.ConfigDict:
  """What a benchmark reads (``benchmarks.data_view``) of a ``config.data`` of every
  benchmark's defaults with ``fields`` set (``set_data``): the benchmark's functions and
  checks take it as it is."""
  from fedjax_shift.benchmarks import data_view
  return data_view(set_data(base_config().data, **fields))


def toy_clients(sizes, shape=(4, 4, 1), num_classes=3, seed=0, pad_to=None):
  """Random clients with the given example counts, stacked and padded."""
  rng = np.random.default_rng(seed)
  xs = [rng.random((n,) + shape).astype(np.float32) for n in sizes]
  ys = [rng.integers(0, num_classes, n).astype(np.int32) for n in sizes]
  return stack_clients(xs, ys, pad_to=pad_to, example_shape=shape), xs, ys


def build_method(name, config, data, num_classes=3):
  """(module, algorithm, server state, stacked client states) of method ``name`` built
  from ``config`` for the clients of ``data``."""
  import jax.numpy as jnp
  from fedjax_shift import algorithms, models
  from fedjax_shift.core.round import stack_client_states
  module = models.create(config.model, num_classes)
  pretrained = None   # a method that trains around a pretrained model (ATP's α) gets one
  if algorithms.ALGORITHMS.meta(name).get('pretrained_model'):
    pretrained = models.init(module, jax.random.key(1), jnp.asarray(data.x[0, :1]))
  algorithm = algorithms.build(name, config, module, data.max_examples,
                               num_clients=data.num_clients, example_shape=data.x.shape[2:],
                               global_variables=pretrained)
  server = algorithm.init(jax.random.key(0), jnp.asarray(data.x[0, :1]))
  return module, algorithm, server, stack_client_states(algorithm, server, data.num_clients)


def launch_module(name: str):
  """launch/<name>.py imported once per process (its absl flags are defined once)."""
  import importlib.util
  import os
  import sys
  key = f'launch_{name}'
  if key not in sys.modules:
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        'launch', f'{name}.py')
    spec = importlib.util.spec_from_file_location(key, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[key] = module
  return sys.modules[key]


def write_run(workdir: pathlib.Path, method: str, seed: int, metrics: dict,
              config: ml_collections.ConfigDict | None = None) -> None:
  """A finished run as launch/train.py leaves it for launch/report.py:
  ``<workdir>/<method>/seed_<seed>/results.json``, and the workdir's config.json when
  ``config`` is given."""
  if config is not None:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / 'config.json').write_text(json.dumps(config.to_dict()))
  (workdir / method / f'seed_{seed}').mkdir(parents=True)
  (workdir / method / f'seed_{seed}' / 'results.json').write_text(json.dumps(
      {'algorithm': method, 'seed': seed, 'metrics': metrics}))


def compiled_programs(jitted) -> int:
  """How many programs a ``jax.jit``-wrapped function has compiled (one per distinct
  argument shapes and static values): the one place the tests count compilations."""
  return jitted._cache_size()


def grouped(data, cohort_size: int, width: int, shapes: int = 2, **fields) -> RoundConfig:
  """A RoundConfig of sorted groups of ``width``, cut to ``shapes`` fitted sizes."""
  bounds = plan.group_bounds(data.num_examples, cohort_size, width)
  buckets = plan.fit_example_buckets(bounds, width, shapes)
  return RoundConfig(cohort_size=cohort_size, client_chunk=width,
                     group_examples=plan.plan_group_examples(bounds, buckets), **fields)


def run_rounds(round_fn, server, clients, data, rounds=2, seed=3):
  """``rounds`` rounds of ``round_fn`` from (server, clients) on ``data``; the last output."""
  for r in range(rounds):
    out = round_fn(server, clients, data, round_key(jax.random.key(seed), r))
    server, clients = out.server_state, out.client_states
  return out
