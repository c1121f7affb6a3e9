"""A trained run out of a workdir, for analysis in Python: the config it ran with, its
data rebuilt from that config and seed, the Flax module, the method and its state
restored from a kept checkpoint, its extras (ATP's α and learned rates, a pretrained
backbone), metrics and partition. Every pipeline's runs load:

    run = load_run(workdir, 'fedbn', seed=0)              # federated: plain runs, sweep
                                                          # points, vmapped seeds
    run = load_run(workdir, 'atp', seed=0, shift='hybrid')   # ATP: α training (the
                                                          # pretraining method's name: its run)
    run = load_run(workdir, 'hetero_fedtta_lambda1', seed=0)   # HeteroFedTTA, one λ
    backbone = load_backbone(workdir)                     # the pretrain pipeline's encoder
    logits, _ = models.apply(run.module, run.global_variables, x)

Reads only (the checkpoint library may move a damaged checkpoint aside, as a re-run
would). A workdir without that method, seed, shift or point, or a round that was not
kept, is one error naming what the workdir has. A checkpoint also reads without the
library's templates: ``checkpoint.read(<run>/checkpoints)`` is a nested dict named by
the state's fields.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

import jax.numpy as jnp
import ml_collections
from flax import traverse_util

from fedjax_shift import algorithms, checkpoint, models, report
from fedjax_shift.benchmarks import Benchmark, build_benchmark
from fedjax_shift.core.algorithm import FederatedAlgorithm
from fedjax_shift.core.groups import init_group_states
from fedjax_shift.core.round import stack_client_states
from fedjax_shift.metrics import read_metrics
from fedjax_shift.pipelines import atp, hetero, pretrain, sweep
from fedjax_shift.pipelines import workdir as workdir_lib
from fedjax_shift.pipelines.programs import build_programs
from fedjax_shift.pipelines.run_config import algorithm_names, check_eval_adapters
from fedjax_shift.pipelines.runs import build_data, run_keys
from fedjax_shift.pipelines.single_run import run_evaluation


class LoadedRun(NamedTuple):
  """One (method, seed[, point]) run restored from its checkpoint of ``round``."""
  config: ml_collections.ConfigDict   # as it ran (a sweep point's values set)
  run_dir: str
  round: int                          # the round of the checkpoint restored
  bench: Benchmark                    # its data: splits of [K, N, ...] client arrays
  module: Any                         # the Flax classifier (models.apply runs it)
  algorithm: FederatedAlgorithm       # the built method (init, client_update, ...)
  server_state: Any                   # the method's server state after ``round``
  client_states: Any                  # per-client states, leaves [K, ...]
  global_variables: Any               # algorithm.global_model(server_state), or None
  metrics: List[Dict]                 # metrics.jsonl, one record per round
  results: Optional[Dict]             # results.json (None: the run has not finished)
  partition: Dict                     # partition.json: per-split statistics, examples
  extras: Dict[str, Any]              # the method's extras: 'alpha' {module: α},
                                      # 'learned_rates' {row: {rate: value}} and the
                                      # 'target' clients' data (ATP), 'setup' (hetero),
                                      # 'backbone' (the encoder variables it started from)
  method: str = ''                    # the method's name (a run directory's)
  seed: int = 0


def _names(directory: str, keep=lambda name: True) -> List[str]:
  return sorted(n for n in os.listdir(directory) if keep(n)) if os.path.isdir(directory) else []


def run_directory(workdir: str, method: str, seed: int,
                  point: Optional[Dict[str, Any]] = None) -> str:
  """``<workdir>/<method>[/<point>]/seed_<seed>``; a swept method without ``point``
  is its selected point (sweep.json). FileNotFoundError naming what exists."""
  methods = _names(workdir, lambda n: os.path.isdir(os.path.join(workdir, n)) and
                   not n.startswith('.') and n not in ('backbone',))
  if method not in methods:
    raise FileNotFoundError(f'{workdir} holds no runs of {method!r}; its methods: {methods}')
  method_dir = os.path.join(workdir, method)
  points = _names(method_dir, lambda n: '=' in n)
  if point is None and points:
    selected = (report.read_sweep(workdir) or {}).get('methods', {}).get(method)
    if selected is None:
      raise FileNotFoundError(f'{method_dir} holds sweep points {points} and no selection '
                              f'(sweep.json): pass point=, e.g. {{"client.learning_rate": 0.1}}')
    point = selected['values']
  parent = os.path.join(method_dir, sweep.point_name(point)) if point else method_dir
  if point and not os.path.isdir(parent):
    raise FileNotFoundError(f'{method_dir} holds no point {sweep.point_name(point)}; its '
                            f'points: {points}')
  run_dir = os.path.join(parent, f'seed_{seed}')
  if not os.path.isdir(run_dir):
    raise FileNotFoundError(f'{parent} holds no seed {seed}; its seeds: '
                            f'{[int(n[5:]) for n in _names(parent, lambda n: n.startswith("seed_"))]}')
  return run_dir


def _read_json_or_none(path: str) -> Optional[dict]:
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def _chosen(kind: str, value, options: List, where: str):
  """``value`` if it is one of ``options`` (the only one when None); else an error
  naming them."""
  if value is None and len(options) == 1:
    return options[0]
  if value not in options:
    raise FileNotFoundError(f'{where} holds no {kind} {value!r}; its {kind}s: {options}')
  return value


def restore(config: ml_collections.ConfigDict, run_dir: str, round: Optional[int],
            template: checkpoint.RunState, rounds: int) -> tuple:
  """(round, restored RunState, results or None) of the run in ``run_dir`` from its
  checkpoint of ``round`` (None: ``rounds``, the final one of a finished run)."""
  kept = workdir_lib.checkpoint_rounds(run_dir)
  results = _read_json_or_none(os.path.join(run_dir, 'results.json'))
  if round is None:
    if results is None or not kept or kept[-1] < rounds:
      raise FileNotFoundError(f'{run_dir} has not finished ({rounds} rounds; checkpoints of '
                              f'rounds {list(kept)}): pass round=, one of them')
    round = rounds
  if round not in kept:
    raise FileNotFoundError(f'{run_dir} kept no checkpoint of round {round}; its rounds: '
                            f'{list(kept)} (config.keep_checkpoints={config.keep_checkpoints})')
  checkpointer = checkpoint.Checkpointer(os.path.join(run_dir, 'checkpoints'), 1, len(kept))
  try:   # a reader leaves the workdir as it is: a damaged checkpoint is an error
    restored, state = checkpointer.restore(template, round, move_damaged=False)
  finally:
    checkpointer.close()
  if restored != round:
    raise FileNotFoundError(f'{run_dir}: orbax finds no checkpoint of round {round} (its '
                            f'folder lists rounds {list(kept)})')
  return round, state, results


def _load_tta_bench(workdir, config, method, seed, round) -> LoadedRun:
  """The test-time benchmark's source model of one seed; extras: 'tests' (its
  corrupted test sets, ``benchmarks.tta_corruptions.CorruptedTests``) and, once its
  rows ran, 'test_time' (test_time.json: accuracy per row, stream and corruption)."""
  source = algorithm_names(config)[0]
  _chosen('method', method, [source], f'{workdir} (the test-time benchmark)')
  seed = _chosen('seed', seed, list(config.seeds), workdir)
  seed_dir = os.path.join(workdir, f'seed_{seed}')
  data = build_benchmark(config.data, seed)
  extras = {'tests': data}
  record = _read_json_or_none(os.path.join(seed_dir, 'test_time.json'))
  if record is not None:
    extras['test_time'] = record
  return federated_run(config, os.path.join(seed_dir, 'pretrain'), source, seed, round,
                       data.source, models.create(config.model, data.source.num_classes),
                       extras=extras)


def federated_run(config: ml_collections.ConfigDict, run_dir: str, method: str, seed: int,
                  round: Optional[int], bench: Benchmark, module, algorithm=None,
                  backbone: Optional[dict] = None, extras: Optional[dict] = None) -> LoadedRun:
  """A run of the federated engine (``single_run.train_and_evaluate``) in ``run_dir``,
  restored into the state its method (``algorithm``, else built by name) initialises."""
  train = bench.splits['train']
  if algorithm is None:
    algorithm = algorithms.build(method, config, module, train.max_examples, bench.info,
                                 train.num_clients, train.example_shape)
  server_state = algorithm.init(run_keys(seed)[0], jnp.asarray(train.first_example()))
  if backbone is not None:
    server_state = pretrain.with_backbone(server_state, backbone, method)
  template = checkpoint.RunState(
      server_state, stack_client_states(algorithm, server_state, train.num_clients),
      jnp.float32(0.0))
  round, state, results = restore(config, run_dir, round, template, config.rounds)
  global_model = algorithm.global_model
  extras = dict(extras or {}, **({'backbone': backbone} if backbone is not None else {}))
  return LoadedRun(config, run_dir, round, bench, module, algorithm, state.server,
                   state.clients, global_model(state.server) if global_model else None,
                   read_metrics(os.path.join(run_dir, 'metrics.jsonl')), results,
                   _read_json_or_none(os.path.join(run_dir, 'partition.json')) or {}, extras,
                   method, seed)


def _load_federated(workdir, config, method, seed, round, point) -> LoadedRun:
  run_dir = run_directory(workdir, method, seed, point)
  if point is None and os.path.basename(os.path.dirname(run_dir)) != method:
    point = report.read_sweep(workdir)['methods'][method]['values']
  if point:
    config = sweep.with_values(config, point)
  bench = build_data(config, seed)
  module = models.create(config.model, bench.num_classes)
  return federated_run(config, run_dir, method, seed, round, bench, module,
                       backbone=pretrain.backbone_for(config, workdir))


def _load_atp(workdir, config, method, seed, round, shift) -> LoadedRun:
  """ATP's pretraining run (``method`` = the pretraining method) or its α training
  (``method='atp'``) of one shift and seed; extras: the learned α and rates."""
  shift = _chosen('shift', shift, list(config.tta.shifts), workdir)
  pretraining = algorithm_names(config)[0]
  _chosen('method', method, [pretraining, 'atp'], f'{workdir} (ATP\'s protocol)')
  seed = _chosen('seed', seed, list(config.seeds), f'{workdir} ({shift})')
  seed_dir = os.path.join(workdir, shift, f'seed_{seed}')
  shift_config = atp.for_shift(config, shift)
  data = build_benchmark(shift_config.data, seed)
  module = models.create(config.model, data.source.num_classes)
  backbone = None
  if config.backbone.weights:
    backbone = pretrain.load_encoder(config.backbone.weights, module,
                                     jnp.asarray(data.source.splits['train'].first_example()))
  extras = {name: values for name in ('alpha', 'learned_rates')
            if (values := _read_json_or_none(os.path.join(seed_dir, f'{name}.json'))) is not None}
  extras['target'] = data.target   # the target clients' test data (FederatedData)
  pre = federated_run(shift_config, os.path.join(seed_dir, 'pretrain'), pretraining, seed,
                      round if method == pretraining else None, data.source, module,
                      backbone=backbone, extras=extras)
  if method == pretraining:
    return pre
  alpha_config = atp.alpha_config(shift_config)
  val = data.source.splits['val']
  algorithm = algorithms.build('atp', alpha_config, module, val.max_examples,
                               global_variables=pre.global_variables)
  return federated_run(alpha_config, os.path.join(seed_dir, 'alpha'), 'atp', seed, round,
                       Benchmark({'train': val}, data.source.num_classes,
                                 data.source.example_shape, data.info),
                       module, algorithm, extras=extras)


def _load_hetero(workdir, config, method, seed, round) -> LoadedRun:
  """One λ's HeteroFedTTA run: the server state and each architecture group's client
  states ([K_g, ...] per group); the groups' architectures in ``algorithm.groups``."""
  names = {hetero.run_name(value): value for value in hetero.lambdas(config)}
  kd_lambda = names[_chosen('method', method, sorted(names), workdir)]
  run_dir = run_directory(workdir, method, seed)
  config = hetero.run_config(config, kd_lambda)
  bench = build_data(config, seed)
  parts = hetero.setup(config, bench, seed)
  init_key = run_keys(seed)[0]
  template = checkpoint.RunState(parts.algorithm.init(init_key),
                                 init_group_states(parts.algorithm, init_key, parts.group_ids),
                                 jnp.float32(0.0))
  round, state, results = restore(config, run_dir, round, template, config.rounds)
  return LoadedRun(config, run_dir, round, bench, None, parts.algorithm, state.server,
                   state.clients, None, read_metrics(os.path.join(run_dir, 'metrics.jsonl')),
                   results, _read_json_or_none(os.path.join(run_dir, 'partition.json')) or {},
                   {'setup': parts}, method, seed)


def load_run(workdir: str, method: str, seed: int, round: Optional[int] = None,
             point: Optional[Dict[str, Any]] = None, shift: Optional[str] = None) -> LoadedRun:
  """Run (``method``, ``seed``) of a workdir restored from its checkpoint of ``round``
  (None: the final round of a finished run). ``point``: a sweep point of the federated
  pipeline (default: the selected one); ``shift``: ATP's shift (default: the only one).
  Raises FileNotFoundError naming the methods, points, shifts, seeds or kept rounds the
  workdir has."""
  config = report.run_config(workdir)
  if config.pipeline == 'atp':
    return _load_atp(workdir, config, method, seed, round, shift)
  if config.pipeline == 'hetero':
    return _load_hetero(workdir, config, method, seed, round)
  if config.pipeline == 'tta_bench':
    return _load_tta_bench(workdir, config, method, seed, round)
  if config.pipeline == 'pretrain':
    raise ValueError(f'{workdir} is a run of the pretrain pipeline, a backbone alone: '
                     f'load_backbone({workdir!r}) reads it')
  return _load_federated(workdir, config, method, seed, round, point)


def evaluate(run: LoadedRun, adapters: Optional[Sequence[str]] = None) -> Dict[str, float]:
  """``run``'s evaluation at its round, as training evaluated it: {'<model>/<split>/
  <metric>': value} of every evaluation split (the global model; the personalised one
  where the method personalises, each client's after ``personalize``; new clients'
  PFL-Sampled and -Ensemble), the numbers of results.json's ``metrics`` at the final
  round (metrics.jsonl's at an evaluated one). ``adapters``: test-time adapters
  ``'<adapter>:<mode>'`` (e.g. ``('tent:episodic',)``) run on the method's models,
  adding '<model>+<adapter>/<split>/...' (None: the run's own ``config.eval_adapters``;
  (): none). For runs of the federated pipeline (ATP's and HeteroFedTTA's protocols
  evaluate in their own pipelines)."""
  if run.config.pipeline != 'federated' or not run.method:
    raise ValueError(f'evaluate takes a run of the federated pipeline; {run.run_dir} is '
                     f"the {run.config.pipeline} pipeline's, whose results.json holds its "
                     f'evaluation')
  config = ml_collections.ConfigDict(run.config.to_dict())
  if adapters is not None:
    config.eval_adapters = tuple(adapters)
    config.eval_adapter_algorithms = (run.method,) if adapters else ()
    check_eval_adapters(config)
  built = build_programs(config, run.method, run.module, run.bench, run.algorithm)
  evaluation = run_evaluation(config, run.method, built, run.bench, run_keys(run.seed)[2],
                              run.seed)
  return evaluation((run.server_state, run.client_states))


def load_backbone(workdir: str) -> dict:
  """The encoder parameters the pretrain pipeline (or a run with
  ``backbone.weights='pretrain'``) saved in ``<workdir>/backbone``, as a nested dict;
  ``<workdir>/backbone/backbone.json`` holds its record (source accuracy)."""
  flat = pretrain.read_backbone(pretrain.backbone_directory(workdir))
  return traverse_util.unflatten_dict({tuple(name.split('/')): value
                                       for name, value in flat.items()})
