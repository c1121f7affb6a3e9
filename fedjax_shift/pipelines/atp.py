"""ATP's protocol as a pipeline (``config.pipeline = 'atp'``; Bao, Wei, Wang & He,
NeurIPS 2023, Tables 1 and 3, Figure 4): for every shift and seed, pretrain the global
model on the source clients, train ATP's α on their held-out data, then run every
configured test-time adapter on the target clients.

Workdir layout::

    <workdir>/<shift>/seed_<s>/pretrain/   a federated run (checkpoints, metrics.jsonl)
    <workdir>/<shift>/seed_<s>/alpha/      α training (checkpoints; α per round in metrics)
    <workdir>/<shift>/seed_<s>/alpha.json  the learned α per module
    <workdir>/<shift>/seed_<s>/learned_<row>/  a learned-rates row's training (rates per round)
    <workdir>/<shift>/seed_<s>/learned_rates.json  the learned rates of every such row
    <workdir>/<shift>/seed_<s>/test_time.json  accuracy per row (+ per client), seconds
    <workdir>/results.md, results.json, alpha.png, rates_<row>.png

Learned-rates rows (``config.learned``): a Table 1 row's adapter with some of its
hyperparameters (Tent's per-layer rates, BN-Adapt's prior strength, ATP's α, …) trained
on the source clients' held-out data by gradient through K test-time steps
(``adapters/learned_rates.py``), federated like α, then run on the targets.

Re-running the command resumes pretraining and α training from their checkpoints.
Every adapter runs through one compiled function per (adapter, mode, hyperparameters)
whose arguments are the source context (global model, source examples, α), so ATP's
Table 3 reuses Table 1's compilation for every α.
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Callable, Dict, List, NamedTuple, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from fedjax_shift import algorithms, models, report
from fedjax_shift.report import figures
from fedjax_shift.adapters import learned_rates
from fedjax_shift.algorithms import ALGORITHMS
from fedjax_shift.algorithms.atp import alpha_optimizer
from fedjax_shift.parts import atp_rates
from fedjax_shift.benchmarks import Benchmark, build_benchmark
from fedjax_shift.benchmarks.atp_shift import SHIFTS, ShiftData
from fedjax_shift.core import evaluation
from fedjax_shift.core.test_time import (ADAPTERS, MODES, Adapter, SourceContext, check_stream,
                                         mode_problem, stream_problem)
from fedjax_shift.data import federated
from fedjax_shift.pipelines.base import PIPELINES, Results, hardware
from fedjax_shift.pipelines.run_config import algorithm_names, check_run
from fedjax_shift.pipelines.fingerprints import fingerprint, run_fields
from fedjax_shift.registry import (BOOL, NONNEGATIVE, NONNEGATIVE_INT, POSITIVE, POSITIVE_INT, TEXT, one_of,
                                   registered, require, require_distinct, sequence_of)
from fedjax_shift.pipelines import pretrain
from fedjax_shift.pipelines.single_run import RunInputs, train_and_evaluate

log = logging.getLogger('fedjax_shift')
# The test-time rows: a key each, with its label, adapter and mode (one row here, the
# model without adaptation; configs/atp.py sets ATP Table 1's).
SECTIONS = {
    'tta': {
        'shifts': ('hybrid',),        # the shifts (table columns) run by this config
        'batch_size': 20,             # ATP: test batch 20
        'rows': ('no_adapt',),        # the rows run, in order
        'label': {'no_adapt': 'No adaptation'},
        'adapter': {'no_adapt': 'no_adapt'},
        'mode': {'no_adapt': 'episodic'},
        'client_chunk': 0,            # target clients per compiled call (0 = all)
        # The time-limited online stream (Alfarra et al., ICML 2024): these online rows
        # also run on a stream revealing stream_rate batches per adapted one, the
        # others predicted by the current model (a table beside Table 1's).
        'stream_rows': (),
        'stream_rate': 0.0,           # C >= 1 when stream_rows name rows
    },
    # Learned-rates rows (adapters/learned_rates.py): a Table 1 row (``base``) whose
    # adapter's ``rates`` are trained through K = ``num_batches`` test batches of
    # tta.batch_size in that row's mode, with config.atp's rounds and cohort. Empty by
    # default; configs/atp.py:learned adds the three below.
    'learned': {
        'rows': (),
        'base': {'tent_learned': 'tent', 'bn_adapt_learned': 'bn_adapt',
                 'atp_online_k': 'atp_online'},
        'rates': {'tent_learned': ('learning_rate',), 'bn_adapt_learned': ('prior_strength',),
                  'atp_online_k': ('alpha',)},
        'label': {'tent_learned': 'Tent (learned rates)',
                  'bn_adapt_learned': 'BN-Adapt (learned prior)',
                  'atp_online_k': 'ATP-online (trained online, K={K})'},
        'num_batches': {'tent_learned': 5, 'bn_adapt_learned': 1, 'atp_online_k': 5},
        'local_steps': 2,             # steps per round (ATP: 2 α steps of 20 on 40 samples)
        'optimizer': 'adam',          # log-space rates (α: config.atp's optimizer)
        'learning_rate': 0.02,
        'remat': True,                # jax.checkpoint each test-time step (same gradient)
    },
}
LEARNED_OPTIMIZERS = ('sgd', 'adam')
RANGES = {
    'tta.shifts': sequence_of(one_of(*SHIFTS), 1),
    'tta.batch_size': POSITIVE_INT,
    'tta.rows': sequence_of(TEXT, 1),       # keys of tta.label / adapter / mode (check)
    'tta.label': TEXT,
    'tta.adapter': registered(ADAPTERS),
    'tta.mode': one_of(*MODES),             # one the row's adapter runs (check)
    'tta.client_chunk': NONNEGATIVE_INT,    # 0: every target client in one call
    'tta.stream_rows': sequence_of(TEXT),   # keys of tta.rows (check)
    'tta.stream_rate': NONNEGATIVE,
    'learned.rows': sequence_of(TEXT),
    'learned.base': TEXT,                   # a Table 1 row (validate_learned)
    'learned.rates': sequence_of(TEXT, 1),  # learnable rates of its adapter (check_learned)
    'learned.label': TEXT,
    'learned.num_batches': POSITIVE_INT,    # K
    'learned.local_steps': POSITIVE_INT,
    'learned.optimizer': one_of(*LEARNED_OPTIMIZERS),
    'learned.learning_rate': POSITIVE,
    'learned.remat': BOOL,
}


def check(config: ml_collections.ConfigDict) -> None:
  """The federated checks plus the test-time ones, before any data or compilation."""
  check_run(config)
  names = algorithm_names(config)
  pretraining = [n for n in ALGORITHMS.names() if ALGORITHMS.meta(n).get('pretrains')]
  require(len(names) == 1 and names[0] in pretraining, 'algorithms',
          f'the atp pipeline pretrains with one of {pretraining}, got {names}')
  require(not config.data.pad_to, 'data.pad_to',
          'the test-time pipeline builds its own client splits; leave pad_to at 0')
  tta = config.tta
  require_distinct(tta.shifts, 'tta.shifts', 'one column per shift')
  require_distinct(tta.rows, 'tta.rows', 'one row per key')
  for key in tta.rows:
    for field in ('label', 'adapter', 'mode'):
      require(key in tta[field], f'tta.{field}', f'has no entry for row {key!r}')
    adapter = tta.adapter[key]
    problem = mode_problem(adapter, tta.mode[key])
    require(problem is None, f'tta.mode.{key}', problem)
    require(adapter in config.adapters, 'adapters', f'has no section for {adapter!r}')
    ADAPTERS.check(adapter, ADAPTERS.section(adapter, config.adapters),
                   f'config.adapters.{adapter}')
  validate_streams(config)
  validate_learned(config)
  pretrain.check_backbone(config)
  require(config.backbone.weights != 'pretrain', 'backbone.weights',
          'the atp pipeline starts its pretraining from a user\'s weights (a path, e.g. '
          'torchvision\'s ImageNet ResNet-18 as a .npz) or from a random model (\'\')')
  ALGORITHMS.check('atp', config.atp, 'config.atp')
  require('atp' not in config.client_overrides, 'client_overrides.atp',
          "α training's optimizer and schedule are config.atp's (optimizer, learning_rate, "
          "batch_size, local_epochs, local_steps); set them there")
  require(1 <= config.atp.cohort_size <= config.data.num_clients, 'atp.cohort_size',
          f'must be in [1, data.num_clients={config.data.num_clients}], got '
          f'{config.atp.cohort_size}')


def validate_streams(config: ml_collections.ConfigDict) -> None:
  """The time-limited rows: rows of Table 1 whose adapter predicts without a step, in
  the online mode, at a rate >= 1 (errors name the field)."""
  tta = config.tta
  require_distinct(tta.stream_rows, 'tta.stream_rows', 'one time-limited run per row')
  require(not tta.stream_rows or tta.stream_rate >= 1, 'tta.stream_rate',
          f'must be >= 1 (batches the stream reveals during one adapted batch) for the '
          f'time-limited rows {tuple(tta.stream_rows)}, got {tta.stream_rate}')
  for key in tta.stream_rows:
    require(key in tta.rows, 'tta.stream_rows', f'{key!r} is not a row of tta.rows')
    problem = stream_problem(tta.adapter[key], tta.mode[key], tta.stream_rate)
    require(problem is None, 'tta.stream_rows', f'row {key!r}: {problem}')


def stream_key(key: str) -> str:
  """The results key of row ``key`` on the time-limited stream."""
  return f'{key}@stream'


def stream_table(stream: Dict[str, Dict[str, Dict[int, float]]], labels: Dict[str, str],
                 shifts, seeds, stream_rate: float) -> str:
  """The time-limited table beside Table 1: each time-limited row after its plain one
  ({row: {shift: {seed: accuracy}}}, rows keyed ``key`` and ``stream_key(key)``)."""
  return (f'Time-limited online stream (Alfarra et al., ICML 2024): one batch in every '
          f'⌈C⌉ = {int(np.ceil(stream_rate))} adapted (C = {stream_rate:g}), the others '
          f'predicted by the current model; accuracy (%) on the target clients, mean ± std '
          f'over seeds\n\n' + report.grid_table(stream, labels, tuple(shifts), tuple(seeds)))


def validate_learned(config: ml_collections.ConfigDict) -> None:
  """The learned-rates rows: each names a Table 1 row and learnable rates of its
  adapter (errors name the field)."""
  learned = config.learned
  require_distinct(learned.rows, 'learned.rows', 'one learned-rates row')
  for key in learned.rows:
    for field in ('base', 'rates', 'label', 'num_batches'):
      require(key in learned[field], f'learned.{field}', f'has no entry for row {key!r}')
    require(key not in config.tta.rows, 'learned.rows',
            f'{key!r} is also a test-time row (config.tta.rows); name it differently')
    base = learned.base[key]
    require(base in config.tta.adapter, f'learned.base.{key}',
            f'{base!r} is not a test-time row; choose from {sorted(config.tta.adapter)}')
    adapter, mode, names = learned_row(config, key)
    require(adapter in config.adapters, 'adapters', f'has no section for {adapter!r}')
    section = ADAPTERS.section(adapter, config.adapters)
    ADAPTERS.check(adapter, section, f'config.adapters.{adapter}')
    learned_rates.check_learned(adapter, names, section, mode,
                                learned.num_batches[key], f'config.learned.rates.{key}')


def table_order(config: ml_collections.ConfigDict) -> List[str]:
  """Table 1's rows, each learned-rates row right after the row it learns."""
  learned = config.learned
  order = []
  for key in config.tta.rows:
    order += [key] + [k for k in learned.rows if learned.base[k] == key]
  return order + [k for k in learned.rows if k not in order]


def learned_row(config: ml_collections.ConfigDict, key: str) -> Tuple[str, str, Tuple[str, ...]]:
  """(adapter, test-time mode, learned rate names) of learned-rates row ``key``."""
  base = config.learned.base[key]
  return config.tta.adapter[base], config.tta.mode[base], tuple(config.learned.rates[key])


def learned_label(config: ml_collections.ConfigDict, key: str) -> str:
  return config.learned.label[key].replace('{K}', str(config.learned.num_batches[key]))


def for_shift(config: ml_collections.ConfigDict, shift: str) -> ml_collections.ConfigDict:
  """The config of one shift's runs (``data.atp_shift.shift`` set)."""
  out = ml_collections.ConfigDict(config.to_dict())
  out.data.atp_shift.shift = shift
  return out


def run_dirs(config: ml_collections.ConfigDict, workdir: str):
  """[(run_dir, run config, own section)]: per shift and seed, the pretraining run
  (the pretraining method's section) and the α run (``config.atp``)."""
  out = []
  for shift in config.tta.shifts:
    shift_config = for_shift(config, shift)
    for seed in config.seeds:
      run_dir = os.path.join(workdir, shift, f'seed_{seed}')
      out.append((os.path.join(run_dir, 'pretrain'), shift_config,
                  algorithm_names(config)[0]))
      global_model = pretrained_identity(shift_config)
      out.append((os.path.join(run_dir, 'alpha'), alpha_config(shift_config), 'atp',
                  global_model))
      out.extend((os.path.join(run_dir, f'learned_{key}'), alpha_config(shift_config), 'atp',
                  global_model) for key in config.learned.rows)
  return out


def alpha_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The federated-run config of α training: ATP's rounds and cohort, uniform sampling
  and an unweighted server mean (Algorithm 1, line 6); the method's optimizer and
  schedule are ``config.atp``'s (``algorithms.atp.alpha_client``)."""
  c = ml_collections.ConfigDict(config.to_dict())
  c.rounds = config.atp.rounds
  c.cohort_size = config.atp.cohort_size
  c.weighting = 'uniform'
  c.sampling = 'uniform'
  c.eval_every = config.atp.rounds
  return c


def alpha_record(names: List[str]):
  return lambda state: {f'alpha/{n}': float(a) for n, a in zip(names, jax.tree.leaves(state.alpha))}


def source_examples(data: federated.FederatedData) -> Tuple[np.ndarray, np.ndarray]:
  """The real (unpadded) examples of every client, concatenated."""
  mask = np.asarray(data.mask)
  return np.asarray(data.x)[mask], np.asarray(data.y)[mask]


class AdapterInputs(NamedTuple):
  """The arrays of a ``SourceContext``: arguments of the compiled adapter evaluation
  (``rates``: a learned-rates row's rates, None otherwise)."""
  variables: Any
  source_x: Any
  source_y: Any
  alpha: Any
  rates: Any = None


def check_adapters(module, rows: List[Tuple[str, str, str]],
                   section: Callable[[str], ml_collections.ConfigDict], context: SourceContext,
                   stream_length: int, field: str) -> None:
  """Builds each row's adapter, ``rows`` [(row key, adapter, mode)] with
  ``section(adapter)``, around an abstract model of the source's shapes
  (``jax.eval_shape``: nothing computed or compiled), and checks it against a stream of
  ``stream_length`` test examples in batches of ``context.batch_size``: a setting the
  data makes impossible (RoTTA's memory under one place per class, NOTE's memory longer
  than the stream) is refused, naming ``field`` and the row, before anything trains."""
  example = jax.ShapeDtypeStruct((1, *context.input_shape), jnp.float32)
  shapes = jax.eval_shape(lambda x: models.init(module, jax.random.key(0), x), example)
  for key, name, mode in rows:

    def build(variables, name=name, mode=mode):
      row_context = context._replace(variables=variables,
                                     alpha=atp_rates.init_alpha(variables))
      adapter = ADAPTERS.get(name)(module, section(name), row_context)
      check_stream(adapter, mode, context.batch_size, stream_length)
      return 0

    try:
      jax.eval_shape(build, shapes)
    except ValueError as err:
      raise ValueError(f'{field} ({key!r}): {err}') from None


def adapter_evaluator(name: str, module, hparams: ml_collections.ConfigDict,
                      num_classes: int, batch_size: int, mode: str, learned: bool = False,
                      stream_rate: float = 0.0):
  """The compiled ``evaluation.build_adapter_evaluate`` of a registered adapter: its
  first argument is an ``AdapterInputs``, so one compilation serves every α, learned
  rates, model and source set of the same shapes. ``learned``: the adapter is built
  from ``inputs.rates`` (``learned_rates.rated_adapter``); ``stream_rate``: the
  time-limited online stream (``test_time.client_runner``)."""
  def make_adapter(inputs: AdapterInputs) -> Adapter:
    context = SourceContext(inputs.variables, num_classes, batch_size, inputs.source_x,
                            inputs.source_y, inputs.alpha,
                            () if inputs.source_x is None else tuple(inputs.source_x.shape[1:]))
    if learned:
      return learned_rates.rated_adapter(name, module, hparams, context, inputs.rates)
    return ADAPTERS.get(name)(module, hparams, context)
  return evaluation.build_adapter_evaluate(make_adapter, batch_size, mode, stream_rate)


def adapter_accuracy(evaluate_chunk, inputs, variables, target: federated.FederatedData, rng,
                     client_chunk: int) -> np.ndarray:
  """Per-client accuracy [K] (NaN for clients without examples) of a compiled adapter
  evaluation over the target clients, in padded chunks of ``client_chunk`` (0 = all)."""
  sums = evaluation.evaluate_population(evaluate_chunk, (inputs, variables), (target,),
                                        target.num_clients, rng, client_chunk)
  return evaluation.client_accuracy(sums)


def run_adapter(adapter: Adapter, mode: str, batch_size: int, variables,
                target: federated.FederatedData, rng, client_chunk: int) -> np.ndarray:
  """Per-client accuracy [K] of one built adapter (NaN for clients without examples)."""
  evaluate_chunk = evaluation.build_adapter_evaluate(lambda inputs: adapter, batch_size, mode)
  return adapter_accuracy(evaluate_chunk, (), variables, target, rng, client_chunk)


class Evaluators:
  """Compiled adapter evaluations of one pipeline run, one per (adapter, mode,
  hyperparameters); shapes are fixed by the protocol, so each compiles once."""

  def __init__(self, config: ml_collections.ConfigDict, module, num_classes: int):
    self.config, self.module, self.num_classes = config, module, num_classes
    self.compiled: Dict[Tuple[str, str, str], Any] = {}

  def get(self, name: str, mode: str, hparams: ml_collections.ConfigDict,
          learned: Tuple[str, ...] = (), stream_rate: float = 0.0):
    key = (name, mode, hparams.to_json(sort_keys=True), learned, stream_rate)
    if key not in self.compiled:
      self.compiled[key] = adapter_evaluator(name, self.module, hparams, self.num_classes,
                                             self.config.tta.batch_size, mode, bool(learned),
                                             stream_rate)
    return self.compiled[key]


def shift_adapter_section(config: ml_collections.ConfigDict, name: str, shift: str
                    ) -> ml_collections.ConfigDict:
  """``config.adapters.<name>`` with a per-shift choice resolved (Surgical's block)."""
  fields = ADAPTERS.section(name, config.adapters).to_dict()
  if isinstance(fields.get('block'), dict):
    fields['block'] = fields['block'][shift]
  return ml_collections.ConfigDict(fields)


def test_time(config, evaluators: Evaluators, inputs: AdapterInputs, data: ShiftData, rows,
              seed: int, shift: str, learned: Dict[str, Any] = None) -> Dict[str, Dict]:
  """Every row's adapter on the target clients: {row: {'accuracy', 'per_client',
  'seconds'}}; ``learned``: {learned row: its trained rates}, run after ``rows``; then
  the time-limited rows (``tta.stream_rows``, keys ``stream_key(row)``)."""
  rng = jax.random.fold_in(jax.random.key(seed), 7)
  out = {}
  learned = learned or {}
  streams = [key for key in config.tta.stream_rows if key in rows]
  for key, stream_rate in ((*((k, 0.0) for k in (*rows, *learned)),
                            *((k, config.tta.stream_rate) for k in streams))):
    name, mode, names = (learned_row(config, key) if key in learned else
                         (config.tta.adapter[key], config.tta.mode[key], ()))
    tick = time.perf_counter()
    evaluate_chunk = evaluators.get(name, mode, shift_adapter_section(config, name, shift), names,
                                    stream_rate)
    row_inputs = inputs._replace(rates=learned[key]) if key in learned else inputs
    per_client = adapter_accuracy(evaluate_chunk, row_inputs, inputs.variables, data.target,
                                  rng, config.tta.client_chunk)
    label = learned_label(config, key) if key in learned else config.tta.label[key]
    if stream_rate:
      key, label = stream_key(key), f'{label} (time-limited)'
    out[key] = {'accuracy': float(np.nanmean(per_client)), 'per_client': per_client.tolist(),
                'seconds': time.perf_counter() - tick}
    log.info('%s seed %d  %-14s %.2f%%  (%.1f s)', shift, seed, label,
             100 * out[key]['accuracy'], out[key]['seconds'])
  return out


def rates_optimizer(config: ml_collections.ConfigDict, names: Tuple[str, ...], variables
                    ) -> optax.GradientTransformation:
  """ATP's α: config.atp's α optimizer (its per-module scaling); log-space rates:
  ``config.learned``'s optimizer."""
  if names == ('alpha',):
    client = algorithms.base.method_client(config, 'atp')
    return alpha_optimizer(algorithms.base.client_optimizer(client), variables,
                           config.atp.scaling, key='alpha')
  learned = config.learned
  return {'sgd': optax.sgd, 'adam': optax.adam}[learned.optimizer](learned.learning_rate)


def build_rates_training(config: ml_collections.ConfigDict, key: str, module, hparams,
                         context: SourceContext, max_examples: int):
  """The ``learned_rates.rates_training`` of learned-rates row ``key`` (its adapter,
  mode, rates and K; config.learned's steps and remat), around ``context.variables``.
  Returns (algorithm, initial rates)."""
  name, mode, names = learned_row(config, key)
  learned = config.learned
  initial = learned_rates.init_rates(name, names, hparams, context.variables)
  algorithm = learned_rates.rates_training(
      lambda rates: learned_rates.rated_adapter(name, module, hparams, context, rates),
      initial, context.variables, rates_optimizer(config, names, context.variables),
      learned_rates.rates_schedule(context.batch_size, learned.num_batches[key],
                                   learned.local_steps, max_examples, config.engine.unroll),
      context.batch_size, mode, learned.remat)
  return algorithm, initial


def train_learned_rates(config, shift_config, workdir: str, key: str, module,
                        context: SourceContext, val: federated.FederatedData, data: ShiftData,
                        seed: int, shift: str):
  """One learned-rates row's federated training on the source held-out split
  (``<workdir>/learned_<key>``, resumable). Returns the trained (unconstrained) rates."""
  name = learned_row(config, key)[0]
  algorithm, initial = build_rates_training(config, key, module,
                                            shift_adapter_section(config, name, shift), context,
                                            val.max_examples)
  flat_names = list(learned_rates.flat_values(name, initial))
  record = lambda state: {f'rates/{n}': v for n, v in zip(
      flat_names, learned_rates.flat_values(name, state.rates).values())}
  trained = train_and_evaluate(alpha_config(shift_config), os.path.join(workdir, f'learned_{key}'),
                               'atp', seed, RunInputs(
                                   bench=Benchmark({'train': val}, data.source.num_classes,
                                                   data.source.example_shape, data.info),
                                   algorithm=algorithm, log_state=record,
                                   depends_on=pretrained_identity(shift_config)))
  return trained['server_state'].rates


def pretrained_identity(shift_config: ml_collections.ConfigDict) -> Dict[str, object]:
  """What α (and a learned-rates row) trains on: the pretraining run's fingerprint and
  the round of its global model, so that α is never reused after the global model
  changed (pretraining extended or cut, another configuration)."""
  fields = run_fields(shift_config, algorithm_names(shift_config)[0])
  return {'global_model': {'fingerprint': fingerprint(fields),
                           'round': int(shift_config.rounds)}}


def run_one(config, workdir: str, shift: str, seed: int, evaluators_for: Callable):
  """Pretraining → α → test time for one (shift, seed). Returns (rows, α, adapter
  inputs, data, α module names); ``evaluators_for(module, num_classes)`` gives the
  run's shared ``Evaluators``."""
  shift_config = for_shift(config, shift)
  data = build_benchmark(shift_config.data, seed)
  for name, split in data.source.splits.items():
    federated.validate(split, data.source.num_classes, name)
  federated.validate(data.target, data.source.num_classes, 'target')
  smallest = int(np.min(data.target.num_examples))
  if smallest < config.tta.batch_size:
    log.warning('a target client has %d examples, fewer than tta.batch_size=%d: its batch '
                'repeats its examples (each scored once)', smallest, config.tta.batch_size)
  with open(os.path.join(workdir, 'protocol.json'), 'w') as f:
    json.dump(data.info, f, default=int)
  module = models.create(config.model, data.source.num_classes)
  evaluators = evaluators_for(module, data.source.num_classes)
  val = data.source.splits['val']
  source_x, source_y = source_examples(val)
  context = SourceContext(None, data.source.num_classes, config.tta.batch_size, source_x,
                          source_y, None, tuple(data.source.example_shape))
  check_adapters(module, [(key, config.tta.adapter[key], config.tta.mode[key])
                          for key in config.tta.rows],
                 lambda name: shift_adapter_section(config, name, shift), context,
                 data.target.x.shape[1], 'tta.rows')
  algorithm_name = algorithm_names(config)[0]
  backbone = None
  if config.backbone.weights:   # e.g. ImageNet weights (ATP's Table 1 ResNet-18)
    backbone = pretrain.load_encoder(config.backbone.weights, module,
                                     jnp.asarray(data.source.splits['train'].first_example()))
  pre = train_and_evaluate(shift_config, os.path.join(workdir, 'pretrain'), algorithm_name,
                           seed, RunInputs(bench=data.source, backbone=backbone))
  variables = pre['server_state'].variables
  global_model = pretrained_identity(shift_config)

  a_config = alpha_config(shift_config)
  algorithm = algorithms.build('atp', a_config, module, val.max_examples,
                               global_variables=variables)
  names = atp_rates.module_names(atp_rates.init_alpha(variables))
  trained = train_and_evaluate(a_config, os.path.join(workdir, 'alpha'), 'atp', seed,
                               RunInputs(bench=Benchmark({'train': val},
                                                         data.source.num_classes,
                                                         data.source.example_shape, data.info),
                                         algorithm=algorithm, log_state=alpha_record(names),
                                         depends_on=global_model))
  alpha = trained['server_state'].alpha
  with open(os.path.join(workdir, 'alpha.json'), 'w') as f:
    json.dump(dict(zip(names, map(float, jax.tree.leaves(alpha)))), f, indent=1)
  context = context._replace(variables=variables)
  learned = {key: train_learned_rates(config, shift_config, workdir, key, module, context, val,
                                      data, seed, shift) for key in config.learned.rows}
  learned_values = {key: learned_rates.flat_values(learned_row(config, key)[0], rates)
                    for key, rates in learned.items()}
  if learned:
    with open(os.path.join(workdir, 'learned_rates.json'), 'w') as f:
      json.dump(learned_values, f, indent=1)
  inputs = jax.device_put(AdapterInputs(variables, source_x, source_y, alpha))
  rows = test_time(config, evaluators, inputs, data, config.tta.rows, seed, shift, learned)
  with open(os.path.join(workdir, 'test_time.json'), 'w') as f:
    json.dump({'rows': rows, 'pretrain': pre['metrics'], 'pretrain_seconds': pre['train_seconds'],
               'alpha_seconds': trained['train_seconds']}, f, indent=1)
  return rows, alpha, inputs, data, names, learned_values


@PIPELINES.register('atp', defaults=SECTIONS, ranges=RANGES, check=check, run_dirs=run_dirs)
def run(config: ml_collections.ConfigDict, workdir: str) -> Results:
  """Every shift × seed (validated by ``pipelines.run``); writes results.json and
  alpha.png. ``records``: 'table1', 'table3', 'markdown'."""
  info = hardware()
  table1: Dict[str, Dict[str, Dict[int, float]]] = {}
  alphas: Dict[Tuple[str, int], object] = {}
  runs = {}
  names: List[str] = []
  shared: Dict[str, Evaluators] = {}
  learned_values: Dict[str, Dict[str, List[Dict[str, float]]]] = {}

  def evaluators_for(module, num_classes: int) -> Evaluators:
    if 'evaluators' not in shared:  # one model and label set per config
      shared['evaluators'] = Evaluators(config, module, num_classes)
    return shared['evaluators']

  tick = time.perf_counter()
  for shift in config.tta.shifts:
    for seed in config.seeds:
      run_dir = os.path.join(workdir, shift, f'seed_{seed}')
      os.makedirs(run_dir, exist_ok=True)
      rows, alpha, inputs, data, names, learned = run_one(config, run_dir, shift, seed,
                                                          evaluators_for)
      for key, result in rows.items():
        table1.setdefault(key, {}).setdefault(shift, {})[seed] = result['accuracy']
      for key, values in learned.items():
        learned_values.setdefault(key, {}).setdefault(shift, []).append(values)
      alphas[(shift, seed)] = alpha
      runs[(shift, seed)] = (inputs, data)
  table3 = (cross_shift(config, shared['evaluators'], alphas, runs)
            if len(config.tta.shifts) > 1 else {})
  seconds = time.perf_counter() - tick
  labels = {key: config.tta.label[key] for key in config.tta.rows}
  labels.update({key: learned_label(config, key) for key in config.learned.rows})
  stream = {k: table1[k] for key in config.tta.stream_rows for k in (key, stream_key(key))}
  table1 = {key: table1[key] for key in table_order(config) if key in table1}
  records = {'table1': table1, 'table3': table3, 'labels': labels}
  markdown = report.paper_table(config, records) or (
      'Accuracy (%) on the target clients, mean ± std over seeds\n\n' +
      report.grid_table(table1, labels, tuple(config.tta.shifts), tuple(config.seeds)))
  if stream:
    labels.update({stream_key(key): f'{labels[key]}, time-limited'
                   for key in config.tta.stream_rows})
    markdown += '\n\n' + stream_table(stream, labels, tuple(config.tta.shifts),
                                      tuple(config.seeds), config.tta.stream_rate)
  preamble = (f"ATP protocol on {config.data.source}: {config.data.num_clients} source + "
              f"{config.data.atp_shift.num_target_clients} target clients, "
              f"model {config.model.name}, "
              f"{algorithm_names(config)[0]} {config.rounds} rounds → α "
              f"{config.atp.rounds} rounds; test batch {config.tta.batch_size}; accuracy (%) "
              f"on target clients, mean ± std over seeds {tuple(config.seeds)}; "
              f"{seconds:.0f} s on {info['device_kind']} ({info['backend']}).")
  alpha_means = {shift: np.mean([np.asarray(jax.tree.leaves(alphas[(shift, s)]))
                                 for s in config.seeds], axis=0)
                 for shift in config.tta.shifts}
  alpha_png = figures.plot_alpha(alpha_means, names, os.path.join(workdir, 'alpha.png'))
  # Each learned-rates row's rates per module, mean over seeds, plotted like alpha.png.
  rates_means, rate_pngs = {}, []   # {row: {shift: {rate name: mean}}}
  for key, by_shift in learned_values.items():
    rate_names = list(next(iter(by_shift.values()))[0])
    rates_means[key] = {shift: dict(zip(rate_names, np.mean(
        [[v[n] for n in rate_names] for v in seeds], axis=0).tolist()))
                        for shift, seeds in by_shift.items()}
    rate_pngs.append(figures.plot_alpha(
        {shift: np.asarray(list(means.values())) for shift, means in rates_means[key].items()},
        rate_names, os.path.join(workdir, f'rates_{key}.png'),
        ylabel=f'learned rate: {labels[key]}'))
  results_json = os.path.join(workdir, 'results.json')
  with open(results_json, 'w') as f:
    json.dump({'table1': table1, 'table3': {f'{a}->{b}': v for (a, b), v in table3.items()},
               'stream': stream,
               'labels': labels,
               'alpha': {s: dict(zip(names, v.tolist())) for s, v in alpha_means.items()},
               'learned_rates': rates_means,
               'seconds': seconds, 'hardware': info}, f, indent=1)
  return Results(preamble, (markdown,), (results_json, alpha_png, *rate_pngs),
                 {**records, 'markdown': markdown})


def cross_shift(config, evaluators: Evaluators, alphas, runs
                ) -> Dict[Tuple[str, str], Dict[str, Dict[int, float]]]:
  """ATP Table 3: α trained on shift a, tested on shift b's model and targets, through
  Table 1's compiled ATP evaluations (α is their argument).
  Returns {(train a, test b): {'atp_batch' | 'atp_online': {seed: accuracy}}}."""
  out = {}
  for train_shift in config.tta.shifts:
    for test_shift in config.tta.shifts:
      if train_shift == test_shift:
        continue
      for seed in config.seeds:
        inputs, data = runs[(test_shift, seed)]
        inputs = inputs._replace(alpha=alphas[(train_shift, seed)])
        rng = jax.random.fold_in(jax.random.key(seed), 7)
        for key, mode in (('atp_batch', 'episodic'), ('atp_online', 'online')):
          evaluate_chunk = evaluators.get('atp', mode, config.adapters.atp)
          acc = adapter_accuracy(evaluate_chunk, inputs, inputs.variables, data.target, rng,
                                 config.tta.client_chunk)
          out.setdefault((train_shift, test_shift), {}).setdefault(key, {})[seed] = float(
              np.nanmean(acc))
  return out
