"""One (method, seed) run trained from start to end (``train_and_evaluate``): the
federated pipeline's sequential runs, ATP's pretraining and α runs, the probes; and
what its lockstep runs (pipelines/lockstep.py) share with them around the training
loop.

``setup_run`` = ``open_run_dir`` (check the workdir, build the data, write
partition.json) + ``method_programs`` (build the method's programs or reuse them) +
``restore_state`` (initialise, then resume from the newest checkpoint) + the run's
evaluation (``run_evaluation``); ``finish_run`` writes results.json.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from fedjax_shift import algorithms, distributed, models
from fedjax_shift.benchmarks import Benchmark
from fedjax_shift.core.algorithm import FederatedAlgorithm
from fedjax_shift.core import evaluation
from fedjax_shift.core.round import HostStore, round_key, stack_client_states
from fedjax_shift.data import federated, store
from fedjax_shift.pipelines import loop, pretrain
from fedjax_shift.pipelines.base import CompileClock, hardware
from fedjax_shift.pipelines.opening import checked_fields, open_run
from fedjax_shift.pipelines.run_config import eval_chunk_size
from fedjax_shift.pipelines.programs import (Programs, applied_adapters, build_programs,
                                             examples_per_step, new_client_splits,
                                             program_key, round_config)
from fedjax_shift.pipelines.runs import (check_same_data, cohort_sharding,
                                         data_digest, diverged_record, evaluated_rounds,
                                         log_settled, replicated, run_keys,
                                         settled_divergences, shared_data, uploaded_by_part,
                                         validate_benchmark)

log = logging.getLogger('fedjax_shift')


class RunInputs(NamedTuple):
  """What a pipeline may give a run of its own (each None: the run's own).

  Attributes:
    bench: its data (default: built from ``config.data``; validated either way).
    algorithm: its method (default: the registered one with its ``config.<name>``).
    programs: a dict shared by the runs of one process: the built method, its round and
      its evaluation functions are kept there under a ``ProgramKey``, so a later seed with
      the same shapes reuses their compilations.
    backbone: the pretrained encoder to start from (``pretrain.backbone_for``).
    log_state: (server_state) -> fields added to every metrics.jsonl record (ATP: α per
      module).
    depends_on: what the trained state depends on outside ``config`` (ATP's α: the
      pretrained run's fingerprint and rounds), fingerprinted as ``depends_on.<key>``.
  """
  bench: Optional[Benchmark] = None
  algorithm: Optional[FederatedAlgorithm] = None
  programs: Optional[Dict] = None
  backbone: Optional[dict] = None
  log_state: Optional[Callable[[object], Dict[str, float]]] = None
  depends_on: Optional[Dict[str, object]] = None


class OpenedRun(NamedTuple):
  """One (method, seed) run opened and ready to train (``setup_run``)."""
  run: loop.Run
  bench: Benchmark
  programs: Programs
  train_key: jax.Array
  upload: Dict[str, int]       # numbers a client uploads per round, per update entry
  state: tuple                 # (server_state, client_states), restored or initial


def open_run_dir(config: ml_collections.ConfigDict, workdir: str, algorithm_name: str,
                 seed: int, bench: Optional[Benchmark] = None,
                 depends_on: Optional[Dict[str, object]] = None,
                 programs: Optional[Dict] = None) -> Tuple[dict, Benchmark]:
  """Checks ``workdir`` against ``config`` (pipelines/workdir.py), builds the data
  (unless given; validated either way; kept in ``programs`` for the next method:
  ``shared_data``), refuses data other than the run was trained on and writes
  partition.json. Returns (the run's checked fields, the benchmark)."""
  fields = checked_fields(workdir, config, algorithm_name, config.resume, depends_on)
  os.makedirs(workdir, exist_ok=True)
  if bench is None:
    bench = shared_data(config, seed, programs)
  else:
    validate_benchmark(bench)
  train = bench.splits['train']
  if config.sampling == 'num_examples' and (train.num_examples > 0).sum() < config.cohort_size:
    raise ValueError(f'config.cohort_size={config.cohort_size} exceeds the '
                     f'{(train.num_examples > 0).sum()} clients that have examples')
  stats = {name: store.split_statistics(s, bench.num_classes)
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
  return fields, bench


def method_programs(config: ml_collections.ConfigDict, algorithm_name: str, bench: Benchmark,
                    algorithm: Optional[FederatedAlgorithm] = None,
                    programs: Optional[Dict] = None) -> Programs:
  """Method ``algorithm_name``'s programs on ``bench``: reused from ``programs`` (the
  process's cache, under its ``ProgramKey``) when a run of the same shapes built them,
  else built (and kept there). A given ``algorithm`` is always built anew."""
  key = None
  if algorithm is None and programs is not None:
    key = program_key(config, algorithm_name, bench, programs)
    if key in programs:
      return programs[key]
  built = build_programs(config, algorithm_name, models.create(config.model, bench.num_classes),
                         bench, algorithm, round_plan=key and key.round)
  if key is not None:
    programs[key] = built
  return built


def restore_state(config: ml_collections.ConfigDict, workdir: str, fields: dict,
                  algorithm_name: str, built: Programs, train: federated.FederatedData,
                  init_key: jax.Array, backbone: Optional[dict] = None,
                  max_round: Optional[int] = None):
  """The method's initial state (from the pretrained encoder ``backbone`` when given:
  pipelines/pretrain.py), restored from ``workdir``'s newest checkpoint (up to
  ``max_round``). Returns (``opening.open_run``'s opened run, server_state,
  client_states, elapsed seconds, the numbers a client uploads per update entry)."""
  algorithm = built.algorithm
  server_state = algorithm.init(init_key, jnp.asarray(train.first_example()))
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
  return opened, server_state, client_states, float(elapsed), upload


def run_evaluation(config: ml_collections.ConfigDict, algorithm_name: str, built: Programs,
                   bench: Benchmark, eval_key: jax.Array, seed: int) -> Callable:
  """``evaluate((server_state, client_states))`` -> the flat metrics of every evaluation
  split: the models, the adapted models (``config.eval_adapters``), new clients'
  PFL-Sampled/-Ensemble and the method's diagnostics (FedIns' key selection)."""
  train = bench.splits['train']
  eval_splits = {name: s for name, s in bench.splits.items() if name != 'train'}
  new_clients = new_client_splits(bench)
  algorithm = built.algorithm
  diagnostics = algorithms.base.ALGORITHMS.meta(algorithm_name).get('diagnostics')
  diagnose = diagnostics(built.module) if diagnostics and algorithm.global_model else None

  def evaluate(state) -> Dict[str, float]:
    server_state, client_states = state
    if not eval_splits:
      return {}
    per_client = evaluation.evaluate_models(
        built.evaluate_chunk, server_state, client_states, train, eval_splits, eval_key,
        eval_chunk_size(config))
    if built.new_client_chunk is not None:
      per_client.update(evaluate_new_clients(
          built.new_client_chunk, server_state, client_states, train,
          {n: eval_splits[n] for n in new_clients}, eval_key, seed,
          eval_chunk_size(config)))
    summary = evaluation.summarize(per_client, bench.info.get('client_groups'))
    if diagnose is not None:
      summary.update(diagnose(algorithm.global_model(server_state), eval_splits, bench.info,
                              config.engine.eval_batch_size))
    return summary

  return evaluate


def setup_run(config: ml_collections.ConfigDict, workdir: str, algorithm_name: str, seed: int,
              inputs: RunInputs = RunInputs(), max_round: Optional[int] = None,
              built: Optional[Programs] = None) -> OpenedRun:
  """Opens one (method, seed) run: ``open_run_dir``, the method's programs (``built``
  when given, else ``method_programs``), ``restore_state`` (up to ``max_round``) and the
  run's evaluation, with what the pipeline gives it (``inputs``)."""
  fields, bench = open_run_dir(config, workdir, algorithm_name, seed, inputs.bench,
                               inputs.depends_on, inputs.programs)
  if built is None:
    built = method_programs(config, algorithm_name, bench, inputs.algorithm, inputs.programs)
  init_key, train_key, eval_key = run_keys(seed)
  opened, server_state, client_states, elapsed, upload = restore_state(
      config, workdir, fields, algorithm_name, built, bench.splits['train'], init_key,
      inputs.backbone, max_round)
  log_state = inputs.log_state
  run = loop.Run(f'{algorithm_name} seed {seed}', workdir, opened.checkpointer, opened.writer,
                 opened.start_round, elapsed,
                 run_evaluation(config, algorithm_name, built, bench, eval_key, seed),
                 (lambda state: log_state(state[0])) if log_state is not None else None)
  return OpenedRun(run, bench, built, train_key, upload, (server_state, client_states))


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, algorithm_name: str,
                       seed: int, inputs: RunInputs = RunInputs(), keep_going: bool = False
                       ) -> Dict[str, object]:
  """Trains one method with one seed in ``workdir`` (resuming if it holds a
  checkpoint); returns {'algorithm', 'seed', 'metrics', 'rounds', 'train_seconds',
  'compile_seconds', 'compilations', …, 'server_state'} ('server_state' is not written
  to results.json). 'compile_seconds': tracing, lowering and XLA compilation of every
  function the run compiled; 'compilations': how many XLA compilations it ran.

  ``inputs``: what a pipeline gives the run of its own (``RunInputs``: data, a method,
  shared compiled programs, a backbone, extra record fields, what the state depends on
  outside ``config``; ATP's α training uses them). ``keep_going``: a non-finite loss
  gives a diverged record instead of raising DivergenceError.

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
    opened = setup_run(config, workdir, algorithm_name, seed, inputs)
    train = opened.bench.splits['train']
    host_store = (HostStore(train, opened.train_key, round_config(config),
                            cohort_sharding(config))
                  if config.data.store == 'host' else None)
    try:
      trainer = single_run_trainer(config, opened.programs, train, opened.train_key,
                                   host_store, algorithm_name)
      outcome, = loop.train([opened.run], opened.state, trainer,
                            loop.Cadence.of(config, keep_going), f'{algorithm_name} seed {seed}')
    finally:
      if host_store is not None:
        host_store.close()
      opened.run.checkpointer.close()
  return finish_run(config, workdir, algorithm_name, seed, outcome, opened.upload, clock)


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


def evaluate_new_clients(new_client_chunk, server_state, client_states,
                         train: federated.FederatedData, splits: Dict[str, federated.FederatedData],
                         key, seed: int, chunk_size: int) -> Dict[str, Dict[str, Dict]]:
  """PFL-Sampled and PFL-Ensemble sums on the new-client ``splits``: {model: {split:
  sums [K]}}. New client k's donor is a training client with data drawn uniformly
  (``numpy`` generator of [seed, 29], one draw per run, the same for every split)."""
  personalized_models, evaluate_chunk = new_client_chunk
  # every training client's model at once (the ensemble needs them all): K padded clients
  stacked = personalized_models(server_state, client_states, store.padded(train), key)
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
  if outcome.stopped is not None:   # a callback's early stop: {'round', 'reason'}
    result['stopped'] = outcome.stopped
  adapters = applied_adapters(config, algorithm_name)
  if adapters:   # the test-time settings each adapted column used
    result['adapters'] = adapters
  with distributed.open_output(os.path.join(workdir, 'results.json')) as f:
    json.dump(result, f, indent=1)
  return {**result, 'server_state': outcome.state[0]}
