"""What every pipeline shares: the ``PIPELINES`` registry, ``Results``, the run
prologue (validation, config.json, hardware log), the results writer, and the checks
of the config fields every run reads.

A pipeline is ``run(config, workdir) -> Results`` registered under the name that
``config.pipeline`` selects, with the config sections it owns (``defaults``) and a
``check(config)`` of the fields it reads; ``fedjax_shift.pipelines.run`` validates,
writes the prologue, runs it and writes ``results.md``.
"""
from __future__ import annotations

import json
import logging
import math
import os
import platform
import shutil
import time
import uuid
from typing import Any, Dict, NamedTuple, Optional, Sequence, Tuple

import jax
import ml_collections

from fedjax_shift import checkpoint, distributed, events, models, report
from fedjax_shift.algorithms import ALGORITHMS, base
from fedjax_shift.benchmarks import BENCHMARKS, DATA_DEFAULTS
from fedjax_shift.core.round import BACKENDS, SAMPLING, WEIGHTING
from fedjax_shift.core.test_time import ADAPTERS, mode_problem
from fedjax_shift.metrics import RECORDED_OVERRIDES
from fedjax_shift.pipelines import workdir as workdir_lib
from fedjax_shift.registry import Registry, require, require_distinct

log = logging.getLogger('fedjax_shift')

# name -> run(config, workdir) -> Results; ``check(config)`` validates what it reads;
# meta ``run_dirs(config, workdir)`` -> [(run_dir, run_config, own section[, depends_on])] names the
# run directories it will train, so their fingerprints are checked before anything.
PIPELINES: Registry = Registry('pipeline')
# Float fields where infinity is a meaningful value (Dirichlet α = ∞: IID).
INFINITE_ALLOWED = ('data.dirichlet_alpha',)


class Results(NamedTuple):
  """What a pipeline returns; ``launch/train.py`` prints every pipeline's the same way.

  Attributes:
    preamble: one paragraph: protocol, seeds, hardware.
    tables: markdown tables in print order (results.md holds the preamble and these).
    files: paths the pipeline wrote besides results.md (csv, json, png).
    records: the per-run records, keyed by the pipeline ('results': one dict per
      method × seed for 'federated'; 'table1', 'table3' for 'atp').
  """
  preamble: str
  tables: Tuple[str, ...]
  files: Tuple[str, ...]
  records: Dict[str, Any]


_COMPILE_EVENTS = ('/jax/core/compile/jaxpr_trace_duration',
                   '/jax/core/compile/jaxpr_to_mlir_module_duration',
                   '/jax/core/compile/backend_compile_duration')
_ACTIVE_CLOCKS: list = []


def _on_duration(event: str, seconds: float, **kwargs) -> None:
  if event in _COMPILE_EVENTS:
    for clock in _ACTIVE_CLOCKS:
      clock.seconds += seconds
      clock.compilations += event == _COMPILE_EVENTS[-1]


jax.monitoring.register_event_duration_secs_listener(_on_duration)


class CompileClock:
  """Seconds JAX spends tracing, lowering and compiling while the clock is active
  (``with CompileClock() as clock: ...; clock.seconds``), and the number of XLA
  compilations (``clock.compilations``); a persistent-cache hit costs only its
  tracing and lowering."""

  def __init__(self):
    self.seconds = 0.0
    self.compilations = 0

  def __enter__(self) -> 'CompileClock':
    _ACTIVE_CLOCKS.append(self)
    return self

  def __exit__(self, *exc) -> None:
    _ACTIVE_CLOCKS.remove(self)


def hardware() -> Dict[str, object]:
  devices = jax.devices()
  info = {'backend': jax.default_backend(), 'devices': [str(d) for d in devices],
          'device_kind': devices[0].device_kind, 'jax': jax.__version__,
          'host': platform.node(), 'cpu_count': os.cpu_count(),
          'processes': jax.process_count()}
  local = jax.local_devices()[0]
  stats = local.memory_stats() if hasattr(local, 'memory_stats') else None
  if stats and 'bytes_limit' in stats:
    info['device_memory_gb'] = round(stats['bytes_limit'] / 2 ** 30, 2)
  return info


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
  require(config.resume in workdir_lib.RESUME_CHOICES, 'resume',
          f'unknown {config.resume!r}; choose from {list(workdir_lib.RESUME_CHOICES)} '
          f"('extend': continue finished runs to a larger config.rounds)")
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
  benchmark (its own ``config.data`` check), rounds, cohort, engine, evaluation,
  checkpoints and resuming."""
  names = algorithm_names(config)
  require(len(names) > 0, 'algorithms', 'name at least one algorithm')
  require_distinct(names, 'algorithms', 'one (method, seed) run')
  check_run_loop(config)
  check_sections(config)
  models.MODELS.get(config.model.name, 'config.model.name')
  for name in names:
    ALGORITHMS.get(name, 'config.algorithms')
    ALGORITHMS.check(name, config[name], f'config.{name}')
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
  BENCHMARKS.check(benchmark, config.data, 'config.data', known_fields_only=False)
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
  specs = eval_adapter_specs(config)
  require_distinct(specs, 'eval_adapters', "one adapted column ('<adapter>:<mode>')")
  require_distinct(config.eval_adapter_algorithms, 'eval_adapter_algorithms', 'one method')
  for name, mode in specs:
    ADAPTERS.get(name, 'config.eval_adapters')
    ADAPTERS.check(name, config.adapters[name], f'config.adapters.{name}')
    problem = mode_problem(name, mode)
    require(problem is None, 'eval_adapters', problem)
    trained_by = ADAPTERS.meta(name).get('trained_by')
    if trained_by:   # adapters that need parts only some methods train (FedTTA's g)
      require(not config.eval_adapter_algorithms or
              any(adapts(name, a) for a in config.eval_adapter_algorithms),
              'eval_adapter_algorithms',
              f'the {name} adapter adapts models trained by {list(trained_by)}; none of '
              f'{list(config.eval_adapter_algorithms)} is')
  for name, _ in specs:   # sections resolved per method (FedTTA's η_inner and ε)
    resolve = ADAPTERS.meta(name).get('for_method')
    for algorithm in config.eval_adapter_algorithms or algorithm_names(config):
      if resolve and adapts(name, algorithm) and algorithm in config:
        resolve(config.adapters[name], config, algorithm)
  for algorithm in config.eval_adapter_algorithms:   # each gets at least one adapter
    if specs and not any(adapts(n, algorithm) for n, _ in specs):
      require(False, 'eval_adapter_algorithms',
              f'no adapter of config.eval_adapters adapts {algorithm}: ' + '; '.join(
                  f'the {n} adapter adapts models trained by '
                  f'{list(ADAPTERS.meta(n)["trained_by"])}' for n, _ in specs))
  require(all(isinstance(p, str) and p for p in config.eval_adapter_splits),
          'eval_adapter_splits', f'name split prefixes, e.g. (\'test\', \'val\'), got '
          f'{tuple(config.eval_adapter_splits)}')


# The most local steps ``engine.unroll`` compiles into one loop iteration.
MAX_UNROLL = 64


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


def method_sections() -> set:
  """Top-level config sections that belong to one method or pipeline stage."""
  return set(ALGORITHMS.names()) | {section for name in PIPELINES.names()
                                    for section in PIPELINES.defaults(name)}


def other_benchmark_fields(benchmark: str) -> set:
  """'data.<field>' of the fields only other benchmarks read: they cannot change this
  benchmark's runs (and a new benchmark's fields do not invalidate existing workdirs)."""
  own = set(DATA_DEFAULTS) | set(BENCHMARKS.defaults(benchmark) if benchmark in
                                 BENCHMARKS.names() else ())
  return {f'data.{field}' for name in BENCHMARKS.names()
          for field in BENCHMARKS.defaults(name) if field not in own}


def override_fields(config: ml_collections.ConfigDict, names: Sequence[str]) -> dict:
  """The fingerprinted fields of the client overrides of ``names``' methods."""
  fields = {}
  for name in names:
    if name not in ALGORITHMS:
      continue
    overrides = base.client_overrides(config, name)
    for field, (recorded, shared) in RECORDED_OVERRIDES.items():
      fields[f'{name}.{recorded}'] = json.dumps(overrides.pop(field, shared))
    fields.update({f'client_overrides.{name}.{field}': json.dumps(value, default=repr)
                   for field, value in overrides.items()})
  return fields


def run_fields(config: ml_collections.ConfigDict, section: str) -> dict:
  """The fingerprinted fields of a run trained by ``section``'s method (not those of
  other methods' sections, nor the data fields of other benchmarks)."""
  # The pretrained backbone (pipelines/pretrain.py) belongs to a run that starts from it.
  own = (section,) + (('backbone',) if 'backbone' in config and config.backbone.weights else ())
  fields = {path: value for path, value in
            workdir_lib.state_fields(config, method_sections(), own).items()
            if not path.startswith('client_overrides.')}
  fields.update(override_fields(config, own))
  weights = config.backbone.weights if 'backbone' in config else ''
  if weights and weights != 'pretrain' and os.path.exists(weights):
    # a path is not an identity: the same file may be rewritten with other weights
    fields['backbone.content'] = json.dumps(workdir_lib.content_digest(weights))
  unused = other_benchmark_fields(config.data.benchmark)
  return {path: value for path, value in fields.items() if path not in unused}


def check_run_dir(run_dir: str, run_config: ml_collections.ConfigDict, section: str,
                  resume: str, depends_on: Optional[dict] = None) -> dict:
  """Checks ``run_dir`` against its ``run.json`` (fingerprint, round target) and kept
  checkpoints (read-only); returns the run's fingerprinted fields, with
  ``depends_on.<key>`` for what the run reads from another run (``depends_on``)."""
  fields = state_fields(run_config, section, depends_on)
  check_recorded(run_dir, fields, run_config, resume)
  return fields


def check_recorded(run_dir: str, fields: dict, run_config: ml_collections.ConfigDict,
                   resume: str) -> None:
  """``fields`` and ``run_config.rounds`` against ``run_dir``'s run.json and kept
  checkpoints (read-only)."""
  workdir_lib.check_run_dir(run_dir, fields, run_config.rounds, resume,
                            other_benchmark_fields(run_config.data.benchmark))
  workdir_lib.check_rounds(run_dir, run_config.rounds)


def state_fields(run_config: ml_collections.ConfigDict, section: str,
                 depends_on: Optional[dict] = None) -> dict:
  """A run's fingerprinted fields (``run_fields``) with ``depends_on.<key>`` for what
  it reads from another run (``depends_on``)."""
  fields = run_fields(run_config, section)
  fields.update({f'depends_on.{key}': json.dumps(value, sort_keys=True)
                 for key, value in (depends_on or {}).items()})
  return fields


def checked_fields(run_dir: str, run_config: ml_collections.ConfigDict, section: str,
                   resume: str, depends_on: Optional[dict] = None) -> dict:
  """``check_run_dir`` on every process of a run: process 0 reads the run's files
  (which it writes, and the others could read half-written), its verdict reaches every
  process; returns the fields."""
  fields = state_fields(run_config, section, depends_on)
  distributed.primary_decides(lambda: check_recorded(run_dir, fields, run_config, resume),
                              f'the check of {run_dir}/run.json')
  return fields


class OpenRun(NamedTuple):
  """A run directory opened for training (``open_run``)."""
  checkpointer: Any        # checkpoint.Checkpointer of <run_dir>/checkpoints
  start_round: int         # rounds already trained (0 for a new run)
  state: Any               # the restored (or initial) state, last leaf the seconds so far
  writer: Any              # metrics.MetricsWriter, None when no round is left to train


def open_run(run_dir: str, config: ml_collections.ConfigDict, fields: dict, state,
             max_round: Optional[int] = None) -> OpenRun:
  """Restores ``state`` (a tuple whose last element is the elapsed seconds) from the
  latest checkpoint of ``run_dir`` up to ``config.rounds`` (and ``max_round``: runs
  trained in lockstep resume at a round they all have), records run.json and opens
  metrics.jsonl from the restored round."""
  from fedjax_shift.metrics import MetricsWriter, NullWriter, drop_cut_line, read_metrics
  checkpointer = checkpoint.Checkpointer(os.path.join(run_dir, 'checkpoints'),
                                         config.checkpoint_every, config.keep_checkpoints)
  limit = config.rounds if max_round is None else min(config.rounds, max_round)
  start_round, state = checkpointer.restore(checkpoint.RunState(*state), max_round=limit)
  start_round = start_round or 0
  if start_round:
    log.info('resumed from round %d in %s', start_round, run_dir)
  primary = distributed.is_primary()
  if primary:
    workdir_lib.record_run(run_dir, fields, config.rounds)
  tensorboard = config.tensorboard
  writer = None
  if start_round < config.rounds:
    writer = (MetricsWriter(run_dir, start_round, fields, tensorboard) if primary else
              NullWriter())
  elif primary:   # finished: a cut last line dropped, its event files written if missing
    drop_cut_line(os.path.join(run_dir, 'metrics.jsonl'))
    if tensorboard:
      events.ensure(run_dir, read_metrics(os.path.join(run_dir, 'metrics.jsonl')), fields)
  return OpenRun(checkpointer, start_round, state, writer)


def preflight(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Checks every run directory the pipeline will train before anything is written,
  then deletes the checkpoints each keeps past its config.keep_checkpoints (a re-run
  with a lower value frees disk space before it writes)."""
  entries = PIPELINES.meta(config.pipeline)['run_dirs'](config, workdir)
  running = [entry[0] for entry in entries]
  workdir_lib.check_layout(running)
  for run_dir, run_config, section, *depends_on in entries:
    fields = check_run_dir(run_dir, run_config, section, config.resume, *depends_on)
    workdir_lib.check_other_seeds(run_dir, fields, run_config.rounds,
                                  other_benchmark_fields(run_config.data.benchmark), running)
  for run_dir, run_config, *_ in entries:
    deleted = checkpoint.prune(os.path.join(run_dir, 'checkpoints'),
                               run_config.keep_checkpoints, run_config.rounds)
    if deleted:
      log.info('%s: deleted the checkpoints of rounds %s (config.keep_checkpoints=%d)',
               run_dir, list(deleted), run_config.keep_checkpoints)


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


def prologue(config: ml_collections.ConfigDict, workdir: str) -> Dict[str, object]:
  """With the workdir validated and locked: checks its runs (``preflight``), writes
  ``config.json``, appends the invocation to ``config_history.jsonl`` and logs the
  devices; returns the hardware."""
  preflight(config, workdir)
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    f.write(config.to_json_best_effort(indent=1))
  with open(os.path.join(workdir, 'config_history.jsonl'), 'a') as f:
    f.write(json.dumps({'time': time.strftime('%Y-%m-%dT%H:%M:%S'), 'pid': os.getpid(),
                        'host': platform.node(),
                        'config': json.loads(config.to_json_best_effort())}) + '\n')
  info = hardware()
  log.info('pipeline %s; devices: %s (%s), jax %s, device memory %s GB', config.pipeline,
           info['devices'], info['backend'], info['jax'], info.get('device_memory_gb', 'n/a'))
  return info


def write_results(workdir: str, results: Results) -> str:
  """``results.md``: the preamble and every table. Returns its path."""
  path = os.path.join(workdir, 'results.md')
  with open(path, 'w') as f:
    f.write(results.preamble.rstrip() + '\n\n' + '\n\n'.join(t.rstrip() for t in results.tables)
            + '\n')
  return path


def format_results(results: Results, workdir: str, width: Optional[int] = None) -> str:
  """What ``launch/train.py`` prints for any pipeline: a table wider than the terminal
  (``width`` characters; None: the terminal's, 120 off a terminal) in parts of its
  columns that fit, the whole one in results.md."""
  written = ', '.join([os.path.join(workdir, 'results.md')] +
                      [os.path.relpath(p, workdir) for p in results.files if p])
  width = width or shutil.get_terminal_size((120, 24)).columns
  tables = [report.fit_width(table, width) for table in results.tables]
  note = ('\n\n(tables wider than the terminal are shown in parts of their columns; '
          f'{os.path.join(workdir, "results.md")} has them whole)'
          if tables != list(results.tables) else '')
  return ('\n' + '\n\n'.join([results.preamble] + tables) + note +
          f'\n\nwritten: {written}')
