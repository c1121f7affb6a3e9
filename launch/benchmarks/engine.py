"""Engine cases: the compiled round (any registered method, ATP's α round, learned
rates), the engine's loop backend, a Python loop of jitted clients, the fused
centralized step with the same FLOPs, rounds per call, HeteroFedTTA's grouped round.
"""
import ast
import collections
import glob
import gzip
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from configs.fedins import vit_model
from fedjax_shift import algorithms, models
from fedjax_shift.algorithms import base, hetero_fedtta
from fedjax_shift.config import base_config
from fedjax_shift.core.algorithm import ClientData
from fedjax_shift.core.groups import build_grouped_round, init_group_states, split_groups
from fedjax_shift.core.local import LocalSchedule
from fedjax_shift.core.round import (NO_STEP_LIMIT, RoundConfig, aggregation_weights,
                                     build_round, round_key, stack_client_states)
from fedjax_shift.core.test_time import ADAPTERS, SourceContext
from fedjax_shift.data.federated import FederatedData
from fedjax_shift.pipelines import atp as atp_pipeline
from fedjax_shift.pipelines.atp import build_rates_training, learned_row
from fedjax_shift.pipelines.programs import round_config as pipeline_round_config
from fedjax_shift.pipelines.runs import uploaded_parameters
from launch.benchmarks import register
from launch.benchmarks.common import (FLAGS, SHAPES, cohort_arrays, conv_choice, num_clients,
                                      padded_examples, real_steps, timed, unroll_value)



def make_config():
  config = base_config()
  config.model.name = FLAGS.model
  config.model.conv = conv_choice()
  if FLAGS.model == 'vit':   # configs/fedins.py's ViT (no convolution choice)
    config.model = vit_model()
  if FLAGS.model == 'domainbed64':   # DomainBed's MNIST trunk + Linear 128→64 (Table 7)
    config.model = {'name': 'domainbed_cnn', 'hidden': 64, 'conv': conv_choice()}
  if FLAGS.model == 'lenet5':   # the FedTTA authors' Fashion-MNIST LeNet (1,663,370 parameters)
    config.model = {'name': 'lenet5', 'channels': (32, 64), 'features': 512,
                    'conv': conv_choice()}
  config.client.batch_size = FLAGS.batch_size
  config.client.learning_rate = 0.01
  config.client.local_epochs = 1
  config.engine.unroll = unroll_value()
  return config


def cohort_data(num_clients) -> FederatedData:
  """``cohort_arrays`` as the engine's FederatedData."""
  return FederatedData(*cohort_arrays(num_clients))


def setup_algorithm(num_clients_data, kind='fedavg'):
  """kind: 'fedavg' (one epoch), 'fedavg_1step' (one local step), 'fedevolve',
  'fedtta' (one epoch), 'alpha' (ATP's α training around the initial model, one α
  step) or 'algorithm:<name>' (any registered method with its defaults, one epoch,
  every client of the cohort in the population)."""
  config = make_config()
  module = models.create(config.model, 10)
  data = cohort_data(num_clients_data)
  if kind == 'fedavg_1step':
    config.client.local_steps = 1
  info = {'num_domains': 10} if kind == 'fedevolve' else {}  # 10 source domains of N/10
  name = kind if kind in ('fedevolve', 'fedtta') else 'fedavg'
  if kind.startswith('algorithm:'):
    name, *fields = kind.split(':')[1:]
    for field in fields:   # '<field>=<value>' of the method's section, or
      key, value = field.split('=', 1)   # 'client.<field>=<value>', its client override
      if key.startswith('client.'):
        if name not in config.client_overrides:
          config.client_overrides[name] = {}
        config.client_overrides[name][key[len('client.'):]] = ast.literal_eval(value)
      else:
        config[name][key] = ast.literal_eval(value)
    config.cohort_size = num_clients_data   # the round below takes every client
  algorithm = algorithms.build(name, config, module, padded_examples(), info,
                               num_clients=num_clients_data, example_shape=data.x.shape[2:])
  server = algorithm.init(jax.random.key(0), jnp.asarray(data.x[0, :1]))
  if kind.startswith('rates:'):   # rates:<K>:<remat|plain>, one step on K·B examples
    algorithm = rates_algorithm(config, module, server.variables, kind)
    server = algorithm.init(jax.random.key(0), jnp.asarray(data.x[0, :1]))
  if kind == 'alpha':
    config.atp.local_steps = 1
    config.atp.batch_size = FLAGS.batch_size
    algorithm = algorithms.build('atp', atp_pipeline.alpha_config(config), module,
                                 padded_examples(), global_variables=server.variables)
    server = algorithm.init(jax.random.key(0), jnp.asarray(data.x[0, :1]))
  return config, module, algorithm, data, server


def rates_algorithm(config, module, variables, kind: str):
  """The learned-rates round (adapters/learned_rates.py) of --tta_adapter (ATP's α
  online: the pipeline's row atp_online_k, or Tent's per-layer rates online:
  tent_learned) through K test batches of B, one local SGD step, ``remat`` on or off."""
  _, k, remat = kind.split(':')
  key = 'tent_learned' if FLAGS.tta_adapter == 'tent' else 'atp_online_k'
  config.learned.num_batches[key] = int(k)
  config.learned.remat = remat == 'remat'
  config.learned.local_steps = 1
  config.learned.optimizer = 'sgd'
  adapter = learned_row(config, key)[0]
  hparams = ADAPTERS.section(adapter, config.adapters)
  context = SourceContext(variables, 10, FLAGS.batch_size)
  return build_rates_training(config, key, module, hparams, context, FLAGS.examples)[0]


def round_config(config, data, backend: str = 'vmap'):
  """The engine's RoundConfig of the cohort as the pipeline builds it
  (``pipelines.programs.round_config``): every client in the round, sorted by
  examples, groups of --client_chunk or fitted under --max_scanned, each cut to its
  fitted padded size."""
  config.cohort_size = num_clients()
  config.engine.client_chunk = FLAGS.client_chunk
  if FLAGS.max_scanned is not None:
    config.engine.max_scanned = FLAGS.max_scanned
  config.engine.backend = backend
  return pipeline_round_config(config, data)


def case_round(backend='vmap', kind='fedavg'):
  config, _, algorithm, data, server = setup_algorithm(num_clients(), kind)
  clients = stack_client_states(algorithm, server, num_clients())
  round_cfg = round_config(config, data, backend)
  _, round_host = build_round(algorithm, round_cfg, backend=backend)
  device_data = jax.device_put(data)
  ids = jnp.arange(num_clients(), dtype=jnp.int32)
  key = jax.random.key(0)
  tick = time.perf_counter()
  flops = None
  if backend == 'vmap':
    compiled = round_host.lower(server, clients, device_data, ids, key).compile()
    flops = xla_flops(compiled)
  else:  # the loop backend compiles on its first call (which also runs the round)
    compiled = round_host
    jax.block_until_ready(compiled(server, clients, device_data, ids, key))
  compile_s = time.perf_counter() - tick
  run = lambda: jax.block_until_ready(compiled(server, clients, device_data, ids, key))
  median, times = timed(run, FLAGS.repeats)
  result = {'seconds': median, 'times': times, 'compile_s': compile_s,
            'uploaded_parameters': uploaded_parameters(algorithm, server, clients, data),
            'client_chunk': round_cfg.client_chunk}
  if flops:
    result['flops'] = flops
  metrics = run().metrics
  if 'scanned_steps' in metrics:
    result['local_steps'] = int(metrics['local_steps'])
    result['scanned_steps'] = int(metrics['scanned_steps'])
  if FLAGS.trace and backend == 'vmap':
    result['kernels'] = traced_kernels(run, os.path.join(
        FLAGS.trace, f'{FLAGS.model}_{num_clients()}_{conv_choice()}'))
  return result


def xla_flops(compiled):
  """The FLOPs XLA's cost analysis counts in a compiled program (None where the backend
  gives none)."""
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):   # one dict per program in older jax
    analysis = analysis[0] if analysis else {}
  return float(analysis['flops']) if analysis and analysis.get('flops') else None


def traced_kernels(run, logdir: str, top: int = 12) -> dict:
  """One call of ``run`` under ``jax.profiler.trace`` into ``logdir``: kernel_summary of
  its Perfetto trace, and the trace's path."""
  with jax.profiler.trace(logdir, create_perfetto_trace=True):
    run()
  path = sorted(glob.glob(os.path.join(logdir, '**', 'perfetto_trace.json.gz'),
                          recursive=True))[-1]
  with gzip.open(path) as f:
    trace = json.load(f)
  return {'trace': path, **kernel_summary(trace, top)}


def kernel_summary(trace, top: int) -> dict:
  """The device kernels of a Perfetto trace (events of processes named /device:…, e.g.
  CUDA streams) summed by name: their total seconds and the ``top`` longest as [name,
  seconds, calls]. A CPU-only trace has no device process: total 0, no kernels."""
  events = trace['traceEvents'] if isinstance(trace, dict) else trace
  devices = {e['pid'] for e in events if e.get('ph') == 'M' and e.get('name') == 'process_name'
             and e['args']['name'].startswith('/device:')}
  total, calls = collections.Counter(), collections.Counter()
  for e in events:
    if e.get('ph') == 'X' and e['pid'] in devices:
      total[e['name']] += e.get('dur', 0) / 1e6   # microseconds
      calls[e['name']] += 1
  return {'kernel_seconds': sum(total.values()),
          'top': [[name, seconds, calls[name]] for name, seconds in total.most_common(top)]}


def case_rounds(scan: bool):
  """--rounds_per_call R consecutive rounds (state chained, cohort = every client):
  R calls of the compiled round, reading the loss back after each as the trainer does,
  or one call scanning R rounds (config.engine.rounds_per_call). Seconds per round."""
  _, _, algorithm, data, server = setup_algorithm(num_clients())
  clients = stack_client_states(algorithm, server, num_clients())
  count = FLAGS.rounds_per_call
  round_config = RoundConfig(cohort_size=num_clients(), client_chunk=FLAGS.client_chunk)
  device_data = jax.device_put(data)
  seed_key = jax.random.key(0)
  if scan:
    rounds = build_round(algorithm, round_config, rounds_per_call=count)[0]
    keys = jax.vmap(lambda r: round_key(seed_key, r))(jnp.arange(count))
    active = jnp.ones(count, bool)
    run = lambda: np.asarray(rounds(server, clients, device_data, keys, active).metrics['loss'])
  else:
    round_device = build_round(algorithm, round_config)[0]

    def run():
      state, states = server, clients
      for r in range(count):
        out = round_device(state, states, device_data, round_key(seed_key, r))
        float(out.metrics['loss'])
        state, states = out.server_state, out.client_states

  tick = time.perf_counter()
  run()
  compile_s = time.perf_counter() - tick  # the first call: compilation plus R rounds
  median, times = timed(run, FLAGS.repeats)
  return {'seconds': median / count, 'times': [t / count for t in times],
          'compile_s': compile_s}


def case_loop():
  _, _, algorithm, data, server = setup_algorithm(num_clients())
  client_update = jax.jit(algorithm.client_update)
  server_update = jax.jit(algorithm.server_update)
  clients = [ClientData(jnp.asarray(data.x[k]), jnp.asarray(data.y[k]),
                        jnp.asarray(data.mask[k]), jnp.int32(data.num_examples[k]),
                        jnp.int32(NO_STEP_LIMIT)) for k in range(num_clients())]
  weights = aggregation_weights(jnp.asarray(data.num_examples), 'num_examples')
  key = jax.random.key(0)

  def run():
    outputs = [client_update(server, (), clients[k], jax.random.fold_in(key, k))[0]
               for k in range(num_clients())]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *outputs)
    return jax.block_until_ready(server_update(server, stacked, weights))

  tick = time.perf_counter()
  run()
  compile_s = time.perf_counter() - tick
  median, times = timed(run, FLAGS.repeats)
  return {'seconds': median, 'times': times, 'compile_s': compile_s}


def case_fused():
  config, module, _, data, server = setup_algorithm(num_clients())
  # The cohort's real local steps (Σ_k ceil(n_k / B)) as steps of one pooled batch of
  # C·B examples: the same FLOPs as the round's real work.
  steps = -(-real_steps(data.num_examples) // num_clients())
  pooled = num_clients() * FLAGS.batch_size
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.random((steps, pooled) + data.x.shape[2:], dtype=np.float32))
  y = jnp.asarray(rng.integers(0, 10, (steps, pooled)).astype(np.int32))
  loss_fn = base.cross_entropy_loss(module)
  optimizer = optax.sgd(config.client.learning_rate)
  params, model_state = base.split_variables(server.variables)

  @jax.jit
  def fused(params, model_state):
    def step(carry, batch):
      params, model_state = carry
      (_, model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
          params, model_state, batch[0], batch[1], jnp.ones(pooled), None)
      updates, _ = optimizer.update(grads, optimizer.init(params), params)
      return (optax.apply_updates(params, updates), model_state), None
    return jax.lax.scan(step, (params, model_state), (x, y), unroll=config.engine.unroll)[0]

  tick = time.perf_counter()
  compiled = fused.lower(params, model_state).compile()
  compile_s = time.perf_counter() - tick
  median, times = timed(lambda: jax.block_until_ready(compiled(params, model_state)),
                        FLAGS.repeats)
  return {'seconds': median, 'times': times, 'compile_s': compile_s}


def case_hetero(sizes):
  """HeteroFedTTA's grouped round (core/groups.py): the C clients dealt in turn to the
  architectures ``sizes``, every client in the round, a public set of 500 random
  images in batches of 50; the algorithm's defaults (10 digest steps) and one epoch of
  FedTTA meta-training steps."""
  config = make_config()
  hparams = config.hetero_fedtta
  hparams.sizes = sizes
  data = cohort_data(num_clients())
  public_x = np.random.default_rng(1).random((500,) + SHAPES[FLAGS.model],
                                             dtype=np.float32)
  schedule = LocalSchedule(FLAGS.batch_size, 1, 0, FLAGS.examples, config.engine.unroll)
  algorithm = hetero_fedtta.build(hparams, 10, public_x, optax.sgd(0.01), schedule,
                                  jnp.asarray(data.x[0, :1]))
  group_ids = [np.arange(g, num_clients(), len(sizes), dtype=np.int32)
               for g in range(len(sizes))]
  round_fn = build_grouped_round(algorithm, [len(ids) for ids in group_ids], 'uniform')
  server = algorithm.init(jax.random.key(0))
  states = init_group_states(algorithm, jax.random.key(1), group_ids)
  server = server._replace(round=jnp.int32(1))   # past round 0: the digest runs
  group_data = jax.device_put(split_groups(data, group_ids))
  ids = tuple(jnp.asarray(i) for i in group_ids)
  key = jax.random.key(0)
  tick = time.perf_counter()
  compiled = round_fn.lower(server, states, group_data, ids, key).compile()
  compile_s = time.perf_counter() - tick
  run = lambda: jax.block_until_ready(compiled(server, states, group_data, ids, key))
  median, times = timed(run, FLAGS.repeats)
  return {'seconds': median, 'times': times, 'compile_s': compile_s}


def method_label(name: str) -> str:
  """'algorithm:<method>[:<field>=<value>…]': the method's round and its settings (a
  field of its section, or client.<field>: its client override)."""
  method, *fields = name.split(':')[1:]
  return f"{method} round, 1 epoch ({', '.join(fields) if fields else 'registered defaults'})"


def rates_label(name: str) -> str:
  """'rates:<K>:<remat|plain>': the learned-rates round of --tta_adapter."""
  _, k, remat = name.split(':')
  return (f"learned-rates round ({FLAGS.tta_adapter if FLAGS.tta_adapter == 'tent' else 'atp'}"
          f"-online), K = {k}, remat {'on' if remat == 'remat' else 'off'}, 1 step")


register('round', '(a) compiled vmapped round', lambda name: case_round())
register('loop', '(b) Python loop of jitted clients', lambda name: case_loop())
register('fused', '(c) fused centralized step (same FLOPs)', lambda name: case_fused())
register('loop_backend', "engine backend='loop' round", lambda name: case_round('loop'))
register('rounds_calls', lambda name: f'{FLAGS.rounds_per_call} rounds as '
         f'{FLAGS.rounds_per_call} calls (loss read each round), per round',
         lambda name: case_rounds(scan=False))
register('rounds_scan', lambda name: f'{FLAGS.rounds_per_call} rounds as one scan '
         f'(rounds_per_call={FLAGS.rounds_per_call}), per round',
         lambda name: case_rounds(scan=True))
register('fedavg_1step', 'FedAvg round, 1 local step',
         lambda name: case_round(kind='fedavg_1step'))
register('fedevolve', 'FedEvolve round, 1 local iteration (9 domain pairs)',
         lambda name: case_round(kind='fedevolve'))
register('fedtta', 'FedTTA round, 1 epoch (inner + outer step each)',
         lambda name: case_round(kind='fedtta'))
register('fedtta_loop', "FedTTA round, 1 epoch, engine backend='loop'",
         lambda name: case_round('loop', kind='fedtta'))
register('alpha_round', 'ATP α round, 1 α step', lambda name: case_round(kind='alpha'))
register('hetero_fedtta', 'HeteroFedTTA grouped round, 3 architectures (digest + 1 epoch + '
         'public logits)', lambda name: case_hetero(('small', 'medium', 'big')))
register('hetero_fedtta_medium', 'HeteroFedTTA round, all clients medium (one group)',
         lambda name: case_hetero(('medium',)))
register('algorithm:', method_label, lambda name: case_round(kind=name))
register('rates:', rates_label, lambda name: case_round(kind=name))
