"""The test-time pipeline (ATP Table 1 / Table 3 / Figure 4): for every shift and
seed, pretrain the global model on the source clients, train ATP's α on their
held-out data, then run every configured adapter on the target clients.

Workdir layout::

    <workdir>/<shift>/seed_<s>/pretrain/   a federated run (checkpoints, metrics.jsonl)
    <workdir>/<shift>/seed_<s>/alpha/      α training (checkpoints; α per round in metrics)
    <workdir>/<shift>/seed_<s>/alpha.json  the learned α per module
    <workdir>/<shift>/seed_<s>/test_time.json  accuracy per row (+ per client), seconds
    <workdir>/results.md, results.json, alpha.png

Re-running the command resumes pretraining and α training from their checkpoints.
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Dict, List, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from fedjax_shift import config as config_lib
from fedjax_shift import models, report
from fedjax_shift.adapters import ADAPTERS, SourceContext
from fedjax_shift.adapters import atp as atp_lib
from fedjax_shift.algorithms.atp import OPTIMIZERS, atp_training
from fedjax_shift.benchmarks import Benchmark
from fedjax_shift.benchmarks.atp_shift import SHIFTS, ShiftData, atp_protocol
from fedjax_shift.core.test_time import MODES, build_test_time
from fedjax_shift.data import federated
from fedjax_shift.experiment import hardware, train_and_evaluate

log = logging.getLogger('fedjax_shift')
PRETRAIN_ALGORITHMS = ('fedavg', 'fedprox', 'qffl')


def _require(condition: bool, field: str, message: str):
  if not condition:
    raise ValueError(f'config.{field}: {message}')


def validate(config: ml_collections.ConfigDict, workdir: str | None = None) -> None:
  """The federated checks plus the test-time ones, before any data or compilation."""
  config_lib.validate(config, workdir)
  names = config_lib.algorithm_names(config)
  _require(len(names) == 1 and names[0] in PRETRAIN_ALGORITHMS, 'algorithms',
           f'the test-time pipeline pretrains with one of {list(PRETRAIN_ALGORITHMS)}, '
           f'got {names}')
  tta = config.tta
  _require(len(tta.shifts) >= 1 and all(s in SHIFTS for s in tta.shifts), 'tta.shifts',
           f'name shifts from {list(SHIFTS)}, got {tuple(tta.shifts)}')
  _require(tta.batch_size >= 1, 'tta.batch_size', f'must be >= 1, got {tta.batch_size}')
  _require(len(tta.rows) >= 1, 'tta.rows', 'name at least one row')
  for key in tta.rows:
    for field in ('label', 'adapter', 'mode'):
      _require(key in tta[field], f'tta.{field}', f'has no entry for row {key!r}')
    adapter = tta.adapter[key]
    ADAPTERS.get(adapter, f'config.tta.adapter.{key}')
    _require(tta.mode[key] in MODES, f'tta.mode.{key}',
             f'unknown {tta.mode[key]!r}; choose from {list(MODES)}')
    _require(adapter in config.adapters, 'adapters', f'has no section for {adapter!r}')
  atp = config.atp
  _require(atp.scaling in atp_lib.SCALINGS, 'atp.scaling',
           f'unknown {atp.scaling!r}; choose from {list(atp_lib.SCALINGS)}')
  _require(atp.optimizer in OPTIMIZERS, 'atp.optimizer',
           f'unknown {atp.optimizer!r}; choose from {list(OPTIMIZERS)}')
  _require(atp.rounds >= 1, 'atp.rounds', f'must be >= 1, got {atp.rounds}')
  _require(atp.learning_rate > 0, 'atp.learning_rate', f'must be > 0, got {atp.learning_rate}')
  _require(atp.batch_size >= 1, 'atp.batch_size', f'must be >= 1, got {atp.batch_size}')
  _require(1 <= atp.cohort_size <= config.data.num_clients, 'atp.cohort_size',
           f'must be in [1, data.num_clients={config.data.num_clients}], got {atp.cohort_size}')
  _require(config.data.num_target_clients >= 1, 'data.num_target_clients',
           f'must be >= 1, got {config.data.num_target_clients}')


def alpha_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The federated-run config of α training: ATP's rounds, cohort, batch and an
  unweighted server mean (Algorithm 1, line 6)."""
  c = ml_collections.ConfigDict(config.to_dict())
  c.rounds = config.atp.rounds
  c.cohort_size = config.atp.cohort_size
  c.weighting = 'uniform'
  c.sampling = 'uniform'
  c.client.batch_size = config.atp.batch_size
  c.eval_every = config.atp.rounds
  return c


def alpha_record(names: List[str]):
  return lambda state: {f'alpha/{n}': float(a) for n, a in zip(names, jax.tree.leaves(state.alpha))}


def source_examples(data: federated.FederatedData) -> Tuple[np.ndarray, np.ndarray]:
  """The real (unpadded) examples of every client, concatenated."""
  mask = np.asarray(data.mask)
  return np.asarray(data.x)[mask], np.asarray(data.y)[mask]


def run_adapter(adapter, mode: str, batch_size: int, variables, target: federated.FederatedData,
                rng, client_chunk: int) -> np.ndarray:
  """Per-client accuracy [K] (NaN for clients without examples)."""
  run = build_test_time(adapter, batch_size, mode)
  num = target.num_clients
  chunk = client_chunk or num
  correct, count = [], []
  for start in range(0, num, chunk):
    ids = np.arange(start, min(start + chunk, num))
    out = run(variables, target.take(ids), rng, jnp.asarray(ids))
    correct.append(np.asarray(out['correct']))
    count.append(np.asarray(out['count']))
  correct, count = np.concatenate(correct), np.concatenate(count)
  return np.where(count > 0, correct / np.maximum(count, 1), np.nan)


def test_time(config, module, variables, alpha, data: ShiftData, rows, seed: int,
              shift: str) -> Dict[str, Dict]:
  """Every row's adapter on the target clients: {row: {'accuracy', 'per_client', 'seconds'}}."""
  val = data.source.splits['val']
  source_x, source_y = source_examples(val)
  context = SourceContext(variables, data.source.num_classes, config.tta.batch_size, source_x,
                          source_y, alpha)
  rng = jax.random.fold_in(jax.random.key(seed), 7)
  out = {}
  for key in rows:
    name = config.tta.adapter[key]
    fields = config.adapters[name].to_dict()
    if isinstance(fields.get('block'), dict):  # Surgical: the block chosen per shift
      fields['block'] = fields['block'][shift]
    section = ml_collections.ConfigDict(fields)
    tick = time.perf_counter()
    adapter = ADAPTERS.get(name, f'config.tta.adapter.{key}')(module, section, context)
    per_client = run_adapter(adapter, config.tta.mode[key], config.tta.batch_size, variables,
                             data.target, rng, config.tta.get('client_chunk', 0))
    out[key] = {'accuracy': float(np.nanmean(per_client)), 'per_client': per_client.tolist(),
                'seconds': time.perf_counter() - tick}
    log.info('%s seed %d  %-14s %.2f%%  (%.1f s)', shift, seed, config.tta.label[key],
             100 * out[key]['accuracy'], out[key]['seconds'])
  return out


def run_one(config, workdir: str, shift: str, seed: int):
  """Pretraining → α → test time for one (shift, seed). Returns (rows, α, model, data)."""
  shift_config = ml_collections.ConfigDict(config.to_dict())
  shift_config.data.shift = shift
  data = atp_protocol(shift_config.data, seed)
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
  algorithm_name = config_lib.algorithm_names(config)[0]
  pre = train_and_evaluate(shift_config, os.path.join(workdir, 'pretrain'), algorithm_name,
                           seed, bench=data.source)
  variables = pre['server_state'].variables

  a_config = alpha_config(shift_config)
  val = data.source.splits['val']
  algorithm = atp_training(a_config, module, val.max_examples, variables)
  names = atp_lib.module_names(atp_lib.init_alpha(variables))
  trained = train_and_evaluate(a_config, os.path.join(workdir, 'alpha'), 'atp', seed,
                               bench=Benchmark({'train': val}, data.source.num_classes,
                                               data.source.example_shape, data.info),
                               algorithm=algorithm, log_state=alpha_record(names))
  alpha = trained['server_state'].alpha
  with open(os.path.join(workdir, 'alpha.json'), 'w') as f:
    json.dump(dict(zip(names, map(float, jax.tree.leaves(alpha)))), f, indent=1)
  rows = test_time(config, module, variables, alpha, data, config.tta.rows, seed, shift)
  with open(os.path.join(workdir, 'test_time.json'), 'w') as f:
    json.dump({'rows': rows, 'pretrain': pre['metrics'], 'pretrain_seconds': pre['train_seconds'],
               'alpha_seconds': trained['train_seconds']}, f, indent=1)
  return rows, alpha, (module, variables), data, names


def run(config: ml_collections.ConfigDict, workdir: str) -> Dict[str, object]:
  """Every shift × seed; writes results.md (Table 1, Table 3), results.json, alpha.png."""
  validate(config, workdir)
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    f.write(config.to_json_best_effort(indent=1))
  info = hardware()
  log.info('devices: %s (%s), jax %s', info['devices'], info['backend'], info['jax'])
  table1: Dict[str, Dict[str, Dict[int, float]]] = {}
  alphas: Dict[Tuple[str, int], object] = {}
  runs = {}
  names: List[str] = []
  tick = time.perf_counter()
  for shift in config.tta.shifts:
    for seed in config.seeds:
      run_dir = os.path.join(workdir, shift, f'seed_{seed}')
      os.makedirs(run_dir, exist_ok=True)
      rows, alpha, model, data, names = run_one(config, run_dir, shift, seed)
      for key, result in rows.items():
        table1.setdefault(key, {}).setdefault(shift, {})[seed] = result['accuracy']
      alphas[(shift, seed)] = alpha
      runs[(shift, seed)] = (model, data)
  table3 = cross_shift(config, alphas, runs) if len(config.tta.shifts) > 1 else {}
  seconds = time.perf_counter() - tick
  labels = {key: config.tta.label[key] for key in config.tta.rows}
  markdown = report.tta_tables(table1, table3, labels, tuple(config.tta.shifts),
                               tuple(config.seeds))
  preamble = (f"ATP protocol on {config.data.source}: {config.data.num_clients} source + "
              f"{config.data.num_target_clients} target clients, model {config.model.name}, "
              f"{config_lib.algorithm_names(config)[0]} {config.rounds} rounds → α "
              f"{config.atp.rounds} rounds; test batch {config.tta.batch_size}; accuracy (%) "
              f"on target clients, mean ± std over seeds {tuple(config.seeds)}; "
              f"{seconds:.0f} s on {info['device_kind']} ({info['backend']}).")
  with open(os.path.join(workdir, 'results.md'), 'w') as f:
    f.write(preamble + '\n\n' + markdown + '\n')
  alpha_means = {shift: np.mean([np.asarray(jax.tree.leaves(alphas[(shift, s)]))
                                 for s in config.seeds], axis=0)
                 for shift in config.tta.shifts}
  report.plot_alpha(alpha_means, names, os.path.join(workdir, 'alpha.png'))
  with open(os.path.join(workdir, 'results.json'), 'w') as f:
    json.dump({'table1': table1, 'table3': {f'{a}->{b}': v for (a, b), v in table3.items()},
               'alpha': {s: dict(zip(names, v.tolist())) for s, v in alpha_means.items()},
               'seconds': seconds, 'hardware': info}, f, indent=1)
  return {'table1': table1, 'table3': table3, 'markdown': markdown, 'preamble': preamble}


def cross_shift(config, alphas, runs) -> Dict[Tuple[str, str], Dict[str, Dict[int, float]]]:
  """ATP Table 3: α trained on shift a, tested on shift b's model and targets.
  Returns {(train a, test b): {'atp_batch' | 'atp_online': {seed: accuracy}}}."""
  out = {}
  for train_shift in config.tta.shifts:
    for test_shift in config.tta.shifts:
      if train_shift == test_shift:
        continue
      for seed in config.seeds:
        (module, variables), data = runs[(test_shift, seed)]
        adapter = atp_lib.atp(module, alphas[(train_shift, seed)])
        rng = jax.random.fold_in(jax.random.key(seed), 7)
        for key, mode in (('atp_batch', 'episodic'), ('atp_online', 'online')):
          acc = run_adapter(adapter, mode, config.tta.batch_size, variables, data.target, rng,
                            config.tta.get('client_chunk', 0))
          out.setdefault((train_shift, test_shift), {}).setdefault(key, {})[seed] = float(
              np.nanmean(acc))
  return out
