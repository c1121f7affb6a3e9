"""The federated pipeline (``config.pipeline = 'federated'``): ``run(config, workdir)``
trains every configured method over every seed, evaluates, checkpoints, resumes, and
returns the results table.

Workdir layout::

    <workdir>/<method>/seed_<s>/checkpoints/   orbax, full state
    <workdir>/<method>/seed_<s>/metrics.jsonl  one line per round
    <workdir>/<method>/seed_<s>/partition.json partition statistics of every split
    <workdir>/<method>/seed_<s>/results.json   final metrics, rounds, seconds, hardware
    <workdir>/<method>/seed_<s>/diverged.json  the round and error of a diverged run
                                               (config.on_divergence='continue')
    <workdir>/results.md, results.csv, curves.png
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from fedjax_shift import algorithms, distributed, models, report
from fedjax_shift.benchmarks import BENCHMARKS, Benchmark
from fedjax_shift.core import evaluation
from fedjax_shift.core.algorithm import ClientData, FederatedAlgorithm
from fedjax_shift.core.round import (NO_STEP_LIMIT, HostStore, RoundConfig, build_round,
                                     check_example_buckets, client_mesh, fit_client_chunk,
                                     fit_example_buckets, group_bounds, plan_group_examples,
                                     population_steps, round_key, stack_client_states)
from fedjax_shift.core.test_time import ADAPTERS, SourceContext, client_runner
from fedjax_shift.data import federated
from fedjax_shift.metrics import read_json, read_metrics
from fedjax_shift.pipelines import loop, pretrain, sweep
from fedjax_shift.pipelines import workdir as workdir_lib
from fedjax_shift.pipelines.loop import DivergenceError
from fedjax_shift.pipelines.base import (PIPELINES, CompileClock, Results, adapts,
                                         algorithm_names, check_run, checked_fields,
                                         eval_adapter_specs, hardware, open_run, round_backend)

log = logging.getLogger('fedjax_shift')


def build_data(config: ml_collections.ConfigDict, seed: int) -> Benchmark:
  bench = BENCHMARKS.get(config.data.benchmark, 'config.data.benchmark')(config.data, seed)
  validate_benchmark(bench)
  if not any(int(np.sum(s.num_examples)) for n, s in bench.splits.items() if n != 'train'):
    raise ValueError(f'config.data: benchmark {config.data.benchmark!r} builds no evaluation '
                     f'split with examples (splits: {sorted(bench.splits)}): no accuracy '
                     f'would be measured')
  pad_to = config.data.pad_to
  if pad_to:
    if 'domain_size' in bench.info:
      raise ValueError(f'config.data.pad_to: benchmark {config.data.benchmark!r} lays each '
                       f'client out in domain blocks of {bench.info["domain_size"]}; leave '
                       f'pad_to at 0')
    splits = {}
    for name, split in bench.splits.items():
      try:
        splits[name] = federated.pad_examples(split, pad_to)
      except ValueError as err:
        raise ValueError(f'config.data.pad_to={pad_to}: in split {name!r} of seed {seed}, '
                         f'{err}; raise pad_to') from None
    bench = bench._replace(splits=splits)
  return bench


def validate_benchmark(bench: Benchmark) -> None:
  """Every split well formed (``data.federated.validate``) and a 'train' split with
  at least one example; errors name the split and client."""
  if 'train' not in bench.splits:
    raise ValueError(f'the benchmark has no train split (splits: {sorted(bench.splits)})')
  for name, split in bench.splits.items():
    federated.validate(split, bench.num_classes, name)
    if split.num_clients != bench.splits['train'].num_clients:
      raise ValueError(f'split {name!r} has {split.num_clients} clients, the train split '
                       f'{bench.splits["train"].num_clients}')
  if int(np.sum(bench.splits['train'].num_examples)) == 0:
    raise ValueError('the train split holds no examples at any client (e.g. '
                     'config.data.split_fractions.train=0): nothing would be trained')


def round_config(config, train: Optional[federated.FederatedData] = None,
                 algorithm_name: str = '', populations: Sequence[np.ndarray] = ()
                 ) -> RoundConfig:
  """The compiled round's options. With the training split: the width of the sorted
  cohort's client groups (``engine.client_chunk``, or with 0 the width
  ``fit_client_chunk`` fits under ``engine.max_scanned``), each group's padded size
  from ``engine.example_buckets`` (or at most ``engine.example_shapes`` sizes fitted),
  and the loop backend's buckets: planned for the training split's client sizes and
  ``populations`` ([K] sizes of the other runs that share the program: every group's
  bound holds for each of them). Data not stored real-examples-first (FedEvolve's
  domain-major layout) keeps the padded size."""
  engine = config.engine
  fields = dict(cohort_size=config.cohort_size, sampling=config.sampling,
                weighting=config.weighting, straggler_prob=config.straggler_prob,
                straggler_max_steps=config.straggler_max_steps)
  if train is None:
    return RoundConfig(client_chunk=engine.client_chunk, **fields)
  schedule = algorithms.base.method_schedule(config, algorithm_name, train.max_examples)
  own = np.asarray(train.num_examples)
  sizes = [np.asarray(p) for p in populations]
  if not any(np.array_equal(own, p) for p in sizes):
    sizes.append(own)
  backend = round_backend(config)
  chunk = engine.client_chunk
  if not chunk and engine.max_scanned and backend == 'vmap':
    chunk = fit_client_chunk(population_steps(schedule, np.concatenate(sizes)),
                             config.cohort_size, engine.max_scanned, engine.num_devices or 1)
  buckets = tuple(engine.example_buckets)
  cut = (examples_first(train) and not (algorithm_name and
                                        algorithms.base.ALGORITHMS.meta(algorithm_name).get(
                                            'layout')))
  group_examples = example_buckets = ()
  if cut and backend == 'vmap':
    width = chunk or config.cohort_size
    bounds = np.max([group_bounds(k, config.cohort_size, width) for k in sizes], axis=0)
    planned = plan_group_examples(
        bounds, buckets or fit_example_buckets(bounds, width, engine.example_shapes,
                                               min_saving_examples(train)),
        'config.engine.example_buckets')
    group_examples = tuple(min(examples, train.max_examples) for examples in planned)
  elif cut:
    every = np.concatenate(sizes)
    example_buckets = buckets or fit_example_buckets(np.sort(every)[::-1], 1,
                                                     engine.example_shapes,
                                                     min_saving_examples(train))
    check_example_buckets(example_buckets, int(every.max()), 'config.engine.example_buckets')
    example_buckets = tuple(sorted({min(b, train.max_examples) for b in example_buckets}))
  elif buckets:
    check_example_buckets(buckets, train.max_examples, 'config.engine.example_buckets')
  return RoundConfig(client_chunk=chunk, group_examples=group_examples,
                     example_buckets=example_buckets, schedule=schedule, **fields)


def seed_populations(config: ml_collections.ConfigDict, programs: Optional[Dict] = None
                     ) -> Tuple[np.ndarray, ...]:
  """[K] client sizes of the training split of each of ``config.seeds``: the runs that
  may share one compiled round, whose plan must hold for every one of them (kept in
  ``programs``, the process's program cache, per data config and seeds)."""
  key = ('populations', json.dumps(config.data.to_dict(), sort_keys=True, default=str),
         tuple(config.seeds))
  cache = programs if programs is not None else {}
  if key not in cache:
    cache[key] = tuple(np.asarray(build_data(config, seed).splits['train'].num_examples)
                       for seed in config.seeds)
  return cache[key]


# A padded size costs one more compilation of the client update (1-2 s for an MLP on a
# 2-core CPU); a fitted size is added only where it saves gathering at least this much
# of the cohort's data a round.
MIN_SHAPE_SAVING_BYTES = 8 * 2 ** 20


def min_saving_examples(train: federated.FederatedData) -> float:
  """``MIN_SHAPE_SAVING_BYTES`` in examples of ``train`` (inputs, labels and mask)."""
  per_example = (int(np.prod(train.x.shape[2:])) * train.x.dtype.itemsize +
                 train.y.dtype.itemsize + 1)
  return MIN_SHAPE_SAVING_BYTES / per_example


def examples_first(data: federated.FederatedData) -> bool:
  """Whether every client's real examples are its first ``num_examples`` rows (so a
  client can be cut to fewer padded rows without losing any)."""
  mask = np.asarray(data.mask)
  return bool(np.array_equal(mask, np.arange(mask.shape[1])[None, :] <
                             np.asarray(data.num_examples)[:, None]))


def uploaded_by_part(algorithm: FederatedAlgorithm, server_state, client_states,
                     train: federated.FederatedData) -> Dict[str, int]:
  """Numbers a client sends per round, by kind, read off the shapes of its
  ``ClientOutput.update`` with no computation (FedEvolve Table 7): 'params' (every leaf
  under a 'params' key: the trained model parameters), 'batch_stats' (running
  statistics), else the leaf's first key ('proto_sums', 'feature', 'control', ...;
  'update' for a leaf at the top)."""
  one = ClientData(jnp.asarray(train.x[0]), jnp.asarray(train.y[0]), jnp.asarray(train.mask[0]),
                   jnp.asarray(train.num_examples[0]), jnp.int32(NO_STEP_LIMIT))
  state = jax.tree.map(lambda a: a[0], client_states)
  update = jax.eval_shape(algorithm.client_update, server_state, state, one,
                          jax.random.key(0))[0].update
  counts: Dict[str, int] = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(update):
    kind = upload_kind(path)
    counts[kind] = counts.get(kind, 0) + int(np.prod(leaf.shape))
  return counts


def upload_kind(path) -> str:
  """``uploaded_by_part``'s kind of the leaf at ``path`` (a pytree key path): 'params' or
  'batch_stats' when either names a level of it, else its first key ('update' at the
  top). A tuple key, as ``flax.traverse_util.flatten_dict`` makes (FedRep's shared
  part), counts as the levels it names."""
  keys = []
  for part in path:
    key = getattr(part, 'key', getattr(part, 'name', part))
    keys += [str(k) for k in key] if isinstance(key, tuple) else [str(key)]
  return next((k for k in ('params', 'batch_stats') if k in keys), keys[0] if keys else 'update')


def uploaded_parameters(algorithm: FederatedAlgorithm, server_state, client_states,
                        train: federated.FederatedData) -> int:
  """Numbers a client sends per round: every element of its ``ClientOutput.update``."""
  return sum(uploaded_by_part(algorithm, server_state, client_states, train).values())


def adapter_section(config: ml_collections.ConfigDict, name: str, algorithm_name: str
                    ) -> ml_collections.ConfigDict:
  """``config.adapters.<name>`` for ``algorithm_name``'s models: an adapter registered with
  ``for_method`` (FedTTA's: η_inner and ε are the trained method's) resolves it."""
  resolve = ADAPTERS.meta(name).get('for_method')
  return resolve(config.adapters[name], config, algorithm_name) if resolve else \
      config.adapters[name]


def applied_adapters(config: ml_collections.ConfigDict, algorithm_name: str) -> Dict[str, dict]:
  """{adapter: its section as the run used it (``adapter_section``: FedTTA's η_inner, ε
  and fill_batch resolved)} of every test-time adapter run on ``algorithm_name``'s
  models; recorded in results.json."""
  if algorithm_name not in tuple(config.eval_adapter_algorithms):
    return {}
  return {name: adapter_section(config, name, algorithm_name).to_dict()
          for name, _ in eval_adapter_specs(config) if adapts(name, algorithm_name)}


def adapter_runner(name: str, mode: str, batch_size: int, section: ml_collections.ConfigDict,
                   module, num_classes: int, input_shape: tuple, cache: Dict):
  """Adapter ``name`` (hyperparameters ``section``) as an ``AdaptRunner`` around a
  jitted ``client_runner``, one per distinct adapter in ``cache``: the splits of one
  (padded) shape, both models and every method of the same model structure trace it
  once. A section holding traced values (a swept adapter field) is never cached."""
  traced = any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(section.to_dict()))
  key = (name, mode, batch_size, section.to_json_best_effort(sort_keys=True), module,
         num_classes, input_shape)
  if traced or key not in cache:
    context = SourceContext(None, num_classes, batch_size, input_shape=input_shape)
    adapter = ADAPTERS.get(name, 'config.eval_adapters')(module, section, context)
    runner = evaluation.AdaptRunner(jax.jit(client_runner(adapter, batch_size, mode)), mode,
                                    batch_size)
    if traced:
      return runner
    cache[key] = runner
  return cache[key]


# The evaluation adapters' runners of this process (``adapter_runner``).
ADAPTER_RUNNERS: Dict[tuple, object] = {}


def build_eval_adapters(config: ml_collections.ConfigDict, module, num_classes: int,
                        algorithm: FederatedAlgorithm, global_only=(),
                        algorithm_name: str = '', input_shape: tuple = ()):
  """The jitted adapted evaluation of ``config.eval_adapters`` ('<adapter>:<mode>'
  strings, e.g. 'memo:episodic', 't3a:online'; hyperparameters from
  ``config.adapters.<adapter>``), run on the splits of ``config.eval_adapter_splits``;
  an adapter registered with ``trained_by`` only on those methods' models. None when
  there are none."""
  specs = [(name, mode) for name, mode in eval_adapter_specs(config)
           if adapts(name, algorithm_name)]
  if not specs:
    return None
  runners = {name: adapter_runner(name, mode, config.eval_adapter_batch_size,
                                  adapter_section(config, name, algorithm_name), module,
                                  num_classes, tuple(input_shape), ADAPTER_RUNNERS)
             for name, mode in specs}
  models_of = {name: ADAPTERS.meta(name)['adapts_models'] for name in runners
               if 'adapts_models' in ADAPTERS.meta(name)}
  return evaluation.build_adapted_evaluate(algorithm, runners, global_only, models_of)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, algorithm_name: str,
                       seed: int, bench: Optional[Benchmark] = None,
                       algorithm: Optional[FederatedAlgorithm] = None,
                       log_state: Optional[Callable[[object], Dict[str, float]]] = None,
                       programs: Optional[Dict] = None,
                       backbone: Optional[dict] = None,
                       keep_going: bool = False,
                       depends_on: Optional[Dict[str, object]] = None) -> Dict[str, object]:
  """Trains one method with one seed in ``workdir`` (resuming if it holds a
  checkpoint); returns {'algorithm', 'seed', 'metrics', 'rounds', 'train_seconds',
  'compile_seconds', 'compilations', …, 'server_state'} ('server_state' is not written
  to results.json). 'compile_seconds': tracing, lowering and XLA compilation of every
  function the run compiled; 'compilations': how many XLA compilations it ran.

  ``bench`` (default: built from ``config.data``; validated either way) and
  ``algorithm`` (default: the registered ``algorithm_name`` with its section
  ``config.<algorithm_name>``) let pipelines train on data or with methods of their
  own (ATP's α training); ``log_state(server_state)`` adds fields to every
  metrics.jsonl record (ATP: α per module). ``programs``: a dict shared by the runs of
  one process (``run`` passes one): the built method, its round and its evaluation
  functions are kept there under a ``ProgramKey``, so a later seed with the same
  shapes reuses their compilations instead of compiling again. ``keep_going``: a
  non-finite loss gives a diverged record instead of raising DivergenceError.
  ``depends_on``: what the trained state depends on outside ``config`` (ATP's α: the
  pretrained run's fingerprint and rounds), fingerprinted as ``depends_on.<key>``.

  ``workdir/run.json`` records the config fields that determine the trained state; a
  re-run whose fields differ, or that raises ``rounds`` without
  ``config.resume='extend'``, is refused before anything is touched (pipelines/workdir.py).
  """
  distributed.require_in_step(f'{algorithm_name} seed {seed}')
  settled = settled_divergences([workdir], config.rounds).get(0) if keep_going else None
  if settled is not None:
    log_settled(workdir)
    return diverged_record(config, workdir, algorithm_name, seed, settled)
  with CompileClock() as clock:
    opened = setup_run(config, workdir, algorithm_name, seed, bench, algorithm, programs,
                       backbone, log_state, depends_on)
    train = opened.bench.splits['train']
    host_store = (HostStore(train, opened.train_key, round_config(config),
                            cohort_sharding(config))
                  if config.data.store == 'host' else None)
    try:
      trainer = single_run_trainer(config, opened.programs, train, opened.train_key,
                                   host_store, algorithm_name)
      outcome, = loop.train([opened.run], opened.state, trainer, config.rounds,
                            config.eval_every, config.checkpoint_every, keep_going,
                            config.progress, f'{algorithm_name} seed {seed}',
                            config.log_every)
    finally:
      if host_store is not None:
        host_store.close()
      opened.run.checkpointer.close()
  return finish_run(config, workdir, algorithm_name, seed, outcome, opened.upload, clock)


class ProgramKey(NamedTuple):
  """What a built method and its compiled programs depend on besides the config: runs
  with equal keys share them (``train_and_evaluate``'s ``programs``)."""
  algorithm: str
  train_shape: tuple           # the training split's x shape [K, N, ...]
  dtype: str
  num_classes: int
  build_info: str              # algorithms.base.build_info of the benchmark, as JSON
  new_client_splits: tuple
  round: RoundConfig           # the round's plan (groups, padded sizes) for every seed


class Programs(NamedTuple):
  """A built method and the functions compiled for it."""
  module: Any
  algorithm: FederatedAlgorithm
  round_device: Callable       # core.round.build_round's, over the device store
  round_host: Callable         # ... over a cohort gathered on the host
  evaluate_chunk: Callable     # evaluation.build_evaluate's
  adapted_chunk: Optional[Callable]     # config.eval_adapters on its models, or None
  new_client_chunk: Optional[Callable]  # PFL-Sampled / -Ensemble on new clients, or None


class OpenedRun(NamedTuple):
  """One (method, seed) run opened and ready to train (``setup_run``)."""
  run: loop.Run
  bench: Benchmark
  programs: Programs
  train_key: jax.Array
  upload: Dict[str, int]       # numbers a client uploads per round, per update entry
  state: tuple                 # (server_state, client_states), restored or initial


def data_digest(bench: Benchmark) -> str:
  """A hash of every split's labels, client sizes and per-client input sums: the same
  config and seed must rebuild the same data for a run to be resumed."""
  import hashlib
  digest = hashlib.sha256()
  for name in sorted(bench.splits):
    split = bench.splits[name]
    digest.update(name.encode())
    digest.update(np.ascontiguousarray(split.y).tobytes())
    digest.update(np.ascontiguousarray(split.num_examples).tobytes())
    x = np.asarray(split.x)
    sums = x.reshape(x.shape[0], -1).sum(1, dtype=np.float64)
    digest.update(np.round(sums, 3).tobytes())
  return digest.hexdigest()


def check_same_data(path: str, digest: str) -> None:
  """Refuses to reuse a run directory whose recorded data differs from the data just
  built (a changed benchmark, source file or data_dir): its checkpoints were trained
  on other clients."""
  if not os.path.exists(path):
    return
  with open(path) as f:
    recorded = json.load(f).get('data_digest')
  if recorded is not None and recorded != digest:
    raise ValueError(f'{os.path.dirname(path)} was trained on other data than this config '
                     f'builds now (partition.json data_digest {recorded[:12]}… vs '
                     f'{digest[:12]}…: the benchmark code, its source files or data_dir '
                     f'changed); use a new --workdir')


def setup_run(config: ml_collections.ConfigDict, workdir: str, algorithm_name: str, seed: int,
              bench: Optional[Benchmark] = None, algorithm=None,
              programs: Optional[Dict] = None, backbone: Optional[dict] = None,
              log_state: Optional[Callable] = None,
              depends_on: Optional[Dict[str, object]] = None,
              max_round: Optional[int] = None,
              built: Optional[Programs] = None) -> OpenedRun:
  """Opens one (method, seed) run: checks ``workdir``, builds the data (unless given),
  writes partition.json, builds (or reuses from ``programs``; or takes ``built``) the
  method, its compiled round and evaluation, initialises the state (from the pretrained encoder
  ``backbone`` when given: pipelines/pretrain.py) and restores it from the latest
  checkpoint."""
  fields = checked_fields(workdir, config, algorithm_name, config.resume, depends_on)
  os.makedirs(workdir, exist_ok=True)
  if bench is None:
    bench = build_data(config, seed)
  else:
    validate_benchmark(bench)
  train = bench.splits['train']
  eval_splits = {name: s for name, s in bench.splits.items() if name != 'train'}
  if config.sampling == 'num_examples' and (train.num_examples > 0).sum() < config.cohort_size:
    raise ValueError(f'config.cohort_size={config.cohort_size} exceeds the '
                     f'{(train.num_examples > 0).sum()} clients that have examples')
  stats = {name: federated.partition_statistics(s, bench.num_classes)
           for name, s in bench.splits.items()}
  digest = data_digest(bench)
  distributed.primary_decides(lambda: check_same_data(os.path.join(workdir, 'partition.json'),
                                                      digest),
                              f'the check of {workdir}/partition.json')
  with distributed.open_output(os.path.join(workdir, 'partition.json')) as f:
    json.dump({'statistics': stats, 'info': bench.info, 'data_digest': digest,
               'num_examples': {n: s.num_examples.tolist() for n, s in bench.splits.items()}},
              f, indent=1)
  s = stats['train']
  log.info('%s seed %d: %d clients, %d train examples (%d-%d per client, %.1f classes/client)',
           algorithm_name, seed, s['clients'], s['examples'], s['examples_per_client_min'],
           s['examples_per_client_max'], s['classes_per_client_mean'])

  module = models.create(config.model, bench.num_classes)
  # Splits whose client k is a new client, not training client k (UPFL): no personalised
  # model of their own; personalised methods are scored there as PFL-Sampled/-Ensemble.
  new_client_splits = sorted(bench.info.get('new_clients', {}))
  key = plan = None
  if built is None and algorithm is None and programs is not None:
    key = program_key(config, algorithm_name, bench, programs)
    plan = key.round
  if built is None and key is not None:
    built = (programs or {}).get(key)
  if built is None:
    built = build_programs(config, algorithm_name, module, bench, algorithm, new_client_splits,
                           round_plan=plan)
    if key is not None:
      programs[key] = built
  algorithm = built.algorithm
  init_key, train_key, eval_key = run_keys(seed)
  server_state = algorithm.init(init_key, jnp.asarray(train.x[0, :1]))
  if backbone is not None:
    server_state = pretrain.with_backbone(server_state, backbone, algorithm_name)
  client_states = stack_client_states(algorithm, server_state, train.num_clients)
  upload = uploaded_by_part(algorithm, server_state, client_states, train)

  opened = open_run(workdir, config, fields, (server_state, client_states, jnp.float32(0.0)),
                    max_round)
  server_state, client_states, elapsed = opened.state
  if replicated(config) is not None:
    server_state, client_states = jax.device_put((server_state, client_states),
                                                 replicated(config))

  def evaluate(state) -> Dict[str, float]:
    server_state, client_states = state
    if not eval_splits:
      return {}
    per_client = evaluation.evaluate_models(
        built.evaluate_chunk, server_state, client_states, train, eval_splits, eval_key,
        config.engine.eval_chunk_size)
    if built.adapted_chunk is not None:
      test_splits = {n: s for n, s in eval_splits.items()
                     if n.startswith(tuple(config.eval_adapter_splits))}
      per_client.update(evaluation.evaluate_models(
          built.adapted_chunk, server_state, client_states, train, test_splits, eval_key,
          config.engine.eval_chunk_size))
    if built.new_client_chunk is not None:
      per_client.update(evaluate_new_clients(
          built.new_client_chunk, server_state, client_states, train,
          {n: eval_splits[n] for n in new_client_splits}, eval_key, seed,
          config.engine.eval_chunk_size))
    summary = evaluation.summarize(per_client, bench.info.get('client_groups'))
    if diagnose is not None:
      summary.update(diagnose(algorithm.global_model(server_state), eval_splits, bench.info,
                              config.engine.eval_batch_size))
    return summary

  # Method-specific measurements of the global model (FedIns' key selection).
  diagnostics = algorithms.base.ALGORITHMS.meta(algorithm_name).get('diagnostics')
  diagnose = diagnostics(module) if diagnostics and algorithm.global_model else None
  run = loop.Run(f'{algorithm_name} seed {seed}', workdir, opened.checkpointer, opened.writer,
                 opened.start_round, float(elapsed), evaluate,
                 (lambda state: log_state(state[0])) if log_state is not None else None)
  return OpenedRun(run, bench, built, train_key, upload, (server_state, client_states))


def run_keys(seed: int):
  """(init, train, eval) keys of seed ``seed``'s run."""
  seed_key = jax.random.key(seed)
  return tuple(jax.random.fold_in(seed_key, i) for i in range(3))


def build_programs(config: ml_collections.ConfigDict, algorithm_name: str, module,
                   bench: Benchmark, algorithm: Optional[FederatedAlgorithm],
                   new_client_splits: List[str], check: bool = True,
                   round_plan: Optional[RoundConfig] = None) -> Programs:
  """The method (the registered ``algorithm_name`` unless ``algorithm`` is given), its
  compiled round (planned by ``round_plan``, or for ``bench``'s training split alone)
  and its evaluation functions (``check=False``: a config whose swept numbers are
  tracers, pipelines/sweep.py)."""
  train = bench.splits['train']
  if algorithm is None:
    algorithm = algorithms.build(algorithm_name, config, module, train.max_examples,
                                 bench.info, train.num_clients, train.x.shape[2:],
                                 check=check)
  round_device, round_host = build_round(algorithm, round_plan or round_config(
                                             config, train, algorithm_name),
                                         client_mesh(config.engine.num_devices)
                                         if config.engine.num_devices else None,
                                         donate=config.engine.donate,
                                         backend=round_backend(config),
                                         rounds_per_call=config.engine.rounds_per_call)
  evaluate_chunk = evaluation.build_evaluate(algorithm, module, config.engine.eval_batch_size,
                                             new_client_splits)
  adapted_chunk = None
  if algorithm_name in tuple(config.eval_adapter_algorithms):
    adapted_chunk = build_eval_adapters(config, module, bench.num_classes, algorithm,
                                        new_client_splits, algorithm_name, train.x.shape[2:])
  new_client_chunk = None
  if new_client_splits and algorithm.personalize is not None:
    new_client_chunk = evaluation.build_new_client_evaluate(algorithm, module,
                                                            config.engine.eval_batch_size)
  return Programs(module, algorithm, round_device, round_host, evaluate_chunk, adapted_chunk,
                  new_client_chunk)


def replicated(config: ml_collections.ConfigDict):
  """Where the device store and the initial states go: the default device, or, over
  several processes, replicated on the global mesh of ``engine.num_devices``."""
  if jax.process_count() == 1:
    return None
  return NamedSharding(client_mesh(config.engine.num_devices), PartitionSpec())


def cohort_sharding(config: ml_collections.ConfigDict):
  """The host store's cohort placement over several processes: sharded by client on
  the global mesh, each process moving its own devices' clients (None: one process)."""
  if jax.process_count() == 1:
    return None
  return NamedSharding(client_mesh(config.engine.num_devices), PartitionSpec('clients'))


def examples_per_step(config: ml_collections.ConfigDict, algorithm_name: str) -> int:
  """Examples one local step of a round touches over the cohort (the progress bar's
  examples/s): the method's own batch size (``client_batch_size``) × cohort."""
  client = (algorithms.base.method_client(config, algorithm_name) if algorithm_name
            else config.client)
  return client.batch_size * config.cohort_size


def single_run_trainer(config: ml_collections.ConfigDict, programs: Programs,
                       train: federated.FederatedData, train_key: jax.Array,
                       host_store: Optional[HostStore], algorithm_name: str = ''
                       ) -> loop.Trainer:
  """The loop's Trainer of one run: the compiled round over the device store (R rounds
  per call with ``engine.rounds_per_call``) or over cohorts gathered from
  ``host_store``."""
  per_call = config.engine.rounds_per_call
  device_train = None
  if host_store is None:   # several processes: a replicated global array on the mesh
    device_train = jax.device_put(train, replicated(config))

  def advance(state, start: int, stop: int):
    server_state, client_states = state
    if per_call == 1:
      key = round_key(train_key, start)
      if host_store is not None:
        cohort, cohort_ids = host_store.cohort(start)
        out = programs.round_host(server_state, client_states, cohort, cohort_ids, key)
      else:
        out = programs.round_device(server_state, client_states, device_train, key)
      return (out.server_state, out.client_states), loop.one_round(
          out.metrics, loop.round_metric_names(out.metrics))
    count = stop - start
    indices = start + jnp.minimum(jnp.arange(per_call), count - 1)
    keys = jax.vmap(lambda r: round_key(train_key, r))(indices)
    out = programs.round_device(server_state, client_states, device_train, keys,
                                jnp.arange(per_call) < count)
    metrics = {name: np.asarray(out.metrics[name])[:count, None]
               for name in loop.round_metric_names(out.metrics)}
    return (out.server_state, out.client_states), metrics

  return loop.Trainer(advance, loop.only_run, per_call,
                      examples_per_step(config, algorithm_name))


def finish_run(config: ml_collections.ConfigDict, workdir: str, algorithm_name: str,
               seed: int, outcome: loop.Outcome, upload: Dict[str, int], clock: CompileClock,
               **extra) -> Dict[str, object]:
  """Writes ``workdir``/results.json (with ``extra`` fields); returns it with the
  'server_state' (a diverged run: its ``diverged_record``)."""
  if outcome.diverged is not None:
    return diverged_record(config, workdir, algorithm_name, seed, outcome.diverged, **extra)
  # Every evaluated round's accuracies, for tables that report the test accuracy at the
  # round of best validation accuracy (FedTTA Sec. 4.1.3).
  result = {'algorithm': algorithm_name, 'seed': seed, 'metrics': outcome.summary,
            'evaluations': evaluated_rounds(workdir, config.rounds),
            'rounds': config.rounds, 'train_seconds': outcome.elapsed, 'hardware': hardware(),
            'uploaded_parameters': sum(upload.values()), 'uploaded_by_part': upload,
            'compile_seconds': round(clock.seconds, 3),
            'compilations': clock.compilations, **extra}
  adapters = applied_adapters(config, algorithm_name)
  if adapters:   # the test-time settings each adapted column used
    result['adapters'] = adapters
  with distributed.open_output(os.path.join(workdir, 'results.json')) as f:
    json.dump(result, f, indent=1)
  return {**result, 'server_state': outcome.state[0]}


def evaluate_new_clients(new_client_chunk, server_state, client_states,
                         train: federated.FederatedData, splits: Dict[str, federated.FederatedData],
                         key, seed: int, chunk_size: int) -> Dict[str, Dict[str, Dict]]:
  """PFL-Sampled and PFL-Ensemble sums on the new-client ``splits``: {model: {split:
  sums [K]}}. New client k's donor is a training client with data drawn uniformly
  (``numpy`` generator of [seed, 29], one draw per run, the same for every split)."""
  personalized_models, evaluate_chunk = new_client_chunk
  stacked = personalized_models(server_state, client_states, train, key)
  has_data = np.asarray(train.num_examples) > 0
  results: Dict[str, Dict[str, Dict]] = {}
  for name, split in splits.items():
    donors = np.random.default_rng([seed, 29]).choice(np.flatnonzero(has_data),
                                                      split.num_clients)
    sums = evaluation.evaluate_population(
        evaluate_chunk, (stacked, jnp.asarray(has_data)), (split, donors.astype(np.int32)),
        split.num_clients, key, chunk_size)
    for model, model_sums in sums.items():
      results.setdefault(model, {})[name] = model_sums
  return results


def evaluated_rounds(run_dir: str, rounds: int) -> List[Dict[str, float]]:
  """Every evaluated round's accuracies up to ``rounds``, from ``run_dir``'s
  metrics.jsonl, for tables that report the test accuracy at the round of best
  validation accuracy (FedTTA Sec. 4.1.3)."""
  return [{k: v for k, v in record.items() if k == 'round' or k.endswith('accuracy')}
          for record in read_metrics(os.path.join(run_dir, 'metrics.jsonl'))
          if any(k.endswith('/accuracy') for k in record) and record['round'] <= rounds]


def settled_divergence(run_dir: str, rounds: int) -> Optional[DivergenceError]:
  """The divergence within ``rounds`` that ``run_dir``'s diverged.json records (None:
  none), which re-training would meet again (training is deterministic). The record
  must belong to the run it sits in: its fingerprint that of the run's run.json, its
  round past the run's newest checkpoint (a run keeps no checkpoint once diverged);
  else it is refused naming the file. Deleting the file retrains the run."""
  marker = os.path.join(run_dir, loop.DIVERGED_FILE)
  if not os.path.exists(marker):
    return None
  advice = 'delete it to train the run again'
  recorded = read_json(marker, advice)
  if not (isinstance(recorded, dict) and isinstance(recorded.get('round'), int) and
          recorded['round'] >= 1 and isinstance(recorded.get('error'), str)):
    raise workdir_lib.RunMismatchError(
        f'{marker} is not a record of a diverged run ({{"round": a round >= 1, "error": the '
        f'message, "fingerprint": the run\'s}}); {advice}.')
  own = loop.run_fingerprint(run_dir)
  if own is None or recorded.get('fingerprint', own) != own:
    raise workdir_lib.RunMismatchError(
        f'{marker} belongs to another run: its fingerprint is not the one of '
        f'{os.path.join(run_dir, "run.json")}' + (' (absent)' if own is None else '') +
        f'; {advice}.')
  kept = workdir_lib.checkpoint_rounds(run_dir)
  if kept and kept[-1] >= recorded['round']:
    raise workdir_lib.RunMismatchError(
        f'{marker} says the run diverged in round {recorded["round"]}, but the run holds a '
        f'checkpoint of round {kept[-1]} (a diverged run keeps none past its divergence): '
        f'it belongs to another run; {advice}.')
  return DivergenceError(recorded['error']) if recorded['round'] <= rounds else None


def settled_divergences(run_dirs: Sequence[str], rounds: int) -> Dict[int, DivergenceError]:
  """{index in ``run_dirs``: its ``settled_divergence``} of the runs that have one,
  read by process 0 and the same on every process (``distributed.primary_decides``)."""
  def read() -> Dict[int, str]:
    errors = {i: settled_divergence(run_dir, rounds) for i, run_dir in enumerate(run_dirs)}
    return {i: str(error) for i, error in errors.items() if error is not None}
  decided = distributed.primary_decides(read, f'the divergence records of {list(run_dirs)}')
  return {int(i): DivergenceError(error) for i, error in decided.items()}   # JSON: str keys


def log_settled(run_dir: str) -> None:
  log.info('%s: diverged before (%s); recorded again, not retrained (delete it to retrain)',
           run_dir, loop.DIVERGED_FILE)


def diverged_record(config: ml_collections.ConfigDict, run_dir: str, name: str, seed: int,
                    error: DivergenceError, **extra) -> Dict:
  """The record of a diverged run (with ``extra`` fields: a swept run's point), also
  written to ``run_dir``/results.json."""
  record = {'algorithm': name, 'seed': seed, 'metrics': {}, 'diverged': str(error),
            'rounds': config.rounds, 'train_seconds': float('nan'), **extra}
  with distributed.open_output(os.path.join(run_dir, 'results.json')) as f:
    json.dump(record, f, indent=1)
  return record




# Runs as one program: the points of a hyperparameter sweep (``config.sweep``,
# pipelines/sweep.py) and, with ``config.engine.vmap_seeds=True``, the seeds of a method
# train in lockstep, the compiled round ``vmap``ped over a leading run axis of the
# stacked server states and client states (points × seeds), the swept numbers and the
# seeds' training data and round keys, so P points × S seeds are one XLA call per round
# instead of P·S. The points of one seed share its data (not copied per point).
#
# Each run keeps what a sequential run has: its own data (built from its seed), init,
# round keys, run directory, checkpoints, metrics.jsonl and results.json; evaluation runs
# per run on its slice of the stacked state, through one compiled evaluation whose swept
# numbers are arguments. The results equal the sequential runs' (tests/test_vmap_seeds.py,
# tests/test_sweep.py).
#
# What it needs: every vmapped seed's data of one shape (``config.data.pad_to`` makes
# Dirichlet seeds shape-equal), the device store, one round per call, the vmapped round
# (not the loop backend), one device, and every run at the same round when resuming.
# vmap_seeds refuses the rest naming the field; a sweep without them trains its points
# one after another and says so. A run whose loss turns non-finite stops the pipeline
# naming it and its round, or, with ``on_divergence='continue'``, is recorded as diverged
# and leaves the other runs going.
def stack_runs(trees):
  """One pytree whose leaves are the trees' leaves stacked on a new leading axis."""
  return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def take_run(tree, index: int):
  """Run ``index``'s slice of a pytree stacked by ``stack_runs``."""
  return jax.tree.map(lambda leaf: leaf[index], tree)


# Raised while tracing a function whose traced number meets Python control flow or
# a conversion to a Python number: that field changes the program's structure.
TRACE_ERRORS = (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError,
                jax.errors.TracerIntegerConversionError, jax.errors.TracerArrayConversionError)


class NotTraceable(Exception):
  """A swept number cannot be traced in this method's round."""


def lockstep_problem(config: ml_collections.ConfigDict) -> Optional[str]:
  """Why runs of ``config`` cannot train as one vmapped program, or None."""
  if config.data.store != 'device':
    return "config.data.store='host' moves one cohort per run and round"
  if config.engine.rounds_per_call != 1:
    return 'config.engine.rounds_per_call > 1 scans rounds of one run'
  if config.engine.num_devices:
    return 'config.engine.num_devices shards one run over the devices'
  if round_backend(config) != 'vmap':
    return f'the {round_backend(config)!r} backend is a Python loop over clients'
  return None


class HyperparameterPrograms:
  """A method's programs with the swept float ``fields`` as traced arguments: one
  compilation serves every value. ``make(values)`` builds ``Programs`` from the config
  with those values (tracers inside ``jax.jit``; numbers for the per-value fallback,
  taken when tracing meets Python control flow, logged once)."""

  def __init__(self, make: Callable[[tuple], Programs], fields: Sequence[str], label: str):
    self.make, self.fields, self.label = make, tuple(fields), label
    self.failed: Dict[str, str] = {}
    self.jitted: Dict[str, Callable] = {}
    self.concrete: Dict[tuple, Programs] = {}

  def traced(self, pick: Callable[[Programs], Callable]) -> Callable:
    """(values, *args) -> ``pick(make(values))(*args)``, unjitted."""
    return lambda values, *args: pick(self.make(values))(*args)

  def _call(self, name: str, pick, values: tuple, args):
    if name not in self.failed:
      if name not in self.jitted:
        self.jitted[name] = jax.jit(self.traced(pick))
      try:
        return self.jitted[name](tuple(jnp.asarray(v) for v in values), *args)
      except TRACE_ERRORS as err:
        self.failed[name] = type(err).__name__
        log.info('config.sweep: %s uses %s in Python (%s): its %s compiles once per value',
                 self.label, ', '.join(self.fields), type(err).__name__, name)
    if values not in self.concrete:
      self.concrete[values] = self.make(values)
    return pick(self.concrete[values])(*args)

  def at(self, values: tuple, algorithm: FederatedAlgorithm, module) -> Programs:
    """The Programs of one point: its evaluation functions call the shared ones with
    ``values``; ``algorithm`` is the point's method built from numbers (init, models)."""
    def function(name, pick):
      return lambda *args: self._call(name, pick, values, args)
    built = self.make(values)   # which optional evaluations exist (no compilation)
    new_client = None
    if built.new_client_chunk is not None:
      new_client = (function('new_client_models', lambda p: p.new_client_chunk[0]),
                    function('new_client_evaluate', lambda p: p.new_client_chunk[1]))
    return Programs(module, algorithm, None, None,
                    function('evaluate', lambda p: p.evaluate_chunk),
                    function('adapted', lambda p: p.adapted_chunk)
                    if built.adapted_chunk is not None else None, new_client)


def grid_round(round_fn: Callable, num_points: int, num_seeds: int) -> Callable:
  """jit of (values [P] each, server [P·S, ...], clients [P·S, ...], data [S, ...],
  keys [S]) -> RoundOutput over P·S runs: ``round_fn(values, server, clients, data,
  key)`` vmapped over the seeds (inner) and the points (outer, sharing the data)."""
  over_seeds = jax.vmap(round_fn, in_axes=(None, 0, 0, 0, 0))
  over_points = jax.vmap(over_seeds, in_axes=(0, 0, 0, None, None))

  def split(tree):
    return jax.tree.map(lambda a: a.reshape((num_points, num_seeds) + a.shape[1:]), tree)

  def grid(values, server_states, client_states, data, keys):
    out = over_points(values, split(server_states), split(client_states), data, keys)
    return jax.tree.map(lambda a: a.reshape((num_points * num_seeds,) + a.shape[2:]), out)

  return jax.jit(grid)


def program_key(config: ml_collections.ConfigDict, name: str, bench: Benchmark,
                programs: Optional[Dict] = None) -> ProgramKey:
  """The key of method ``name``'s programs on ``bench``, shared by every seed of
  ``config`` whose shapes match (the round planned for all of their client sizes;
  ``programs``: the cache that keeps those sizes)."""
  train = bench.splits['train']
  return ProgramKey(name, train.x.shape, train.x.dtype.str, bench.num_classes,
                    json.dumps(algorithms.base.build_info(bench.info), sort_keys=True),
                    tuple(sorted(bench.info.get('new_clients', {}))),
                    round_config(config, train, name, seed_populations(config, programs)))


def hyperparameter_programs(config: ml_collections.ConfigDict, name: str, bench: Benchmark,
                            fields: Sequence[str], fixed: sweep.Point, programs: Dict
                            ) -> HyperparameterPrograms:
  """The (cached in ``programs``) HyperparameterPrograms of method ``name`` on
  ``bench``'s shapes, with the non-traced swept fields at ``fixed``."""
  base = sweep.with_values(config, fixed)
  shared = program_key(base, name, bench, programs)
  key = ('sweep', shared, tuple(fields), tuple(sorted(fixed.items())))
  if key not in programs:
    module = models.create(config.model, bench.num_classes)
    splits = sorted(bench.info.get('new_clients', {}))

    def make(values):
      return build_programs(sweep.with_values(base, dict(zip(fields, values))), name, module,
                            bench, None, splits, check=False, round_plan=shared.round)

    programs[key] = HyperparameterPrograms(make, fields, name)
  return programs[key]


def train_grid(config: ml_collections.ConfigDict, workdir: str, name: str,
               points: Sequence[sweep.Point], programs: Dict,
               backbone: Optional[dict] = None) -> List[Dict]:
  """Trains method ``name`` at every sweep point × seed of ``config``: the points
  that differ only in traced numbers (and, with ``engine.vmap_seeds``, the seeds) as
  one program; returns the per-run results (as ``train_and_evaluate`` does)."""
  keep_going = config.on_divergence == 'continue'
  problem = lockstep_problem(config)
  seed_groups = ([tuple(config.seeds)] if config.engine.vmap_seeds else
                 [(seed,) for seed in config.seeds])
  results = []
  for group in sweep.program_groups(config, points):
    group_points = [points[i] for i in group]
    fields = sweep.traced_fields(config, group_points)
    fixed = {p: v for p, v in group_points[0].items() if p not in fields}
    if fixed and len(points) > 1:
      log.info('config.sweep: %s changes %s\'s shapes or loop bounds: one program at %s',
               ', '.join(fixed), name, sweep.point_name(fixed))
    lockstep = problem is None and (len(group_points) > 1 or config.engine.vmap_seeds)
    if problem is not None and len(group_points) > 1:
      log.info('config.sweep: %s; the %d points of %s train one after another', problem,
               len(group_points), name)
    for seeds in seed_groups:
      try:
        if lockstep:
          results.extend(train_lockstep(config, workdir, name, group_points, fields, seeds,
                                        programs, backbone))
          continue
      except NotTraceable as err:
        log.info('config.sweep: %s; one program per value', err)
      for point in group_points:
        point_config = sweep.with_values(config, point)
        cache = programs.setdefault(('point', sweep.point_name(point)), {}) if point else \
            programs
        for seed in seeds:
          result = train_and_evaluate(point_config, sweep.run_dir(workdir, name, point, seed),
                                      name, seed, programs=cache, backbone=backbone,
                                      keep_going=keep_going)
          results.append({**result, 'sweep_point': point} if point else result)
  return results


def train_lockstep(config: ml_collections.ConfigDict, workdir: str, name: str,
                   points: Sequence[sweep.Point], fields: Sequence[str], seeds: Sequence[int],
                   programs: Dict, backbone: Optional[dict] = None) -> List[Dict]:
  """Trains ``points`` × ``seeds`` of method ``name`` as one vmapped program (the
  points differ only in the traced ``fields``); NotTraceable when a field cannot be
  traced in the round (nothing trained then).

  With ``config.on_divergence='continue'`` a run that diverged before (its
  ``settled_divergence``) is recorded again without training: a
  point whose every seed diverged leaves the program, and a diverged seed of another
  point keeps its place with a copy of a live run's state, neither trained on nor
  saved. The others resume at the newest round they all have, not at the diverged
  run's last checkpoint. Points already trained to ``config.rounds`` are evaluated by
  a call of their own, apart from points still to train."""
  runs = [(point, seed) for point in points for seed in seeds]
  run_dirs = [sweep.run_dir(workdir, name, point, seed) for point, seed in runs]
  distributed.require_in_step(f'{name} points {[sweep.point_name(p) for p in points]} '
                              f'seeds {list(seeds)}')
  settled = (settled_divergences(run_dirs, config.rounds)
             if config.on_divergence == 'continue' else {})
  extra = {'vmapped_seeds': list(seeds)} if config.engine.vmap_seeds else {}

  def record(i: int, outcome: loop.Outcome, upload, clock) -> Dict:
    point, seed = runs[i]
    return finish_run(sweep.with_values(config, point), run_dirs[i], name, seed, outcome,
                      upload, clock, **extra,
                      **({'sweep_point': point, 'vmapped_points': len(points)} if point
                         else {}))

  num_seeds = len(seeds)
  live_runs = [[j * num_seeds + k for k in range(num_seeds) if j * num_seeds + k not in settled]
               for j in range(len(points))]     # per point
  live_points = [j for j in range(len(points)) if live_runs[j]]
  dropped = [i for i in sorted(settled) if not live_runs[i // num_seeds]]
  # Points whose every run already reached config.rounds (a grid extended by new
  # values) are evaluated apart, so that the new points do not rewind them.
  finished = [j for j in live_points if common_checkpoint_round(
      [run_dirs[i] for i in live_runs[j]], config.rounds) == config.rounds]
  groups = [g for g in (finished, [j for j in live_points if j not in finished]) if g]
  split = bool(dropped) or len(groups) > 1
  for i in dropped if split else sorted(settled):   # the calls below log the others
    log_settled(run_dirs[i])
  if split:
    done = {}
    for group in groups:
      group_results = train_lockstep(config, workdir, name, [points[j] for j in group],
                                     fields, seeds, programs, backbone)
      done.update(zip([j * num_seeds + k for j in group for k in range(num_seeds)],
                      group_results))
    return [done[i] if i in done else
            record(i, loop.Outcome({}, 0.0, None, settled[i]), None, None)
            for i in range(len(runs))]
  live = [i for i in range(len(runs)) if i not in settled]
  common = common_checkpoint_round([run_dirs[i] for i in live], config.rounds)
  benches = {seed: build_data(config, seed) for seed in seeds}
  fixed = {p: v for p, v in points[0].items() if p not in fields}
  values = [tuple(float(point[f]) for f in fields) for point in points]
  with CompileClock() as clock:
    opened: List[Optional[OpenedRun]] = []   # None: a settled divergence
    try:
      family = None
      for i, ((point, seed), run_dir) in enumerate(zip(runs, run_dirs)):
        if i in settled:
          opened.append(None)
          continue
        point_config = sweep.with_values(config, point)
        built = None
        if fields:
          bench = benches[seed]
          family = hyperparameter_programs(config, name, bench, fields, fixed, programs)
          train = bench.splits['train']
          module = models.create(config.model, bench.num_classes)
          algorithm = algorithms.build(name, point_config, module, train.max_examples,
                                       bench.info, train.num_clients, train.x.shape[2:])
          built = family.at(values[points.index(point)], algorithm, module)
        opened.append(setup_run(point_config, run_dir, name, seed, bench=benches[seed],
                                programs=programs, backbone=backbone, max_round=common,
                                built=built))
      first = opened[live[0]]
      check_lockstep(config, name, [opened[i] for i in live], seeds)
      if fields:
        round_fn = family.traced(lambda p: p.round_device)
      else:
        device_round = first.programs.round_device
        round_fn = lambda values, *args: device_round(*args)  # noqa: E731
      round_grid = grid_round(round_fn, len(points), len(seeds))
      stacked_values = tuple(jnp.stack([jnp.asarray(v[i]) for v in values])
                             for i in range(len(fields)))
      data = jax.device_put(stack_runs([jax.tree.map(np.asarray, benches[s].splits['train'])
                                        for s in seeds]))
      keys = [run_keys(seed)[1] for seed in seeds]
      state = stack_runs([first.state if o is None else o.state for o in opened])

      def round_keys(start: int):
        return jnp.stack([round_key(key, start) for key in keys])

      try:
        jax.eval_shape(round_grid, stacked_values, *state, data, round_keys(0))
      except TRACE_ERRORS as err:
        raise NotTraceable(f'{name} uses {", ".join(fields)} in Python ({type(err).__name__})'
                           ) from None

      def advance(state, start: int, stop: int):
        del stop
        out = round_grid(stacked_values, *state, data, round_keys(start))
        return (out.server_state, out.client_states), loop.one_round(
            out.metrics, loop.round_metric_names(out.metrics))

      trainer = loop.Trainer(advance, take_run, 1, examples_per_step(config, name))
      what = (f'{len(points)} points × ' if len(points) > 1 else '') + f'seeds {tuple(seeds)}'
      loop_runs = [loop.Run(f'{name} seed {seed}', run_dir, None, None, common, 0.0, None, None)
                   if o is None else o.run for o, (_, seed), run_dir in zip(opened, runs, run_dirs)]
      outcomes = loop.train(loop_runs, state, trainer, config.rounds, config.eval_every,
                            config.checkpoint_every, config.on_divergence == 'continue',
                            config.progress, f'{name} {what} (vmapped)', config.log_every,
                            settled=settled)
    finally:
      for o in opened:
        if o is not None:
          o.run.checkpointer.close()
  return [record(i, outcome, o and o.upload, clock)
          for i, (outcome, o) in enumerate(zip(outcomes, opened))]


def check_lockstep(config: ml_collections.ConfigDict, name: str, opened: Sequence[OpenedRun],
                   seeds) -> None:
  """Raises when the runs cannot share one program."""
  first = opened[0]
  shape = first.bench.splits['train'].x.shape
  key = program_key(config, name, first.bench)
  for other in opened[1:]:
    if program_key(config, name, other.bench) != key:
      raise ValueError(
          f'config.engine.vmap_seeds: {first.run.label} and {other.run.label} need different '
          f'programs (training data {shape} and {other.bench.splits["train"].x.shape}); set '
          f'config.data.pad_to to a bound on every client of every seed so that they share '
          f'one shape')
  rounds = {o.run.label: o.run.start_round for o in opened}
  if len(set(rounds.values())) > 1:   # common_checkpoint_round chose a round all have
    raise ValueError(f'config.engine.vmap_seeds: the runs resumed at different rounds '
                     f'{rounds}')


def common_checkpoint_round(run_dirs: Sequence[str], rounds: int) -> int:
  """The newest checkpointed round (<= ``rounds``) that every run of ``run_dirs`` has
  (0: none), where runs trained in lockstep resume: after a kill between the per-run
  saves, the runs ahead go back to it (training is deterministic, so they retrain the
  same rounds). A run that diverged is not among ``run_dirs`` (``train_lockstep``)."""
  def newest() -> int:
    kept = [set(r for r in workdir_lib.checkpoint_rounds(d) if r <= rounds) for d in run_dirs]
    return max(set.intersection(*kept) if kept else set(), default=0)
  return distributed.primary_decides(newest, f'the checkpoints of {len(run_dirs)} runs')


def run_dirs(config: ml_collections.ConfigDict, workdir: str):
  """[(run_dir, run config, own section)]: one run per method × sweep point × seed."""
  return [(sweep.run_dir(workdir, name, point, seed), sweep.with_values(config, point)
           if point else config, name)
          for name in algorithm_names(config) for point in sweep.method_points(config, name)
          for seed in config.seeds]


def check(config: ml_collections.ConfigDict) -> None:
  check_run(config)
  pretrain.check(config)
  sweep.check(config, check)


def backbone_for(config: ml_collections.ConfigDict, workdir: str) -> Optional[dict]:
  """The pretrained encoder of ``config.backbone`` for this run's model and data
  (None without one); pretrains it in ``<workdir>/backbone`` first if asked."""
  if not config.backbone.weights:
    return None
  bench = build_data(config, config.seeds[0])
  module = models.create(config.model, bench.num_classes)
  return pretrain.backbone_encoder(config, workdir, module,
                                   jnp.asarray(bench.splits['train'].x[0, :1]))


def data_summary(config: ml_collections.ConfigDict, run_dirs: Dict[str, List[str]]) -> str:
  """'<benchmark>: <clients> clients, <examples> train examples (<min>-<max> per
  client)' as the first run's partition.json recorded them (seed 0's data), preceded by
  the source and partition for a benchmark that deals a pooled source by
  ``data.partition``."""
  data = config.data
  parts = []
  if BENCHMARKS.meta(data.benchmark).get('partitioned'):
    alpha = f' α={data.dirichlet_alpha}' if data.partition == 'dirichlet' else ''
    parts += [data.source, f'partition {data.partition}{alpha}']
  first = next((dirs[0] for dirs in run_dirs.values() if dirs), None)
  path = first and os.path.join(first, 'partition.json')
  if path and os.path.exists(path):
    with open(path) as f:
      train = json.load(f)['statistics']['train']
    parts += [f"{train['clients']} clients", f"{train['examples']} train examples "
              f"({train['examples_per_client_min']}-{train['examples_per_client_max']} per "
              f"client, seed {config.seeds[0]})"]
  return f"{data.benchmark}: {', '.join(parts)}" if parts else data.benchmark


@PIPELINES.register('federated', check=check, run_dirs=run_dirs)
def run(config: ml_collections.ConfigDict, workdir: str) -> Results:
  """Every method × seed of ``config`` (validated by ``pipelines.run``); writes
  results.csv and curves.png. ``records``: 'results' (one dict per run), 'table'
  (the report table: header, rows, markdown), 'paper_tables' (markdown or '')."""
  info = hardware()
  results: List[Dict] = []       # per run; of a swept method, its selected point's
  all_results: List[Dict] = []   # per run, every point
  run_dirs: Dict[str, List[str]] = {}
  programs: Dict = {}  # compiled once per method and data shapes, reused across seeds
  backbone = backbone_for(config, workdir)
  selected: Dict[str, tuple] = {}   # method -> (selected point index, per-point summaries)
  notes: List[str] = []   # points of a narrowed grid on disk that validate better
  selection_metrics: Dict[str, str] = {}   # method -> the validation metric it was selected on
  selected_cells: Dict[str, str] = {}   # method -> its selected point ('(grid edge)' marked)
  for name in algorithm_names(config):
    points = sweep.method_points(config, name)
    if points == [{}] and not config.engine.vmap_seeds:
      mine = [train_and_evaluate(config, os.path.join(workdir, name, f'seed_{seed}'), name,
                                 seed, programs=programs, backbone=backbone,
                                 keep_going=config.on_divergence == 'continue')
              for seed in config.seeds]
    else:
      mine = train_grid(config, workdir, name, points, programs, backbone)
    if points != [{}]:
      metric = selection_metrics[name] = sweep.validation_metric(
          config, [k for r in mine for k in r['metrics']], name)
      selected[name] = sweep.select(mine, points, metric, config.sweep_select)
      best = points[selected[name][0]]
      log.info('config.sweep: %s selects %s (validation %s, %s)', name,
               sweep.point_name(best), metric, config.sweep_select)
      chosen = selected[name][1][selected[name][0]]
      edges = report.grid_edges(points, best)
      selected_cells[name] = sweep.point_name(best) + (' (grid edge)' if edges else '')
      if edges:
        log.warning('config.sweep: %s', report.edge_note(name, edges))
      for hidden in sweep.better_off_grid(workdir, name, points, config.seeds, chosen, metric,
                                          config.sweep_select):
        notes.append(f'{name}: {hidden["name"]}, trained in this workdir outside this grid, '
                     f'has validation {100 * hidden["validation_mean"]:.2f} > the selected '
                     f'{chosen["name"]}\'s {100 * chosen["validation_mean"]:.2f} ({metric}); '
                     f'add its values to config.sweep to select among them')
        log.warning('config.sweep: %s', notes[-1])
      mine_all, mine = mine, [r for r in mine if r.get('sweep_point') == best]
      all_results.extend(mine_all)
    else:
      all_results.extend(mine)
    results.extend(mine)
    run_dirs[name] = [sweep.run_dir(workdir, name, points[selected[name][0]] if name in selected
                                    else {}, seed) for seed in config.seeds]
  grid = None
  if selected:
    record = sweep.grid_record(selection_metrics, config.sweep_select, selected)
    if distributed.is_primary():
      sweep.write(workdir, record)
    grid = report.sweep_grid_table(record) + ''.join(f'\n\nNote: {note}' for note in notes)
  table = report.results_table(results)
  if selected:
    table = report.with_selected_points(table, selected_cells)
  preamble = (f"Benchmark {data_summary(config, run_dirs)}, {config.rounds} rounds, cohort "
              f"{config.cohort_size}; accuracy (%) mean ± std over seeds {tuple(config.seeds)}; "
              f"hardware: {info['device_kind']} ({info['backend']}).")
  files = ((report.write_csv(table, os.path.join(workdir, 'results.csv')),
            report.plot_curves(run_dirs, os.path.join(workdir, 'curves.png'),
                               title=f'{config.data.benchmark}, {config.rounds} rounds, cohort '
                                     f'{config.cohort_size}, seeds {tuple(config.seeds)}'))
           if distributed.is_primary() else ())
  paper_tables = report.paper_table(config, {'results': results})
  tables = ((table['markdown'],) + ((grid,) if grid else ()) +
            ((paper_tables,) if paper_tables else ()))
  return Results(preamble, tables, files,
                 {'results': results, 'table': table, 'paper_tables': paper_tables,
                  'all_results': all_results, 'sweep_grid': grid or ''})
