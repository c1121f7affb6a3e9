"""A trained run out of a workdir, for analysis in Python: the config it ran with, its
data rebuilt from that config and seed, the Flax module, the method and its state
restored from a kept checkpoint (the federated pipeline's runs: plain runs, sweep
points, vmapped seeds).

    from fedjax_shift.pipelines import load_run
    run = load_run('/tmp/fedjax_shift_default', 'fedbn', seed=0)
    logits, _ = models.apply(run.module, run.global_variables, x)

Reads only (the checkpoint library may move a damaged checkpoint aside, as a re-run
would). A workdir without that method, seed or point, or a round that was not kept,
is one error naming what the workdir has.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, NamedTuple, Optional

import jax.numpy as jnp
import ml_collections

from fedjax_shift import algorithms, checkpoint, models, report
from fedjax_shift.benchmarks import Benchmark
from fedjax_shift.core.algorithm import FederatedAlgorithm
from fedjax_shift.core.round import stack_client_states
from fedjax_shift.metrics import read_metrics
from fedjax_shift.pipelines import pretrain, sweep
from fedjax_shift.pipelines import workdir as workdir_lib
from fedjax_shift.pipelines.federated import backbone_for, build_data, run_keys


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


def load_run(workdir: str, method: str, seed: int, round: Optional[int] = None,
             point: Optional[Dict[str, Any]] = None) -> LoadedRun:
  """Run (``method``, ``seed``[, sweep ``point``]) of a federated-pipeline workdir,
  restored from its checkpoint of ``round`` (None: the final round of a finished run).
  Raises FileNotFoundError naming the methods, points, seeds or kept rounds the
  workdir has."""
  run_dir = run_directory(workdir, method, seed, point)
  config = report.run_config(workdir)
  if config.get('pipeline', 'federated') != 'federated':
    raise ValueError(f'{workdir} is a run of the {config.pipeline!r} pipeline; load_run reads '
                     f'the federated pipeline\'s runs')
  if point is None and os.path.basename(os.path.dirname(run_dir)) != method:
    point = report.read_sweep(workdir)['methods'][method]['values']
  if point:
    config = sweep.with_values(config, point)
  kept = workdir_lib.checkpoint_rounds(run_dir)
  results_path = os.path.join(run_dir, 'results.json')
  results = report.read_result(results_path) if os.path.exists(results_path) else None
  if round is None:
    if results is None or not kept or kept[-1] < config.rounds:
      raise FileNotFoundError(f'{run_dir} has not finished (config.rounds={config.rounds}; '
                              f'checkpoints of rounds {list(kept)}): pass round=, one of them')
    round = config.rounds
  if round not in kept:
    raise FileNotFoundError(f'{run_dir} kept no checkpoint of round {round}; its rounds: '
                            f'{list(kept)} (config.keep_checkpoints={config.keep_checkpoints})')
  bench = build_data(config, seed)
  train = bench.splits['train']
  module = models.create(config.model, bench.num_classes)
  algorithm = algorithms.build(method, config, module, train.max_examples, bench.info,
                               train.num_clients, train.x.shape[2:])
  server_state = algorithm.init(run_keys(seed)[0], jnp.asarray(train.x[0, :1]))
  backbone = backbone_for(config, workdir)
  if backbone is not None:
    server_state = pretrain.with_backbone(server_state, backbone, method)
  template = (server_state, stack_client_states(algorithm, server_state, train.num_clients),
              jnp.float32(0.0))
  checkpointer = checkpoint.Checkpointer(os.path.join(run_dir, 'checkpoints'), 1, len(kept))
  try:
    restored, (server_state, client_states, _) = checkpointer.restore(template, round)
  finally:
    checkpointer.close()
  if restored != round:
    raise FileNotFoundError(f'{run_dir}: the checkpoint of round {round} could not be read '
                            f'(moved to corrupt_checkpoints/); restored round {restored}')
  global_model = algorithm.global_model
  return LoadedRun(config, run_dir, round, bench, module, algorithm, server_state,
                   client_states, global_model(server_state) if global_model else None,
                   read_metrics(os.path.join(run_dir, 'metrics.jsonl')), results)
