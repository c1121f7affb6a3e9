"""What a run compiles: the round's plan for the training data, the method's round and
evaluation functions (``Programs``), the key under which the runs of one process share
them (``ProgramKey``), and the evaluation adapters of ``config.eval_adapters``.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import jax
import ml_collections
import numpy as np

from fedjax_shift import algorithms
from fedjax_shift.benchmarks import Benchmark
from fedjax_shift.core import evaluation
from fedjax_shift.core.algorithm import FederatedAlgorithm
from fedjax_shift.core.plan import (check_example_buckets, fit_client_chunk, fit_example_buckets,
                                    group_bounds, likely_group_bounds, plan_group_examples,
                                    population_steps, simulate_cohorts)
from fedjax_shift.core.round import RoundConfig, build_round, client_mesh
from fedjax_shift.core.test_time import ADAPTERS, SourceContext, client_runner
from fedjax_shift.data import federated, store
from fedjax_shift.pipelines.run_config import (adapted_algorithms, adapter_section, adapts,
                                               eval_adapter_specs, round_backend)
from fedjax_shift.pipelines.runs import data_key, shared_data


class ProgramKey(NamedTuple):
  """What a built method and its compiled programs depend on besides the config: runs
  with equal keys share them (``train_and_evaluate``'s ``programs``)."""
  algorithm: str
  train_shape: tuple           # the training split's layout (data.store.layout_key)
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
  evaluate_chunk: Callable     # evaluation.build_evaluate's (with config.eval_adapters)
  new_client_chunk: Optional[Callable]  # PFL-Sampled / -Ensemble on new clients, or None


def program_key(config: ml_collections.ConfigDict, name: str, bench: Benchmark,
                programs: Optional[Dict] = None) -> ProgramKey:
  """The key of method ``name``'s programs on ``bench``, shared by every seed of
  ``config`` whose shapes match (the round planned for all of their client sizes;
  ``programs``: the cache that keeps those sizes)."""
  train = bench.splits['train']
  return ProgramKey(name, store.layout_key(train), train.x.dtype.str, bench.num_classes,
                    json.dumps(algorithms.base.build_info(bench.info), sort_keys=True),
                    tuple(new_client_splits(bench)),
                    round_config(config, train, name, seed_populations(config, programs)))


def new_client_splits(bench: Benchmark) -> List[str]:
  """Splits whose client k is a new client, not training client k (UPFL): no
  personalised model of their own; personalised methods are scored there as
  PFL-Sampled/-Ensemble."""
  return sorted(bench.info.get('new_clients', {}))


def build_programs(config: ml_collections.ConfigDict, algorithm_name: str, module,
                   bench: Benchmark, algorithm: Optional[FederatedAlgorithm],
                   check: bool = True, round_plan: Optional[RoundConfig] = None) -> Programs:
  """The method (the registered ``algorithm_name`` unless ``algorithm`` is given), its
  compiled round (planned by ``round_plan``, or for ``bench``'s training split alone)
  and its evaluation functions (``check=False``: a config whose swept numbers are
  tracers, pipelines/sweep.py)."""
  train = bench.splits['train']
  if (store.is_store(train) and algorithm_name in algorithms.base.ALGORITHMS
      and algorithms.base.ALGORITHMS.meta(algorithm_name).get('layout')):
    raise ValueError(f'{algorithm_name} trains on clients laid out in padded domain blocks '
                     f'(an evolving benchmark\'s FederatedData); the train split is a '
                     f'ClientStore, whose clients hold their examples packed, without the '
                     f'blocks: build it with an evolving benchmark')
  new_clients = new_client_splits(bench)
  if algorithm is None:
    algorithm = algorithms.build(algorithm_name, config, module, train.max_examples,
                                 bench.info, train.num_clients, train.example_shape,
                                 check=check)
  round_device, round_host = build_round(algorithm, round_plan or round_config(
                                             config, train, algorithm_name),
                                         client_mesh(config.engine.num_devices)
                                         if config.engine.num_devices else None,
                                         donate=config.engine.donate,
                                         backend=round_backend(config),
                                         rounds_per_call=config.engine.rounds_per_call,
                                         check_data=False)   # runs.validate_benchmark
  adapters = None
  if algorithm_name in adapted_algorithms(config):
    adapters = eval_adapters(config, module, bench.num_classes, algorithm_name,
                             train.example_shape)
  evaluate_chunk = evaluation.build_evaluate(algorithm, module, config.engine.eval_batch_size,
                                             new_clients, adapters)
  new_client_chunk = None
  if new_clients and algorithm.personalize is not None:
    new_client_chunk = evaluation.build_new_client_evaluate(algorithm, module,
                                                            config.engine.eval_batch_size)
  return Programs(module, algorithm, round_device, round_host, evaluate_chunk,
                  new_client_chunk)


def round_config(config, train: Optional[federated.FederatedData] = None,
                 algorithm_name: str = '', populations: Sequence[np.ndarray] = ()
                 ) -> RoundConfig:
  """The compiled round's options. With the training split: the width of the sorted
  cohort's client groups (``engine.client_chunk``, or with 0 the width
  ``fit_client_chunk`` fits under ``engine.max_scanned`` on 1,024 cohorts drawn as the
  round draws them, ``likely_cohorts``), each group's padded size
  from ``engine.example_buckets`` (or at most ``engine.example_shapes`` sizes fitted),
  and the loop backend's buckets: planned for the training split's client sizes and
  ``populations`` ([K] sizes of the other runs that share the program: every group's
  bound holds for each of them). With ``engine.likely_plan`` and a population larger
  than the cohort, the groups are cut to the bounds likely cohorts hold
  (``likely_group_bounds``) where that copies ≥ 10 % fewer examples, the bounds every
  cohort holds kept as the round's fallback (``RoundConfig.fallback_examples``); not
  for vmapped seeds or a sweep, whose batched runs would run both. Data not stored
  real-examples-first (FedEvolve's domain-major layout) keeps the padded size."""
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
  # cohorts of every population as the round draws them: the width and bounds fit them
  cohorts = lambda: np.concatenate([likely_cohorts(k, config.cohort_size, config.sampling)
                                    for k in sizes])
  if not chunk and engine.max_scanned and backend == 'vmap':
    chunk = fit_client_chunk(population_steps(schedule, cohorts()), engine.max_scanned,
                             engine.num_devices or 1)
  buckets = tuple(engine.example_buckets)
  cut = (examples_first(train) and not (algorithm_name and
                                        algorithms.base.ALGORITHMS.meta(algorithm_name).get(
                                            'layout')))
  group_examples = fallback_examples = example_buckets = ()
  if cut and backend == 'vmap':
    width = chunk or config.cohort_size

    def plan(bounds):
      planned = plan_group_examples(
          bounds, buckets or fit_example_buckets(bounds, width, engine.example_shapes,
                                                 min_saving_examples(train)),
          'config.engine.example_buckets')
      return tuple(min(examples, train.max_examples) for examples in planned)

    group_examples = plan(np.max([group_bounds(k, config.cohort_size, width) for k in sizes],
                                 axis=0))
    if (engine.likely_plan and not (engine.vmap_seeds or config.sweep)
        and any(config.cohort_size < len(k) for k in sizes)):
      likely = plan(likely_group_bounds(cohorts(), width))
      saving = width * (sum(group_examples) - sum(likely))
      if saving >= max(0.1 * width * sum(group_examples), min_saving_examples(train)):
        group_examples, fallback_examples = likely, group_examples
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
                     fallback_examples=fallback_examples, example_buckets=example_buckets,
                     schedule=schedule, **fields)


def likely_cohorts(num_examples: np.ndarray, cohort_size: int, sampling: str) -> np.ndarray:
  """``simulate_cohorts`` of a population, kept for the process's later plans of it (a
  run plans its round more than once; 1,024 cohorts of 100,000 clients take ~1 s)."""
  sizes = np.ascontiguousarray(num_examples, np.int64)
  return _likely_cohorts(sizes.tobytes(), cohort_size, sampling)


@functools.lru_cache(maxsize=16)
def _likely_cohorts(sizes: bytes, cohort_size: int, sampling: str) -> np.ndarray:
  cohorts = simulate_cohorts(np.frombuffer(sizes, np.int64), cohort_size, sampling)
  cohorts.flags.writeable = False
  return cohorts


def seed_populations(config: ml_collections.ConfigDict, programs: Optional[Dict] = None
                     ) -> Tuple[np.ndarray, ...]:
  """[K] client sizes of the training split of each of ``config.seeds``: the runs that
  may share one compiled round, whose plan must hold for every one of them (kept in
  ``programs``, the process's program cache, per data config and seeds)."""
  key = ('populations', data_key(config), tuple(config.seeds))
  cache = programs if programs is not None else {}
  if key not in cache:
    cache[key] = tuple(np.asarray(shared_data(config, seed, programs).splits['train']
                                  .num_examples) for seed in config.seeds)
  return cache[key]


# A padded size costs one more compilation of the client update (1-2 s for an MLP on a
# 2-core CPU); a fitted size is added only where it saves gathering at least this much
# of the cohort's data a round.
MIN_SHAPE_SAVING_BYTES = 8 * 2 ** 20


def min_saving_examples(train: federated.FederatedData) -> float:
  """``MIN_SHAPE_SAVING_BYTES`` in examples of ``train`` (inputs, labels and mask)."""
  # a store's examples are gathered as float32, int32 labels and a bool mask
  itemsize = 4 if store.is_store(train) else train.x.dtype.itemsize
  per_example = int(np.prod(train.example_shape)) * itemsize + train.y.dtype.itemsize + 1
  return MIN_SHAPE_SAVING_BYTES / per_example


def examples_first(data: federated.FederatedData) -> bool:
  """Whether every client's real examples are its first ``num_examples`` rows (so a
  client can be cut to fewer padded rows without losing any: always, in a store)."""
  if store.is_store(data):
    return True
  mask = np.asarray(data.mask)
  return bool(np.array_equal(mask, np.arange(mask.shape[1])[None, :] <
                             np.asarray(data.num_examples)[:, None]))


def examples_per_step(config: ml_collections.ConfigDict, algorithm_name: str) -> int:
  """Examples one local step of a round touches over the cohort (the progress bar's
  examples/s): the method's own batch size (with its client overrides) × cohort."""
  return algorithms.base.method_client(config, algorithm_name).batch_size * config.cohort_size


def applied_adapters(config: ml_collections.ConfigDict, algorithm_name: str) -> Dict[str, dict]:
  """{adapter: its section as the run used it (``adapter_section``: FedTTA's η_inner, ε
  and fill_batch resolved)} of every test-time adapter run on ``algorithm_name``'s
  models; recorded in results.json."""
  if algorithm_name not in adapted_algorithms(config):
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


def eval_adapters(config: ml_collections.ConfigDict, module, num_classes: int,
                  algorithm_name: str = '', input_shape: tuple = ()
                  ) -> Optional[evaluation.EvalAdapters]:
  """The evaluation's test-time adaptation: ``config.eval_adapters`` ('<adapter>:<mode>'
  strings, e.g. 'memo:episodic', 't3a:online'; hyperparameters from
  ``config.adapters.<adapter>``) on the splits of ``config.eval_adapter_splits``; an
  adapter registered with ``trained_by`` only on those methods' models. None when
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
  return evaluation.EvalAdapters(runners, tuple(config.eval_adapter_splits), models_of)
