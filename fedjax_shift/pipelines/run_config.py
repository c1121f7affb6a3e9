"""The config fields every run reads: their checks, before any data is built or
function compiled (``validate``: the selected pipeline's ``check``, which calls
``check_run`` or ``check_run_loop``), and the values they resolve to
(``round_backend``, ``eval_chunk_size``, ``algorithm_names``, ``eval_adapter_specs``).
"""
from __future__ import annotations

import math
import os
import uuid
from typing import Tuple

import jax
import ml_collections

from fedjax_shift import checkpoint, models, report
from fedjax_shift.algorithms import ALGORITHMS, base
from fedjax_shift.benchmarks import BENCHMARKS, check_data
from fedjax_shift.core.round import BACKENDS, SAMPLING, WEIGHTING
from fedjax_shift.core.test_time import ADAPTERS, mode_problem
from fedjax_shift.pipelines import callbacks
from fedjax_shift.pipelines.base import PIPELINES
from fedjax_shift.pipelines.workdir import RESUME_CHOICES
from fedjax_shift.registry import require, require_distinct


# Float fields where infinity is a meaningful value (Dirichlet α = ∞: IID).
INFINITE_ALLOWED = ('data.dirichlet_alpha',)
# The most local steps ``engine.unroll`` compiles into one loop iteration.
MAX_UNROLL = 64


def round_backend(config: ml_collections.ConfigDict) -> str:
  """``config.engine.backend``, with 'auto' resolved: the loop backend for
  convolutional models on CPU without device sharding (XLA:CPU runs vmapped, i.e.
  grouped, convolutions 3–4× slower than a loop of per-client calls: BENCHMARKS.md),
  the vmapped round everywhere else."""
  backend = config.engine.backend
  if backend != 'auto':
    return backend
  if (jax.default_backend() == 'cpu' and not config.engine.num_devices and
      models.is_convolutional(config.model.name)):
    return 'loop'
  return 'vmap'


# Clients per compiled evaluation call with ``engine.eval_chunk_size=0`` and the vmapped
# round.
EVAL_CHUNK_SIZE = 64


def eval_chunk_size(config: ml_collections.ConfigDict) -> int:
  """``config.engine.eval_chunk_size``, with 0 resolved as the round's backend is: one
  client per call where the round is the loop backend (the per-client personalised and
  adapted models would run as grouped convolutions on XLA:CPU), ``EVAL_CHUNK_SIZE``
  clients per call elsewhere."""
  chunk = config.engine.eval_chunk_size
  if chunk:
    return chunk
  return 1 if round_backend(config) == 'loop' else EVAL_CHUNK_SIZE


def algorithm_names(config: ml_collections.ConfigDict) -> Tuple[str, ...]:
  algorithms = config.algorithms
  if isinstance(algorithms, str):
    return tuple(a.strip() for a in algorithms.split(',') if a.strip())
  return tuple(algorithms)


def eval_adapter_specs(config: ml_collections.ConfigDict) -> Tuple[Tuple[str, str], ...]:
  """``config.eval_adapters`` ('<adapter>:<mode>', mode 'episodic' if omitted) as pairs."""
  specs = []
  for spec in config.eval_adapters:
    name, _, mode = spec.partition(':')
    specs.append((name, mode or 'episodic'))
  return tuple(specs)


def check_sections(config: ml_collections.ConfigDict) -> None:
  """Every method's section (``config.<algorithm>``, ``config.adapters.<adapter>``)
  holds only the fields its file registered, each inside its declared range."""
  for name in ALGORITHMS.names():
    if name in config:
      ALGORITHMS.check(name, config[name], f'config.{name}', run_check=False)
  for name in config.adapters.keys():
    ADAPTERS.get(name, 'config.adapters')
    ADAPTERS.check(name, config.adapters[name], f'config.adapters.{name}', run_check=False)


def check_finite(config: ml_collections.ConfigDict, prefix: str = '') -> None:
  """Every float field is finite (NaN / inf only where ``INFINITE_ALLOWED``)."""
  for key, value in config.items():
    path = f'{prefix}{key}'
    if isinstance(value, ml_collections.ConfigDict):
      check_finite(value, path + '.')
    elif isinstance(value, float) and not math.isfinite(value):
      require(path in INFINITE_ALLOWED and value == float('inf'), path,
              f'must be a finite number, got {value}')


def check_paper_tables(config: ml_collections.ConfigDict) -> None:
  """``config.paper_tables``: '' or a registered paper table that reads this
  pipeline's runs."""
  if not config.paper_tables:
    return
  report.PAPER_TABLES.get(config.paper_tables, 'config.paper_tables')
  readers = report.PAPER_TABLES.meta(config.paper_tables).get('pipelines', ())
  require(config.pipeline in readers, 'paper_tables',
          f'{config.paper_tables!r} lays out runs of the {list(readers)} pipeline(s), not '
          f'config.pipeline={config.pipeline!r}')
  benchmarks = report.PAPER_TABLES.meta(config.paper_tables).get('benchmarks', ())
  require(not benchmarks or config.data.benchmark in benchmarks, 'paper_tables',
          f'{config.paper_tables!r} lays out runs on the {list(benchmarks)} benchmark(s), not '
          f'config.data.benchmark={config.data.benchmark!r}')


def adapts(adapter: str, algorithm: str) -> bool:
  """Whether test-time adapter ``adapter`` runs on ``algorithm``'s models: every
  algorithm, unless the adapter was registered with ``trained_by`` (FedTTA's g,
  ODPFL-HN's hypernetwork) and the algorithm is not one of those."""
  return algorithm in ADAPTERS.meta(adapter).get('trained_by', (algorithm,))


def adapted_algorithms(config: ml_collections.ConfigDict) -> Tuple[str, ...]:
  """The methods whose models ``config.eval_adapters`` adapt:
  ``config.eval_adapter_algorithms``, or, when it is empty, every method run that one
  of those adapters adapts (``adapts``)."""
  if config.eval_adapter_algorithms:
    return tuple(config.eval_adapter_algorithms)
  specs = eval_adapter_specs(config)
  return tuple(a for a in algorithm_names(config) if any(adapts(n, a) for n, _ in specs))


def adapter_section(config: ml_collections.ConfigDict, name: str, algorithm_name: str
                    ) -> ml_collections.ConfigDict:
  """``config.adapters.<name>`` as it adapts ``algorithm_name``'s models: a variant's
  section over its adapter's (``Registry.section``), then, for an adapter registered
  with ``for_method`` (FedTTA's: η_inner and ε are the trained method's), resolved
  against the method's section."""
  section = ADAPTERS.section(name, config.adapters)
  resolve = ADAPTERS.meta(name).get('for_method')
  return resolve(section, config, algorithm_name, ALGORITHMS.section(algorithm_name, config)) \
      if resolve else section


def check_seeds(config: ml_collections.ConfigDict) -> None:
  """``config.seeds``: one or more distinct integers in [0, 2**32) (each (method,
  seed) one run): a JAX key holds 32 bits of a seed, so a larger one would share its
  keys with another seed while its data partition differed."""
  seeds = tuple(config.seeds)
  require(len(seeds) >= 1, 'seeds', 'name at least one seed')
  bad = [s for s in seeds if isinstance(s, bool) or not float(s).is_integer() or
         not 0 <= s < 2 ** 32]
  require(not bad, 'seeds', f'seeds are integers in [0, 2**32), got {bad} in {list(seeds)}')
  require_distinct(seeds, 'seeds', 'one (method, seed) run')


def check_run_loop(config: ml_collections.ConfigDict) -> None:
  """The run-loop fields every training pipeline reads (federated, hetero): seeds,
  finite floats, checkpoints and resuming, rounds, cohort, weighting, evaluation and
  checkpoint periods, divergence, the client / server optimizers."""
  check_seeds(config)
  check_finite(config)
  checkpoint.check_keep(config.keep_checkpoints)
  require(config.resume in RESUME_CHOICES, 'resume',
          f'unknown {config.resume!r}; choose from {list(RESUME_CHOICES)} '
          f"('extend': continue finished runs to a larger config.rounds, and runs "
          f"stopped early past their stop)")
  require(config.rounds >= 1, 'rounds', f'must be >= 1, got {config.rounds}')
  require(config.data.num_clients >= 1, 'data.num_clients',
          f'must be >= 1, got {config.data.num_clients}')
  require(1 <= config.cohort_size <= config.data.num_clients, 'cohort_size',
          f'must be in [1, data.num_clients={config.data.num_clients}], got {config.cohort_size}')
  require(config.weighting in WEIGHTING, 'weighting',
          f'unknown {config.weighting!r}; choose from {list(WEIGHTING)}')
  require(config.eval_every >= 1, 'eval_every', f'must be >= 1, got {config.eval_every}')
  require(config.paper_rounds >= 0, 'paper_rounds',
          f'must be >= 0 (0: no protocol to compare with), got {config.paper_rounds}')
  require(config.log_every >= 0, 'log_every',
          f'must be >= 0 (0: about a tenth of the run), got {config.log_every}')
  require(config.checkpoint_every >= 1, 'checkpoint_every',
          f'must be >= 1, got {config.checkpoint_every}')
  require(config.eval_adapter_batch_size >= 1, 'eval_adapter_batch_size',
          f'must be >= 1, got {config.eval_adapter_batch_size}')
  require(config.on_divergence in ('stop', 'continue'), 'on_divergence',
          f"unknown {config.on_divergence!r}; choose from ['stop', 'continue']")
  check_paper_tables(config)
  callbacks.check_config(config)
  base.check_training(config)


def check_vmap_seeds(config: ml_collections.ConfigDict) -> None:
  """The engine options vmapped seeds cannot combine with, each naming its field."""
  if not config.engine.vmap_seeds:
    return
  require(config.pipeline == 'federated', 'engine.vmap_seeds',
          f'only the federated pipeline vmaps its seeds; config.pipeline='
          f'{config.pipeline!r} runs them one by one (leave it False)')
  why = 'config.engine.vmap_seeds=True stacks every seed\'s data on the device'
  require(config.data.store == 'device', 'data.store', f'must be "device": {why}')
  require(config.engine.rounds_per_call == 1, 'engine.rounds_per_call',
          'must be 1 with engine.vmap_seeds (one vmapped round per call)')
  require(not config.engine.num_devices, 'engine.num_devices',
          'must be 0 with engine.vmap_seeds (the seeds share one device)')
  require(round_backend(config) == 'vmap', 'engine.backend',
          f'engine.vmap_seeds vmaps the compiled round; the {round_backend(config)!r} '
          f'backend is a Python loop over clients (set engine.backend="vmap")')


def check_run(config: ml_collections.ConfigDict) -> None:
  """The fields every federated run reads: methods and their sections, model,
  benchmark (its own ``config.data`` check), rounds, cohort, engine (``check_engine``),
  test-time evaluation (``check_eval_adapters``), checkpoints and resuming."""
  names = algorithm_names(config)
  require(len(names) > 0, 'algorithms', 'name at least one algorithm')
  require_distinct(names, 'algorithms', 'one (method, seed) run')
  check_run_loop(config)
  check_sections(config)
  models.MODELS.get(config.model.name, 'config.model.name')
  for name in names:
    ALGORITHMS.get(name, 'config.algorithms')
    ALGORITHMS.check(name, ALGORITHMS.section(name, config), f'config.{name}')
    require(not ALGORITHMS.meta(name).get('pretrained_model'), 'algorithms',
            f'{name} trains around a pretrained global model; the pipeline that trains '
            f'that model first runs it (config.pipeline=\'atp\')')
    needs = ALGORITHMS.meta(name).get('models')
    require(not needs or config.model.name in needs, 'model.name',
            f'{name} needs a model of {list(needs or ())}, got {config.model.name!r}')
  benchmark = config.data.benchmark
  BENCHMARKS.get(benchmark, 'config.data.benchmark')
  feeds = BENCHMARKS.meta(benchmark).get('pipelines', ())
  require(config.pipeline in feeds, 'data.benchmark',
          f'{benchmark!r} feeds the {list(feeds)} pipeline(s), not '
          f'config.pipeline={config.pipeline!r}')
  check_data(config.data)
  require(config.sampling in SAMPLING, 'sampling',
          f'unknown {config.sampling!r}; choose from {list(SAMPLING)}')
  require(config.data.pad_to >= 0, 'data.pad_to',
          f'must be >= 0 (0: each split\'s largest client), got {config.data.pad_to}')
  require(config.data.store in ('device', 'host'), 'data.store',
          f"unknown {config.data.store!r}; choose from ['device', 'host']")
  require(0.0 <= config.straggler_prob <= 1.0, 'straggler_prob',
          f'must be in [0, 1], got {config.straggler_prob}')
  require(config.straggler_max_steps >= 1, 'straggler_max_steps',
          f'must be >= 1, got {config.straggler_max_steps}')
  check_engine(config)
  check_eval_adapters(config)


def check_engine(config: ml_collections.ConfigDict) -> None:
  """``config.engine``: devices, backend, unrolling, rounds per call, vmapped seeds,
  evaluation batches and chunks, client groups, example buckets."""
  engine = config.engine
  require(engine.num_devices >= 0, 'engine.num_devices',
          f'must be >= 0, got {engine.num_devices}')
  if jax.process_count() > 1:   # fedjax_shift/distributed.py
    require(engine.num_devices == jax.device_count(), 'engine.num_devices',
            f'a run over {jax.process_count()} processes shards each cohort over every '
            f'device of every process: set it to {jax.device_count()}, got '
            f'{engine.num_devices}')
  if engine.num_devices:
    require(config.cohort_size % engine.num_devices == 0, 'cohort_size',
            f'{config.cohort_size} is not divisible by engine.num_devices={engine.num_devices}')
  require(engine.backend in BACKENDS + ('auto',), 'engine.backend',
          f'unknown {engine.backend!r}; choose from {list(BACKENDS) + ["auto"]}')
  require(not (engine.backend == 'loop' and engine.num_devices), 'engine.backend',
          "'loop' runs clients one at a time and cannot shard over engine.num_devices")
  unroll = engine.unroll
  require(unroll is True or (isinstance(unroll, int) and not isinstance(unroll, bool)
                             and 1 <= unroll <= MAX_UNROLL), 'engine.unroll',
          f'must be True (every local step of the padded bound unrolled) or a block of 1 to '
          f'{MAX_UNROLL} steps, got {unroll!r}: each step of a block is compiled once more '
          f'(a block of 1,000 MLP steps compiled for over 12 minutes), and 0 or less is no '
          f'block')
  require(engine.rounds_per_call >= 1, 'engine.rounds_per_call',
          f'must be >= 1, got {engine.rounds_per_call}')
  if engine.rounds_per_call > 1:
    require(config.data.store == 'device', 'engine.rounds_per_call',
            "> 1 scans rounds over the device store; data.store='host' moves a cohort per "
            'round (use rounds_per_call=1)')
    require(round_backend(config) == 'vmap', 'engine.rounds_per_call',
            f"> 1 scans the compiled round: it needs engine.backend='vmap' (here "
            f"'{engine.backend}' runs the {round_backend(config)} backend)")
  check_vmap_seeds(config)
  require(engine.eval_batch_size >= 1, 'engine.eval_batch_size',
          f'must be >= 1, got {engine.eval_batch_size}')
  require(engine.eval_chunk_size >= 0, 'engine.eval_chunk_size',
          f'must be >= 0 (0: as the round backend), got {engine.eval_chunk_size}')
  chunk = engine.client_chunk
  require(chunk >= 0, 'engine.client_chunk', f'must be >= 0 (0: fitted), got {chunk}')
  require(not (chunk and engine.num_devices and chunk % engine.num_devices), 'engine.client_chunk',
          f'must be a multiple of engine.num_devices={engine.num_devices} (each group of '
          f'clients is sharded over the devices), got {chunk}')
  buckets = tuple(engine.example_buckets)
  require(all(isinstance(b, int) and b >= 1 for b in buckets), 'engine.example_buckets',
          f'every bucket must be a positive example count, got {buckets}')
  require(all(low < high for low, high in zip(buckets, buckets[1:])), 'engine.example_buckets',
          f'must be strictly ascending, got {buckets}')
  require(engine.example_shapes >= 1, 'engine.example_shapes',
          f'must be >= 1 (padded client sizes to compile), got {engine.example_shapes}')
  require(engine.max_scanned == 0 or engine.max_scanned >= 1, 'engine.max_scanned',
          f'must be 0 (no grouping) or >= 1 (scanned / real local steps), '
          f'got {engine.max_scanned}')


def check_eval_adapters(config: ml_collections.ConfigDict) -> None:
  """``config.eval_adapters`` and the methods and splits they adapt: each adapter
  registered, in a mode it runs, adapting at least one evaluated method."""
  specs = eval_adapter_specs(config)
  require_distinct(specs, 'eval_adapters', "one adapted column ('<adapter>:<mode>')")
  require_distinct(config.eval_adapter_algorithms, 'eval_adapter_algorithms', 'one method')
  for name, mode in specs:
    ADAPTERS.get(name, 'config.eval_adapters')
    ADAPTERS.check(name, ADAPTERS.section(name, config.adapters), f'config.adapters.{name}')
    problem = mode_problem(name, mode)
    require(problem is None, 'eval_adapters', problem)
    trained_by = ADAPTERS.meta(name).get('trained_by')
    if trained_by:   # adapters that need parts only some methods train (FedTTA's g)
      field = 'eval_adapter_algorithms' if config.eval_adapter_algorithms else 'algorithms'
      candidates = tuple(config.eval_adapter_algorithms) or algorithm_names(config)
      require(any(adapts(name, a) for a in candidates), field,
              f'the {name} adapter adapts models trained by {list(trained_by)}; none of '
              f'{list(candidates)} is')
  for name, _ in specs:   # sections resolved per method (FedTTA's η_inner and ε)
    for algorithm in adapted_algorithms(config):
      if adapts(name, algorithm) and algorithm in config:
        adapter_section(config, name, algorithm)
  for algorithm in config.eval_adapter_algorithms:   # each gets at least one adapter
    if specs and not any(adapts(n, algorithm) for n, _ in specs):
      require(False, 'eval_adapter_algorithms',
              f'no adapter of config.eval_adapters adapts {algorithm}: ' + '; '.join(
                  f'the {n} adapter adapts models trained by '
                  f'{list(ADAPTERS.meta(n)["trained_by"])}' for n, _ in specs))
  require(all(isinstance(p, str) and p for p in config.eval_adapter_splits),
          'eval_adapter_splits', f'name split prefixes, e.g. (\'test\', \'val\'), got '
          f'{tuple(config.eval_adapter_splits)}')



def check_workdir(workdir: str) -> None:
  """Raises ValueError when ``workdir`` cannot be created or written."""
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as err:
    raise ValueError(f'workdir {workdir!r} cannot be created: {err}') from err
  # a name of this process's own: two runs started together do not remove each other's
  probe = os.path.join(workdir, f'.write_test.{os.getpid()}.{uuid.uuid4().hex[:8]}')
  try:
    with open(probe, 'w') as f:
      f.write('ok')
    os.remove(probe)
  except OSError as err:
    raise ValueError(f'workdir {workdir!r} is not writable: {err}') from err


# Names a pipeline had before; a config that still uses one is told the new name.
RENAMED = {'test_time': 'atp'}


def validate(config: ml_collections.ConfigDict, workdir: str | None = None) -> None:
  """The selected pipeline's checks, before any data is built or function compiled."""
  require(config.pipeline not in RENAMED, 'pipeline',
          f'{config.pipeline!r} is called {RENAMED.get(config.pipeline)!r} now')
  PIPELINES.get(config.pipeline, 'config.pipeline')
  require(jax.process_count() == 1 or config.pipeline == 'federated', 'pipeline',
          f'runs over {jax.process_count()} processes are the federated pipeline\'s; '
          f'{config.pipeline!r} runs in one process')
  require(not config.sweep or config.pipeline == 'federated', 'sweep',
          f'hyperparameter sweeps run in the federated pipeline, not config.pipeline='
          f'{config.pipeline!r}')
  PIPELINES.check(config.pipeline, config, 'config', known_fields_only=False)
  if workdir is not None:
    check_workdir(workdir)
