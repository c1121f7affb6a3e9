"""The heterogeneous-model pipeline (``config.pipeline = 'hetero'``): HeteroFedTTA
(Ye et al., UPFL 2023 Sec. 3.4, Algorithm 2) on the UPFL benchmark, one run per
λ of ``config.hetero.kd_lambdas`` (Sec. 4.6 / Fig. 5; empty: ``hetero_fedtta.kd_lambda``)
and seed, with the grouped compiled round of ``core/groups.py``.

Training clients and new clients are each given an architecture
(``algorithms.hetero_fedtta.assign_sizes``, numpy generator [seed, 31]). The public set
D_p is the benchmark's (``data.upfl.public_source``, ``data.upfl.public_examples``;
benchmarks/upfl.py); its labels are never read in training.

Evaluation (every ``eval_every`` rounds and the last), accuracy over examples:
  'base/val'                   each training client's own ψ_i on its validation data
  'personalized/val'           ψ_i adapted by its own φ_i (one inner step, Eq. 11)
  'digested/test'              each new client's digested ψ, unadapted
  'personalized/test'          ... adapted by its digested φ (HeteroFedTTA's prediction)
  'personalized/test_<size>'   the same, new clients of one architecture only
  'personalized_pp/val|test'   adapted with FedTTA++'s early-stopped steps instead
                               (``config.adapters.fedtta_pp``: E, patience, restore_best)
  'knowledge_base/public',     the server's F_base and F_per against D_p's labels (read
  'knowledge_personalized/public'  for this score only): how much the clients' ensemble knows
  'new_clients/base_drift',    a new client's ‖θ − θ_0‖ / ‖θ_0‖ after digesting, for ψ
  'new_clients/adaptation_drift'   and for φ (g), the mean over new clients: whether g
                               moved from its random initialisation at all
New clients' whole data is adapted in batches of ``eval_adapter_batch_size``; their
labels are only read to score predictions.

Workdir: <workdir>/hetero_fedtta_lambda<λ>/seed_<s>/ with checkpoints/, metrics.jsonl,
partition.json, results.json (as the federated pipeline).
"""
from __future__ import annotations

import json
import os
from typing import Dict, List, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from fedjax_shift import report
from fedjax_shift.report import figures
from fedjax_shift.adapters.fedtta import Adaptation, fedtta_adapter, fill_batch_of
from fedjax_shift.adapters.no_adapt import no_adapt
from fedjax_shift.algorithms import base, hetero_fedtta
from fedjax_shift.benchmarks import check_data, data_view, upfl
from fedjax_shift.core import evaluation
from fedjax_shift.core.groups import (build_grouped_round, cohort_sizes, init_group_states,
                                      split_groups)
from fedjax_shift.core.local import LocalSchedule
from fedjax_shift.core.round import round_key
from fedjax_shift.core.test_time import ADAPTERS, client_runner
from fedjax_shift.data import federated, store
from fedjax_shift.parts.fedtta_step import InnerStep
from fedjax_shift.pipelines import loop
from fedjax_shift.pipelines.base import PIPELINES, CompileClock, Results, hardware
from fedjax_shift.pipelines.run_config import algorithm_names, check_run_loop, check_sections
from fedjax_shift.pipelines.opening import checked_fields, open_run
from fedjax_shift.pipelines.runs import build_data, diverged_record, evaluated_rounds, run_keys
from fedjax_shift.registry import NONNEGATIVE, check_fields, require, require_distinct, sequence_of

SECTIONS = {
    'hetero_fedtta': hetero_fedtta.DEFAULTS,
    'hetero': {'kd_lambdas': ()},   # λ sweep (Sec. 4.6: 0, 0.2, …, 1); () = hetero_fedtta.kd_lambda
}
RANGES = {**{f'hetero_fedtta.{field}': declared
             for field, declared in hetero_fedtta.RANGES.items()},
          'hetero.kd_lambdas': sequence_of(NONNEGATIVE)}


def check(config: ml_collections.ConfigDict) -> None:
  """The fields this pipeline reads, before any data is built."""
  require(tuple(algorithm_names(config)) == ('hetero_fedtta',), 'algorithms',
          f"the hetero pipeline trains ('hetero_fedtta',), got {tuple(config.algorithms)}")
  check_run_loop(config)
  check_sections(config)
  for section, fields in SECTIONS.items():
    check_fields(config[section], fields, f'config.{section}')
  require(config.data.benchmark == 'upfl', 'data.benchmark',
          f"HeteroFedTTA personalises new clients: use 'upfl', got {config.data.benchmark!r}")
  check_data(config.data)
  public = config.data.upfl
  require(config.model.name == 'mlp', 'model.name',
          f"the hetero pipeline builds MLPs of the sizes in hetero_fedtta.sizes (App. G); "
          f"set model.name='mlp', got {config.model.name!r}")
  require(public.public_source != '', 'data.upfl.public_source',
          "HeteroFedTTA distils on a public unlabelled set: set 'holdout' or 'uci_digits'")
  batch = config.hetero_fedtta.public_batch_size
  require(public.public_examples % batch == 0, 'data.upfl.public_examples',
          f'must be a multiple of hetero_fedtta.public_batch_size={batch}, got '
          f'{public.public_examples}')
  require_distinct(config.hetero.kd_lambdas, 'hetero.kd_lambdas', 'one run per seed')
  # Fields of the federated pipeline that the grouped round does not implement: refused
  # rather than ignored.
  unsupported = (('data.store', config.data.store, 'device'),
                 ('sampling', config.sampling, 'uniform'),
                 ('straggler_prob', config.straggler_prob, 0.0),
                 ('engine.rounds_per_call', config.engine.rounds_per_call, 1),
                 ('engine.vmap_seeds', config.engine.vmap_seeds, False),
                 ('engine.num_devices', config.engine.num_devices, 0),
                 ('engine.client_chunk', config.engine.client_chunk, 0),
                 ('eval_adapters', tuple(config.eval_adapters), ()))
  for field, value, supported in unsupported:
    require(value == supported, field, f'the hetero pipeline runs only {field}={supported!r} '
            f'(the grouped round of core/groups.py), got {value!r}')
  require(config.engine.backend in ('auto', 'vmap'), 'engine.backend',
          f"the hetero pipeline's grouped round is vmapped; got {config.engine.backend!r}")


def lambdas(config: ml_collections.ConfigDict) -> tuple:
  return tuple(config.hetero.kd_lambdas) or (config.hetero_fedtta.kd_lambda,)


def run_name(kd_lambda: float) -> str:
  return f'hetero_fedtta_lambda{kd_lambda:g}'


def run_config(config: ml_collections.ConfigDict, kd_lambda: float) -> ml_collections.ConfigDict:
  """``config`` with ``hetero_fedtta.kd_lambda`` = λ (the run's own section)."""
  out = ml_collections.ConfigDict(config.to_dict())
  out.hetero_fedtta.kd_lambda = float(kd_lambda)
  return out


def run_dirs(config: ml_collections.ConfigDict, workdir: str):
  return [(os.path.join(workdir, run_name(value), f'seed_{seed}'), run_config(config, value),
           'hetero_fedtta') for value in lambdas(config) for seed in config.seeds]


def _sums_concat(parts: List[Dict[str, np.ndarray]]) -> Dict[str, np.ndarray]:
  return {key: np.concatenate([np.asarray(p[key]) for p in parts])
          for key in ('correct', 'loss', 'count')}


def train_lambda(config: ml_collections.ConfigDict, run_dir: str, seed: int
                       ) -> Dict[str, object]:
  """One λ (``config.hetero_fedtta.kd_lambda``) and seed; resumes from ``run_dir``. A
  diverged run with ``config.on_divergence='continue'`` gives its diverged record."""
  with CompileClock() as clock:
    result = _train_and_evaluate(config, run_dir, seed)
  if 'diverged' in result:
    return result
  result['compile_seconds'] = round(clock.seconds, 3)
  result['compilations'] = clock.compilations
  with open(os.path.join(run_dir, 'results.json'), 'w') as f:
    json.dump(result, f, indent=1)
  return result


class Setup(NamedTuple):
  """What one seed's run is built from."""
  train_sizes: list            # architecture of each training client
  new_sizes: list              # ... of each new client
  group_ids: List[np.ndarray]  # per architecture, its training clients' rows
  new_ids: List[np.ndarray]    # per architecture, its new clients' rows of 'test'
  public_x: np.ndarray         # D_p [P, ...]
  public_y: np.ndarray         # [P], only to score the knowledge
  base_optimizer: object       # η_outer's optimizer (config.client)
  example_x: jax.Array         # [1, ...]
  algorithm: object            # the GroupedAlgorithm


def setup(config: ml_collections.ConfigDict, bench, seed: int) -> Setup:
  hp = config.hetero_fedtta
  train = bench.splits['train']
  rng = np.random.default_rng([seed, 31])
  train_sizes = hetero_fedtta.assign_sizes(len(bench.info['training_clients']),
                                           tuple(hp.sizes), rng)
  new_sizes = hetero_fedtta.assign_sizes(len(bench.info['new_clients']['test']),
                                         tuple(hp.sizes), rng)
  rows = lambda assigned, size: np.array([k for k, s in enumerate(assigned) if s == size],
                                         np.int32)
  public_x, public_y = upfl.public_set(data_view(config.data), bench.info)
  c = config.client
  schedule = LocalSchedule(c.batch_size, c.local_epochs, c.local_steps, train.max_examples,
                           config.engine.unroll, tuple(c.augmentation))
  base_optimizer = base.client_optimizer(c)
  example_x = jnp.asarray(train.first_example())
  algorithm = hetero_fedtta.build(hp, bench.num_classes, public_x, base_optimizer, schedule,
                                  example_x)
  return Setup(train_sizes, new_sizes, [rows(train_sizes, s) for s in hp.sizes],
               [rows(new_sizes, s) for s in hp.sizes], public_x, public_y, base_optimizer,
               example_x, algorithm)


def new_client_predictions(bench, config: ml_collections.ConfigDict, seed: int) -> np.ndarray:
  """[M, N] predictions (−1 where padded) of the new clients of ``bench``'s 'test'
  split after digesting the initial (untrained) knowledge: the evaluation path of a
  run, without training (tests check it never reads the labels)."""
  parts = setup(config, bench, seed)
  evaluate = build_evaluate(config, bench.num_classes, parts, bench.splits['val'],
                            bench.splits['test'], jax.random.key(seed))
  server = parts.algorithm.init(jax.random.key(0))
  states = init_group_states(parts.algorithm, jax.random.key(1), parts.group_ids)
  return evaluate(server, states, with_predictions=True)[1]


def _train_and_evaluate(config, run_dir: str, seed: int) -> Dict[str, object]:
  fields = checked_fields(run_dir, config, 'hetero_fedtta', config.resume)
  os.makedirs(run_dir, exist_ok=True)
  hp = config.hetero_fedtta
  bench = build_data(config, seed)
  train, val, test = (bench.splits[name] for name in ('train', 'val', 'test'))
  parts = setup(config, bench, seed)
  algorithm, group_ids, public_x = parts.algorithm, parts.group_ids, parts.public_x
  with open(os.path.join(run_dir, 'partition.json'), 'w') as f:
    json.dump({'statistics': {name: store.split_statistics(s, bench.num_classes)
                              for name, s in bench.splits.items()},
               'info': bench.info, 'training_client_sizes': parts.train_sizes,
               'new_client_sizes': parts.new_sizes}, f, indent=1)
  sizes = cohort_sizes([len(ids) for ids in group_ids], config.cohort_size)
  round_fn = build_grouped_round(algorithm, sizes, config.weighting)
  init_key, train_key, eval_key = run_keys(seed)
  server_state = algorithm.init(init_key)
  group_states = init_group_states(algorithm, init_key, group_ids)
  group_data = jax.device_put(split_groups(train, group_ids))
  group_ids_device = tuple(jnp.asarray(ids) for ids in group_ids)
  evaluate = build_evaluate(config, bench.num_classes, parts, val, test, eval_key)

  opened = open_run(run_dir, config, fields, (server_state, group_states, jnp.float32(0.0)))
  server_state, group_states, elapsed = opened.state
  label = f'hetero_fedtta λ={hp.kd_lambda:g} seed {seed}'
  run = loop.Run(label, run_dir, opened.checkpointer, opened.writer, opened.start_round,
                 float(elapsed), lambda state: evaluate(*state)[0])

  def advance(state, start: int, stop: int):
    del stop
    out = round_fn(*state, group_data, group_ids_device, round_key(train_key, start))
    return (out.server_state, out.group_states), loop.one_round(out.metrics,
                                                                ('loss', 'kd_loss'))

  try:
    outcome, = loop.train([run], (server_state, group_states),
                          loop.Trainer(advance, loop.only_run), loop.Cadence.of(config), label)
  finally:
    opened.checkpointer.close()
  if outcome.diverged is not None:
    return diverged_record(config, run_dir, run_name(hp.kd_lambda), seed, outcome.diverged)
  summary, elapsed = outcome.summary, outcome.elapsed
  num_public = public_x.shape[0]
  return {'algorithm': run_name(hp.kd_lambda), 'kd_lambda': float(hp.kd_lambda), 'seed': seed,
          'metrics': summary, 'evaluations': evaluated_rounds(run_dir, config.rounds), 'rounds': config.rounds,
          'train_seconds': elapsed, 'hardware': hardware(),
          # a client sends f(D_p; ψ) and f(D_p; ψ̃): 2 · P · C numbers
          'uploaded_parameters': 2 * num_public * bench.num_classes,
          'group_sizes': {size: len(ids) for size, ids in zip(hp.sizes, group_ids)},
          'cohort_sizes': dict(zip(hp.sizes, sizes)),
          **({'stopped': outcome.stopped} if outcome.stopped is not None else {})}


def build_evaluate(config, num_classes: int, parts: Setup, val: federated.FederatedData,
                   test: federated.FederatedData, eval_key):
  """``evaluate(knowledge, group_states, with_predictions=False)`` -> (flat metrics (module
  docstring), new clients' predictions [M, N] or None); one jitted program per
  architecture for the training clients and one for the new clients."""
  hp = config.hetero_fedtta
  batch_size = config.eval_adapter_batch_size
  group_ids, new_ids = parts.group_ids, parts.new_ids
  val_parts = split_groups(val, group_ids)
  test_parts = split_groups(test, new_ids)
  early = ADAPTERS.section('fedtta_pp', config.adapters)   # FedTTA++'s stopping rule
  programs = []
  for size in hp.sizes:
    arch = hetero_fedtta.architecture(size, num_classes, hp.base_model)
    runners = {
        'plain': client_runner(no_adapt(arch.module), batch_size),
        'one_step': client_runner(fedtta_adapter(arch.module, Adaptation(
            InnerStep(hp.inner_learning_rate, hp.norm_epsilon),
            fill_batch=fill_batch_of(config.adapters.fedtta, config))), batch_size),
        'early_stopped': client_runner(fedtta_adapter(arch.module, Adaptation(
            InnerStep(hp.inner_learning_rate, hp.norm_epsilon, early.clip_norm,
                      early.weight_decay), early.max_steps, early.patience, early.loop,
            early.restore_best, early.include_initial, fill_batch_of(early, config))),
            batch_size)}

    def score(params, x, y, num_examples, key, runners=runners):
      """{'plain': ψ, 'one_step': FedTTA's, 'early_stopped': FedTTA++'s} sums."""
      variables = hetero_fedtta.variables_of(params)
      return {name: run(variables, x, y, num_examples, key) for name, run in runners.items()}

    def new_client(knowledge, key, x, y, num_examples, size=size, score=score):
      params, drift = hetero_fedtta.new_client_params(size, num_classes, hp, knowledge,
                                                      parts.public_x, parts.base_optimizer,
                                                      parts.example_x, key)
      return {**score(params, x, y, num_examples, key), 'drift': drift}

    programs.append((jax.jit(jax.vmap(score)),
                     jax.jit(jax.vmap(new_client, (None, 0, 0, 0, 0)))))

  def keys(ids, stream: int):
    """Client ``ids``' keys: stream 0 for training clients, 1 for new clients."""
    return jax.vmap(jax.random.fold_in, (None, 0))(jax.random.fold_in(eval_key, stream),
                                                   jnp.asarray(ids, jnp.int32))

  def evaluate(knowledge, group_states, with_predictions: bool = False):
    val, test_sums, drifts = [], [], []
    per_size = {}
    predictions = np.full(test.y.shape, -1, np.int32)
    for (own, new), size, states, part, test_part, ids, ids_new in zip(
        programs, hp.sizes, group_states, val_parts, test_parts, group_ids, new_ids):
      if len(ids):
        val.append(own(states, part.x, part.y, part.num_examples, keys(ids, 0)))
      if len(ids_new):
        sums = new(knowledge, keys(ids_new, 1), test_part.x, test_part.y, test_part.num_examples)
        drifts.append(jax.tree.map(np.asarray, sums.pop('drift')))
        test_sums.append(sums)
        per_size[f'test_{size}'] = _sums_concat([sums['one_step']])
        predictions[ids_new] = np.asarray(sums['one_step']['predictions'])
    joined = lambda parts, name: _sums_concat([p[name] for p in parts])
    per_client = {'base': {'val': joined(val, 'plain')},
                  'personalized': {'val': joined(val, 'one_step'),
                                   'test': joined(test_sums, 'one_step'), **per_size},
                  'personalized_pp': {'val': joined(val, 'early_stopped'),
                                      'test': joined(test_sums, 'early_stopped')},
                  'digested': {'test': joined(test_sums, 'plain')}}
    metrics = evaluation.summarize(per_client)
    for part in ('base', 'adaptation'):   # how far digesting moved a new client from init
      values = np.concatenate([d[part] for d in drifts]) if drifts else np.zeros(0)
      metrics[f'new_clients/{part}_drift'] = float(np.mean(values)) if len(values) else 0.0
    for name in ('base', 'personalized'):   # the knowledge's argmax against D_p's labels
      metrics[f'knowledge_{name}/public/accuracy'] = float(np.mean(
          np.argmax(np.asarray(getattr(knowledge, name)), -1) == parts.public_y))
    return metrics, (predictions if with_predictions else None)

  return evaluate


@PIPELINES.register('hetero', defaults=SECTIONS, ranges=RANGES, check=check,
                    run_dirs=run_dirs)
def run(config: ml_collections.ConfigDict, workdir: str) -> Results:
  """Every λ × seed; ``records``: 'results' (one dict per run), 'table'."""
  info = hardware()
  results: List[Dict] = []
  curves: Dict[str, List[str]] = {}
  for run_dir, one_config, _ in run_dirs(config, workdir):
    seed = int(os.path.basename(run_dir).split('_')[-1])
    results.append(train_lambda(one_config, run_dir, seed))
    curves.setdefault(results[-1]['algorithm'], []).append(run_dir)
  table = report.results_table(results)
  hp = config.hetero_fedtta
  preamble = (f"HeteroFedTTA (Ye et al., UPFL 2023 Sec. 3.4) on {config.data.benchmark}: "
              f"{config.data.source}, {config.data.num_clients} clients, architectures "
              f"{tuple(hp.sizes)}, public set {config.data.upfl.public_examples} × "
              f"{config.data.upfl.public_source}, "
              f"{config.rounds} rounds; accuracy (%) mean ± std over seeds "
              f"{tuple(config.seeds)}; hardware: {info['device_kind']} ({info['backend']}).")
  files = (report.write_csv(table, os.path.join(workdir, 'results.csv')),
           figures.plot_curves(curves, os.path.join(workdir, 'curves.png')))
  return Results(preamble, (table['markdown'],), files, {'results': results, 'table': table})

