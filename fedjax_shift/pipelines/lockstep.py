"""Runs as one program: the points of a hyperparameter sweep (``config.sweep``,
pipelines/sweep.py) and, with ``config.engine.vmap_seeds=True``, the seeds of a method
train in lockstep, the compiled round ``vmap``ped over a leading run axis of the
stacked server states and client states (points × seeds), the swept numbers and the
seeds' training data and round keys, so P points × S seeds are one XLA call per round
instead of P·S. The points of one seed share its data (not copied per point).

Each run keeps what a sequential run has: its own data (built from its seed), init,
round keys, run directory, checkpoints, metrics.jsonl and results.json; evaluation runs
per run on its slice of the stacked state, through one compiled evaluation whose swept
numbers are arguments. The results equal the sequential runs' (tests/test_vmap_seeds.py,
tests/test_sweep.py).

What it needs: every vmapped seed's data of one shape (``config.data.pad_to`` makes
Dirichlet seeds shape-equal), the device store, one round per call, the vmapped round
(not the loop backend), one device, and every run at the same round when resuming.
vmap_seeds refuses the rest naming the field; a sweep without them trains its points
one after another and says so. A run whose loss turns non-finite stops the pipeline
naming it and its round, or, with ``on_divergence='continue'``, is recorded as diverged
and leaves the other runs going.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from fedjax_shift import algorithms, distributed, models
from fedjax_shift.benchmarks import Benchmark
from fedjax_shift.core.algorithm import FederatedAlgorithm
from fedjax_shift.core.round import round_key
from fedjax_shift.core.runs import grid_round, stack_runs, take_run
from fedjax_shift.data import store
from fedjax_shift.pipelines import callbacks, loop, sweep
from fedjax_shift.pipelines import workdir as workdir_lib
from fedjax_shift.pipelines.base import CompileClock
from fedjax_shift.pipelines.run_config import round_backend
from fedjax_shift.pipelines.programs import (Programs, build_programs, examples_per_step,
                                             program_key)
from fedjax_shift.pipelines.single_run import OpenedRun, RunInputs, finish_run, setup_run
from fedjax_shift.pipelines.runs import build_data, log_settled, run_keys, settled_divergences

log = logging.getLogger('fedjax_shift')

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
                    function('evaluate', lambda p: p.evaluate_chunk), new_client)


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

    def make(values):
      return build_programs(sweep.with_values(base, dict(zip(fields, values))), name, module,
                            bench, None, check=False, round_plan=shared.round)

    programs[key] = HyperparameterPrograms(make, fields, name)
  return programs[key]


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
  stopped = early_stopped(config, run_dirs, settled)
  finished = finished_points(config, run_dirs, live_runs, stopped)
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
  common = common_checkpoint_round([run_dirs[i] for i in live if i not in stopped],
                                   config.rounds)
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
                                       bench.info, train.num_clients, train.example_shape)
          built = family.at(values[points.index(point)], algorithm, module)
        opened.append(setup_run(point_config, run_dir, name, seed,
                                RunInputs(bench=benches[seed], programs=programs,
                                          backbone=backbone),
                                max_round=None if i in stopped else common, built=built))
      first = opened[live[0]]
      check_lockstep(config, name, [opened[i] for i in live], seeds,
                     [opened[i] for i in live if i not in stopped])
      if fields:
        round_fn = family.traced(lambda p: p.round_device)
      else:
        device_round = first.programs.round_device
        round_fn = lambda values, *args: device_round(*args)  # noqa: E731
      state = stack_runs([first.state if o is None else o.state for o in opened])
      trainer = grid_trainer(config, name, round_fn, values, fields, [benches[s] for s in seeds],
                             seeds, len(points), state)
      what = (f'{len(points)} points × ' if len(points) > 1 else '') + f'seeds {tuple(seeds)}'
      loop_runs = [loop.Run(f'{name} seed {seed}', run_dir, None, None, common, 0.0, None, None)
                   if o is None else o.run for o, (_, seed), run_dir in zip(opened, runs, run_dirs)]
      outcomes = loop.train(loop_runs, state, trainer, loop.Cadence.of(config),
                            f'{name} {what} (vmapped)', settled=settled)
    finally:
      for o in opened:
        if o is not None:
          o.run.checkpointer.close()
  return [record(i, outcome, o and o.upload, clock)
          for i, (outcome, o) in enumerate(zip(outcomes, opened))]


def finished_points(config: ml_collections.ConfigDict, run_dirs: Sequence[str],
                    live_runs: Sequence[Sequence[int]], stopped: Set[int]) -> List[int]:
  """The points (by index) with runs left whose every run already reached
  ``config.rounds`` (a grid extended by new values) or stopped early: evaluated apart, so
  that the new points do not rewind them (a stopped run resumes at its stop round, not at
  the others' common round)."""
  return [j for j, runs in enumerate(live_runs) if runs and common_checkpoint_round(
      [run_dirs[i] for i in runs if i not in stopped], config.rounds, config.rounds)
      == config.rounds]


def early_stopped(config: ml_collections.ConfigDict, run_dirs: Sequence[str],
                  settled: Dict[int, Any]) -> Set[int]:
  """The runs (by index) a callback stopped before ``config.rounds`` (their
  ``callbacks.STOPPED_FILE``), which stay there unless ``config.resume='extend'``."""
  if config.resume == 'extend':
    return set()
  return {i for i, marker in callbacks.read_stops(run_dirs).items()
          if i not in settled and marker['round'] < config.rounds}


def grid_trainer(config: ml_collections.ConfigDict, name: str, round_fn: Callable,
                 values: Sequence[Tuple[float, ...]], fields: Sequence[str],
                 benches: Sequence[Benchmark], seeds: Sequence[int], num_points: int,
                 state) -> loop.Trainer:
  """The loop's Trainer of a grid of ``num_points`` points (their traced ``values`` of
  ``fields``) × ``seeds`` (their data ``benches``) as one vmapped round; NotTraceable
  when ``round_fn`` uses a field in Python (checked by tracing one round on ``state``)."""
  round_grid = grid_round(round_fn, num_points, len(seeds))
  stacked_values = tuple(jnp.stack([jnp.asarray(v[i]) for v in values])
                         for i in range(len(fields)))
  trains = [bench.splits['train'] for bench in benches]
  data = jax.device_put(store.stack_stores(trains) if store.is_store(trains[0]) else
                        stack_runs([jax.tree.map(np.asarray, t) for t in trains]))
  keys = [run_keys(seed)[1] for seed in seeds]

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

  return loop.Trainer(advance, take_run, 1, examples_per_step(config, name))


def check_lockstep(config: ml_collections.ConfigDict, name: str, opened: Sequence[OpenedRun],
                   seeds, training: Sequence[OpenedRun]) -> None:
  """Raises when the runs cannot share one program, or those of them ``training`` (not
  stopped early) resumed at different rounds."""
  first = opened[0]
  shape = store.layout_key(first.bench.splits['train'])
  key = program_key(config, name, first.bench)
  for other in opened[1:]:
    if program_key(config, name, other.bench) != key:
      raise ValueError(
          f'config.engine.vmap_seeds: {first.run.label} and {other.run.label} need different '
          f'programs (training data {shape} and '
          f'{store.layout_key(other.bench.splits["train"])}); set '
          f'config.data.pad_to to a bound on every client of every seed so that they share '
          f'one shape')
  rounds = {o.run.label: o.run.start_round for o in training}
  if len(set(rounds.values())) > 1:   # common_checkpoint_round chose a round all have
    raise ValueError(f'config.engine.vmap_seeds: the runs resumed at different rounds '
                     f'{rounds}')


def common_checkpoint_round(run_dirs: Sequence[str], rounds: int, none: int = 0) -> int:
  """The newest checkpointed round (<= ``rounds``) that every run of ``run_dirs`` has
  (0: none; ``none`` when ``run_dirs`` is empty), where runs trained in lockstep resume:
  after a kill between the per-run saves, the runs ahead go back to it (training is
  deterministic, so they retrain the same rounds). A run that diverged or stopped early
  is not among ``run_dirs`` (``train_lockstep``)."""
  def newest() -> int:
    kept = [set(r for r in workdir_lib.checkpoint_rounds(d) if r <= rounds) for d in run_dirs]
    return max(set.intersection(*kept), default=0) if kept else none
  return distributed.primary_decides(newest, f'the checkpoints of {len(run_dirs)} runs')
