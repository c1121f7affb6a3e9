"""The test-time adaptation benchmark as a pipeline (``config.pipeline = 'tta_bench'``):
every test-time adapter × the corruption set at one severity (benchmarks/
tta_corruptions.py), episodic and online, on an i.i.d. test stream at several batch
sizes and on a label-shifted, non-i.i.d. one, the two stresses under which TTAB (Zhao
et al., ICML 2023) shows methods break. For every seed: train the source model
(``config.algorithms``, a resumable federated run), then run each row's adapter as one
compiled scan over the test batches, vmapped over the corruptions (one target client
each), and time it.

Workdir layout::

    <workdir>/seed_<s>/pretrain/        the source model's run (checkpoints, metrics.jsonl)
    <workdir>/seed_<s>/test_time.json   accuracy per row × stream × corruption, timings
    <workdir>/results.md, results.json  the table (mean and worst corruption, ms per batch)

A cell's time is the compiled scan's wall-clock seconds (compilation apart, measured
ahead of time; a scan under a second is rerun and timed by its fastest of three runs)
over all corruptions, divided by the test batches it ran: the cost of one test batch of
one target client.

The time-limited columns (Alfarra et al., ICML 2024) replay an i.i.d. stream that
reveals a batch per forward pass of the source model: each online row that can predict
without adapting gets its cost C, its milliseconds per batch on that stream divided by
no adaptation's, measured in the same seed (or pinned, ``tta_bench.stream_costs``), and
adapts on every ⌈C⌉-th batch, predicting the others with its current model.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Dict, List, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from fedjax_shift import models
from fedjax_shift.benchmarks import build_benchmark
from fedjax_shift.benchmarks.tta_corruptions import CorruptedTests
from fedjax_shift.core import evaluation
from fedjax_shift.core.test_time import ADAPTERS, SourceContext, mode_problem, stream_problem
from fedjax_shift.data import federated, partitions
from fedjax_shift.pipelines.atp import (AdapterInputs, adapter_evaluator, check_adapters,
                                        source_examples)
from fedjax_shift.pipelines.base import PIPELINES, Results, hardware
from fedjax_shift.pipelines.run_config import algorithm_names, check_run
from fedjax_shift.pipelines.single_run import RunInputs, train_and_evaluate
from fedjax_shift.registry import (NONNEGATIVE, POSITIVE, POSITIVE_INT, TEXT, require,
                                   require_distinct,
                                   sequence_of)
from fedjax_shift.report import tta_bench as table

log = logging.getLogger('fedjax_shift')
# The adapters of TTAB's and Alfarra et al.'s sets that this library has, each at its
# own paper's defaults (config.adapters); (adapter, label, modes). A row is an
# (adapter, mode): the two modes agree for a method without state (no adaptation, LAME).
ADAPTER_ROWS = (('no_adapt', 'No adaptation', ('episodic',)),
                ('bn_adapt', 'BN-Adapt', ('episodic', 'online')),
                ('tent', 'Tent', ('episodic', 'online')),
                ('eata', 'EATA', ('episodic', 'online')),
                ('shot', 'SHOT-IM', ('episodic', 'online')),
                ('t3a', 'T3A', ('episodic', 'online')),
                ('memo', 'MEMO', ('episodic',)),
                ('lame', 'LAME', ('episodic',)),
                ('pl', 'PL', ('episodic', 'online')),
                ('conjugate_pl', 'Conjugate PL', ('episodic', 'online')),
                ('sar', 'SAR', ('episodic', 'online')),
                ('cotta', 'CoTTA', ('episodic', 'online')),
                ('rotta', 'RoTTA', ('online',)),
                ('note', 'NOTE', ('online',)))


def row_key(adapter: str, mode: str) -> str:
  return f'{adapter}@{mode}'


SECTIONS = {'tta_bench': {
    'rows': tuple(row_key(a, m) for a, _, modes in ADAPTER_ROWS for m in modes),
    'label': {row_key(a, m): label for a, label, modes in ADAPTER_ROWS for m in modes},
    # The i.i.d. stream at each of these batch sizes (TTAB and Alfarra et al.: 64; TTAB's
    # small-batch stress: down to 1), and the label-shifted stream at each of
    # label_shift_batch_sizes: classes in time order by Dirichlet(label_shift_concentration)
    # over as many time slots as classes (RoTTA, Yuan et al., CVPR 2023: γ = 0.1).
    'iid_batch_sizes': (64, 16, 4, 1),
    'label_shift_batch_sizes': (64,),
    'label_shift_concentration': 0.1,
    # The time-limited i.i.d. stream at each of these batch sizes (each one of
    # iid_batch_sizes, where C is measured; Alfarra et al.: 64); () for none.
    'time_limited_batch_sizes': (64,),
    # C per adapter: 0 measures it (needs a no_adapt row); >= 1 pins it.
    'stream_costs': {a: 0.0 for a, _, modes in ADAPTER_ROWS if 'online' in modes},
    'source_examples': 2000,     # labelled source examples the adapters may read (EATA's
                                 # Fisher: 2,000, Niu et al., ICML 2022; BBSE, SAR)
}}
RANGES = {
    'tta_bench.rows': sequence_of(TEXT, 1),    # '<adapter>@<mode>' (check)
    'tta_bench.label': TEXT,
    'tta_bench.iid_batch_sizes': sequence_of(POSITIVE_INT),
    'tta_bench.label_shift_batch_sizes': sequence_of(POSITIVE_INT),
    'tta_bench.label_shift_concentration': POSITIVE,
    'tta_bench.time_limited_batch_sizes': sequence_of(POSITIVE_INT),
    'tta_bench.stream_costs': NONNEGATIVE,
    'tta_bench.source_examples': POSITIVE_INT,
}


def row_parts(key: str) -> Tuple[str, str]:
  """(adapter, mode) of row ``key`` = '<adapter>@<mode>'."""
  adapter, _, mode = key.partition('@')
  return adapter, mode


def streams(config: ml_collections.ConfigDict) -> List[Tuple[str, int]]:
  """The table's columns but the time-limited ones: (order, batch size)."""
  bench = config.tta_bench
  return ([('iid', b) for b in bench.iid_batch_sizes] +
          [('label_shift', b) for b in bench.label_shift_batch_sizes])


def time_limited_rows(config: ml_collections.ConfigDict) -> List[str]:
  """The rows of the time-limited columns: the online ones whose adapter predicts the
  batches it has no time for."""
  return [key for key in config.tta_bench.rows if row_parts(key)[1] == 'online'
          and stream_problem(row_parts(key)[0], 'online', 2.0) is None]


def stream_costs(config: ml_collections.ConfigDict, timed: Dict[str, Dict]) -> Dict[str, float]:
  """C of every time-limited row: pinned (``tta_bench.stream_costs``) or its ms per
  batch on the same i.i.d. stream, ``timed`` ({row: timed_rows' result}), over no
  adaptation's; at least 1 (a row as fast as the stream adapts on every batch)."""
  pinned = config.tta_bench.stream_costs
  forward = next((timed[key]['ms_per_batch'] for key in timed
                  if row_parts(key)[0] == 'no_adapt'), None)
  costs = {}
  for key in time_limited_rows(config):
    adapter = row_parts(key)[0]
    cost = pinned.get(adapter, 0.0) or timed[key]['ms_per_batch'] / forward
    costs[key] = max(float(cost), 1.0)
  return costs


def check(config: ml_collections.ConfigDict) -> None:
  """The federated checks of the source model's run plus the rows and streams, before
  any data or compilation."""
  check_run(config)
  require(len(algorithm_names(config)) == 1, 'algorithms',
          f'the tta_bench pipeline trains one source model, got {algorithm_names(config)}')
  require(not config.data.pad_to, 'data.pad_to',
          'the test-time benchmark builds its own splits; leave pad_to at 0')
  bench = config.tta_bench
  require_distinct(bench.rows, 'tta_bench.rows', 'one row per (adapter, mode)')
  for key in bench.rows:
    adapter, mode = row_parts(key)
    require(adapter in ADAPTERS, 'tta_bench.rows',
            f'{key!r}: no adapter {adapter!r}; choose from {ADAPTERS.names()}')
    require(mode in ('episodic', 'online'), 'tta_bench.rows',
            f'{key!r}: a row is <adapter>@<mode>, mode episodic or online')
    problem = mode_problem(adapter, mode)
    require(problem is None, 'tta_bench.rows', f'{key!r}: {problem}')
    require(not ADAPTERS.meta(adapter).get('trained_by') and
            'alpha' not in ADAPTERS.meta(adapter).get('from_context', ()),
            'tta_bench.rows', f'{key!r}: {adapter} adapts what a federated method trains '
            f'(its pipeline runs it); this benchmark adapts a source model')
    require(key in bench.label, 'tta_bench.label', f'has no entry for row {key!r}')
    ADAPTERS.check(adapter, ADAPTERS.section(adapter, config.adapters),
                   f'config.adapters.{adapter}')
  require(bool(streams(config)), 'tta_bench.iid_batch_sizes',
          'name at least one stream (or tta_bench.label_shift_batch_sizes)')
  for field in ('iid_batch_sizes', 'label_shift_batch_sizes', 'time_limited_batch_sizes'):
    require_distinct(bench[field], f'tta_bench.{field}', 'one column per batch size')
  for batch_size in bench.time_limited_batch_sizes:
    require(batch_size in bench.iid_batch_sizes, 'tta_bench.time_limited_batch_sizes',
            f'{batch_size} is not one of iid_batch_sizes {tuple(bench.iid_batch_sizes)}, '
            f'where each row\'s cost C is measured')
  if bench.time_limited_batch_sizes:
    rows = time_limited_rows(config)
    require(bool(rows), 'tta_bench.time_limited_batch_sizes',
            'no online row can predict without adapting; set it to ()')
    unpinned = [key for key in rows if not bench.stream_costs.get(row_parts(key)[0], 0.0)]
    require(not unpinned or any(row_parts(key)[0] == 'no_adapt' for key in bench.rows),
            'tta_bench.stream_costs', f'rows {unpinned} measure their cost C against no '
            f"adaptation's forward pass: add a no_adapt row or pin their costs")
    for adapter, cost in bench.stream_costs.items():
      require(adapter in ADAPTERS, 'tta_bench.stream_costs',
              f'no adapter {adapter!r}; choose from {ADAPTERS.names()}')
      require(not cost or cost >= 1.0, f'tta_bench.stream_costs.{adapter}',
              f'must be 0 (measured) or >= 1 (forward passes per adapted batch), got {cost}')


def run_dirs(config: ml_collections.ConfigDict, workdir: str):
  return [(os.path.join(workdir, f'seed_{seed}', 'pretrain'), config, algorithm_names(config)[0])
          for seed in config.seeds]


def stream_data(data: CorruptedTests, order: np.ndarray) -> federated.FederatedData:
  """The corruptions as target clients [K = corruptions, M, ...], examples in ``order``."""
  x = np.stack([data.corrupted[name][order] for name in data.info['corruptions']])
  k, m = x.shape[:2]
  return federated.FederatedData(x, np.broadcast_to(data.y[order], (k, m)).copy(),
                                 np.ones((k, m), bool), np.full(k, m, np.int32))


def stream_order(config: ml_collections.ConfigDict, data: CorruptedTests, kind: str,
                 seed: int) -> np.ndarray:
  """The test examples' order in time: as drawn (i.i.d.) or label-shifted."""
  if kind == 'iid':
    return np.arange(len(data.y))
  return partitions.label_shifted_order(data.y, config.tta_bench.label_shift_concentration,
                                        np.random.default_rng([seed, 13]))


# A scan shorter than this is run again (up to TIMING_RUNS times in all) and timed by its
# fastest run: an executable's first call also pays for its buffers and threads.
TIMING_SECONDS = 1.0
TIMING_RUNS = 3


def timed_call(compiled, args) -> Tuple[Dict, float]:
  """The compiled scan's sums (as numpy) and its seconds: the fastest of its runs, which
  repeat while their total is under TIMING_SECONDS (TIMING_RUNS at most)."""
  runs, total = [], 0.0
  while not runs or (total < TIMING_SECONDS and len(runs) < TIMING_RUNS):
    tick = time.perf_counter()
    sums = jax.tree.map(np.asarray, jax.block_until_ready(compiled(*args)))
    runs.append(time.perf_counter() - tick)
    total += runs[-1]
  return sums, min(runs)


def timed_rows(config, module, inputs: AdapterInputs, target: federated.FederatedData,
               batch_size: int, num_classes: int, seed: int, log_prefix: str,
               costs: Dict[str, float] = None, warm_up: bool = False) -> Dict[str, Dict]:
  """Every row on one stream: {row: {'per_corruption' [K], 'compile_seconds',
  'ms_per_batch', 'adapted_batches' (where the adapter says)}}; ``target`` on the device.
  ``costs``: the time-limited stream, only these rows, each at its C ('stream_cost').
  ``warm_up``: run the first row once untimed (a process's first scan runs up to twice
  as long as the next: XLA:CPU's threads and buffers are set up then)."""
  ids = jnp.arange(target.num_clients, dtype=jnp.int32)
  key = jax.random.fold_in(jax.random.key(seed), 7)
  batches = target.num_clients * math.ceil(target.x.shape[1] / batch_size)
  out = {}
  for row in config.tta_bench.rows if costs is None else costs:
    adapter, mode = row_parts(row)
    cost = 0.0 if costs is None else costs[row]
    evaluate = adapter_evaluator(adapter, module, ADAPTERS.section(adapter, config.adapters),
                                 num_classes, batch_size, mode, stream_rate=cost)
    args = (inputs, inputs.variables, target, ids, key)
    tick = time.perf_counter()
    compiled = evaluate.lower(*args).compile()
    compile_seconds = time.perf_counter() - tick
    if warm_up and not out:
      jax.block_until_ready(compiled(*args))
    sums, seconds = timed_call(compiled, args)
    accuracy = evaluation.client_accuracy(sums)
    out[row] = {'per_corruption': accuracy.tolist(), 'compile_seconds': compile_seconds,
                'ms_per_batch': 1e3 * seconds / batches}
    if costs is not None:
      out[row]['stream_cost'] = cost
    if 'adapted_batches' in sums:
      out[row]['adapted_batches'] = float(sums['adapted_batches'].sum() /
                                          max(sums['batches'].sum(), 1))
    log.info('%s %-24s mean %.2f%%  worst %.2f%%  %.3f ms/batch (compiled in %.1f s)',
             log_prefix, config.tta_bench.label[row], 100 * np.mean(accuracy),
             100 * np.min(accuracy), out[row]['ms_per_batch'], compile_seconds)
  return out


def run_seed(config, workdir: str, seed: int) -> Dict:
  """Source model → every row × stream for one seed; writes test_time.json."""
  data = build_benchmark(config.data, seed)
  train = data.source.splits['train']
  federated.validate(train, data.source.num_classes, 'train')
  module = models.create(config.model, data.source.num_classes)
  bench = config.tta_bench
  source_x, source_y = (a[:bench.source_examples] for a in source_examples(train))
  batch_sizes = sorted({b for _, b in streams(config)})
  rows = [(key, *row_parts(key)) for key in bench.rows]
  for batch_size in batch_sizes:   # each stream's batch size, before anything trains
    check_adapters(module, rows, lambda name: ADAPTERS.section(name, config.adapters),
                   SourceContext(None, data.source.num_classes, batch_size, source_x, source_y,
                                 None, tuple(data.source.example_shape)),
                   len(data.y), 'tta_bench.rows')
  pre = train_and_evaluate(config, os.path.join(workdir, 'pretrain'), algorithm_names(config)[0],
                           seed, RunInputs(bench=data.source))
  variables = pre['server_state'].variables
  inputs = jax.block_until_ready(jax.device_put(AdapterInputs(variables, source_x, source_y, None)))
  clean = evaluation.split_metrics(module, variables, jnp.asarray(data.clean_x),
                                   jnp.asarray(data.y), jnp.ones(len(data.y), bool), 256)
  record = {'clean_accuracy': float(clean['correct'] / clean['count']),
            'streams': {}, 'pretrain_seconds': pre['train_seconds'], 'info': data.info}
  targets = {}   # each order's test stream, on the device once for all its batch sizes
  for order_kind, batch_size in streams(config):
    if order_kind not in targets:
      targets[order_kind] = jax.block_until_ready(jax.device_put(stream_data(
          data, stream_order(config, data, order_kind, seed))))   # not in the first row's time
    column = table.column_key(order_kind, batch_size)
    record['streams'][column] = timed_rows(
        config, module, inputs, targets[order_kind], batch_size, data.source.num_classes,
        seed, f'seed {seed} {column}', warm_up=not record['streams'])
  for batch_size in bench.time_limited_batch_sizes:   # C measured on the i.i.d. stream
    costs = stream_costs(config, record['streams'][table.column_key('iid', batch_size)])
    column = table.column_key('time_limited', batch_size)
    record['streams'][column] = timed_rows(
        config, module, inputs, targets['iid'], batch_size, data.source.num_classes, seed,
        f'seed {seed} {column}', costs)
  with open(os.path.join(workdir, 'test_time.json'), 'w') as f:
    json.dump(record, f, indent=1)
  return record



@PIPELINES.register('tta_bench', defaults=SECTIONS, ranges=RANGES, check=check,
                    run_dirs=run_dirs)
def run(config: ml_collections.ConfigDict, workdir: str) -> Results:
  """Every seed (validated by ``pipelines.run``); writes results.json and the table."""
  info = hardware()
  tick = time.perf_counter()
  per_seed = {}
  for seed in config.seeds:
    run_dir = os.path.join(workdir, f'seed_{seed}')
    os.makedirs(run_dir, exist_ok=True)
    per_seed[seed] = run_seed(config, run_dir, seed)
  seconds = time.perf_counter() - tick
  records = table.records(per_seed, config.tta_bench.label, tuple(config.tta_bench.rows))
  first = per_seed[config.seeds[0]]['info']
  preamble = (f"Test-time adaptation benchmark on {config.data.source}: "
              f"{first['train_examples']} training examples over {first['clients']} "
              f"client(s) ({algorithm_names(config)[0]}, {config.rounds} rounds, model "
              f"{config.model.name}); {first['test_examples']} test images under "
              f"{len(first['corruptions'])} corruptions at severity {first['severity']}; "
              f"seeds {tuple(config.seeds)}; {seconds:.0f} s on {info['device_kind']} "
              f"({info['backend']}).")
  markdown = table.tables(records)
  results_json = os.path.join(workdir, 'results.json')
  with open(results_json, 'w') as f:
    json.dump({**records, 'seconds': seconds, 'hardware': info,
               'config': {'source': config.data.source, 'model': config.model.name,
                          'algorithm': algorithm_names(config)[0], 'rounds': config.rounds}},
              f, indent=1)
  return Results(preamble, (markdown,), (results_json,), {**records, 'markdown': markdown})
