"""Test-time cases: an adapter's vmapped scan over target clients against a Python
loop of jitted steps, its episodic and transductive modes, FedTTA++'s early stop.
"""
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_shift import models
from fedjax_shift.adapters import atp as atp_lib
from fedjax_shift.adapters.fedicon import ContrastiveTTA, fedicon_tta
from fedjax_shift.adapters.fedthe import fedthe_adapter
from fedjax_shift.adapters.fedtta import Adaptation, adapt, fedtta_adapter
from fedjax_shift.adapters.surgical import selection_scores, source_selected
from fedjax_shift.adapters.tent import tent
from fedjax_shift.algorithms.fedthe import PersonalState, personal_model
from fedjax_shift.adapters import ADAPTERS
from fedjax_shift.core.test_time import AdaptBatch, SourceContext, build_test_time
from fedjax_shift.parts import atp_rates
from fedjax_shift.parts.fedtta_step import InnerStep
from launch.benchmarks import register
from launch.benchmarks.common import FLAGS, num_clients, timed
from launch.benchmarks.engine import cohort_data, make_config, setup_algorithm



def case_tta(vmapped: bool, mode: str = 'online'):
  """An adapter (--tta_adapter) on C target clients × N test examples, batches of B: the
  jitted vmapped scan of core/test_time.py in ``mode`` ('online', 'episodic', or
  'transductive': --tta_epochs passes, then prediction), or a Python loop over clients
  and batches of a jitted ``adapter.step`` (online)."""
  config = make_config()
  module = models.create(config.model, 10)
  data = cohort_data(num_clients())
  variables = models.init(module, jax.random.key(0), jnp.asarray(data.x[0, :1]))
  if FLAGS.tta_adapter == 'atp':
    alpha = jax.tree.map(lambda a: a + 0.1, atp_rates.init_alpha(variables))
    adapter = atp_lib.atp(module, alpha)
  elif FLAGS.tta_adapter == 'tent':
    adapter = tent(module)
  elif FLAGS.tta_adapter == 'surgical':   # selection on the cohort's first 1,000 examples
    shape = data.x.shape[2:]
    context = SourceContext(variables, 10, FLAGS.batch_size,
                            jnp.asarray(data.x.reshape((-1,) + shape)[:1000]),
                            jnp.asarray(data.y.reshape(-1)[:1000]), None, shape)
    tick = time.perf_counter()
    jax.block_until_ready(selection_scores(module, context, 0.1, (), 1000)[0])
    select_s = time.perf_counter() - tick   # compile included: it runs once per build
    adapter = source_selected(module, context, 0.1, 'after', (), 1000)
  elif FLAGS.tta_adapter == 'fedicon':   # a FedICON model: encoder, projection, head
    _, _, _, _, server = setup_algorithm(num_clients(), 'algorithm:fedicon')
    variables = server.variables
    adapter = fedicon_tta(module, FLAGS.batch_size, ContrastiveTTA(
        memory_size=8 * FLAGS.batch_size, epochs=FLAGS.tta_epochs))
  elif FLAGS.tta_adapter != 'fedthe':    # any registered adapter, its defaults
    adapter = registered_adapter(FLAGS.tta_adapter, module, variables, data)
  else:                                  # a FedTHE model: two heads and the features
    _, _, _, _, server = setup_algorithm(num_clients(), 'algorithm:fedthe')
    state = PersonalState(server.variables['params']['head'], server.global_feature)
    variables = personal_model(server, state, server.variables)
    adapter = fedthe_adapter(module)
  key = jax.random.key(0)
  if vmapped:
    run_all = build_test_time(adapter, FLAGS.batch_size, mode)
    device_data = jax.device_put(data)
    run = lambda: jax.block_until_ready(run_all(variables, device_data, key))
  else:
    step = jax.jit(adapter.step)
    batches = [[AdaptBatch(jnp.asarray(data.x[k, s:s + FLAGS.batch_size]),
                           jnp.ones(FLAGS.batch_size))
                for s in range(0, FLAGS.examples, FLAGS.batch_size)]
               for k in range(num_clients())]

    def run():
      out = []
      for k in range(num_clients()):
        state = adapter.init(variables, jax.random.fold_in(key, k))
        for batch in batches[k]:
          state, logits = step(state, batch)
          out.append(logits)
      return jax.block_until_ready(out)
  tick = time.perf_counter()
  run()
  compile_s = time.perf_counter() - tick
  median, times = timed(run, FLAGS.repeats)
  result = {'seconds': median, 'times': times, 'compile_s': compile_s}
  if FLAGS.tta_adapter == 'surgical':
    result['select_s'] = select_s
  return result


def registered_adapter(name: str, module, variables, data):
  """Adapter ``name`` with its registered defaults, on a context of C = 10 classes, the
  test batch --batch_size and the data's example shape."""
  if name not in ADAPTERS:
    raise ValueError(f'--tta_adapter / --tta_compare: unknown adapter {name!r}; registered: '
                     f'{ADAPTERS.names()}')
  context = SourceContext(variables, 10, FLAGS.batch_size, input_shape=tuple(data.x.shape[2:]))
  return ADAPTERS.get(name)(module, ADAPTERS.defaults(name), context)


# The model work in a test batch of B at the registered defaults: (gradient steps,
# forward passes besides them). Tent, EATA, SHOT-IM, PL and conjugate PL: one step (their
# prediction is its forward); SAR: two steps (SAM); CoTTA: a step and the source and the
# teacher on the batch and the teacher on 32 augmented copies; RoTTA: the teacher on the
# batch, and every 64 examples the teacher on the memory and the student's step on its
# augmented copy; NOTE: the batch, and every 64 examples a step on the memory; LAME,
# BN-Adapt, T3A and no adaptation: one forward.
WORK_PER_BATCH = {'sar': lambda b: (2.0, 0.0), 'cotta': lambda b: (1.0, 34.0),
                  'rotta': lambda b: (b / 64, 1 + b / 64), 'note': lambda b: (b / 64, 1.0),
                  'lame': lambda b: (0.0, 1.0), 'no_adapt': lambda b: (0.0, 1.0),
                  'bn_adapt': lambda b: (0.0, 1.0), 't3a': lambda b: (0.0, 1.0)}


def model_work(name: str, batch_size: int) -> tuple:
  """(gradient steps, forward passes) of adapter ``name`` per batch (one step if unlisted)."""
  return WORK_PER_BATCH.get(name, lambda b: (1.0, 0.0))(batch_size)


def model_passes(name: str, batch_size: int) -> float:
  """The work of a batch in forward-pass units, a gradient step counted as three (its
  forward and a backward of two)."""
  steps, forwards = model_work(name, batch_size)
  return 3 * steps + forwards


def case_tta_compare():
  """The adapters of --tta_compare online over the same C clients × N examples in batches
  of B (vmapped scans), each timed in turn within every repeat (interleaved), with the
  seconds per batch, the ratio to the first one's, that ratio per model pass
  (``model_passes``: the work each batch holds, relative to the first adapter's) and,
  where 'tent' is among them, the ratio to the measured cost of the batch's work
  (``model_work``): Tent's batch per gradient step and, per forward pass, every client's
  own copy of the model on its batch (one jitted vmapped call, timed in the same rounds)."""
  config = make_config()
  module = models.create(config.model, 10)
  data = jax.device_put(cohort_data(num_clients()))
  variables = models.init(module, jax.random.key(0), jnp.asarray(data.x[0, :1]))
  key = jax.random.key(0)
  runs, compile_s = {}, {}
  for name in FLAGS.tta_compare:
    run_all = build_test_time(registered_adapter(name, module, variables, data),
                              FLAGS.batch_size, 'online')
    runs[name] = functools.partial(lambda run_all: jax.block_until_ready(
        run_all(variables, data, key)), run_all)
    tick = time.perf_counter()
    runs[name]()
    compile_s[name] = time.perf_counter() - tick
  batches = -(-data.x.shape[1] // FLAGS.batch_size)
  # every client's own copy of the model, as an adapter's state holds it
  own = jax.tree.map(lambda v: jnp.broadcast_to(v, (num_clients(),) + v.shape).copy(),
                     variables)
  forward = jax.jit(jax.vmap(lambda v, x: models.apply(module, v, x)[0]))
  first_batch = data.x[:, :FLAGS.batch_size]
  jax.block_until_ready(forward(own, first_batch))
  forwards = lambda: [jax.block_until_ready(forward(own, first_batch)) for _ in range(batches)]
  times = {name: [] for name in (*runs, 'forward')}
  for _ in range(FLAGS.repeats):
    for name, run in (*runs.items(), ('forward', forwards)):
      tick = time.perf_counter()
      run()
      times[name].append(time.perf_counter() - tick)
  forward_s = float(np.median(times.pop('forward'))) / batches
  reference = FLAGS.tta_compare[0]
  median = {name: float(np.median(t)) for name, t in times.items()}
  rows = {}
  passes = {name: model_passes(name, FLAGS.batch_size) for name in runs}
  for name in runs:
    ratio = median[name] / median[reference]
    rows[name] = {'seconds': median[name], 'times': times[name], 'compile_s': compile_s[name],
                  'seconds_per_batch': median[name] / batches, 'ratio': ratio,
                  'passes_per_batch': passes[name],
                  'ratio_per_pass': ratio * passes[reference] / passes[name]}
    if 'tent' in runs:
      steps, forwards = model_work(name, FLAGS.batch_size)
      rows[name]['work_per_batch'] = [steps, forwards]
      rows[name]['ratio_to_work'] = median[name] / batches / (
          steps * median['tent'] / batches + forwards * forward_s)
  return {'seconds': median[reference], 'compile_s': compile_s[reference],
          'forward_seconds_per_batch': forward_s, 'adapters': rows}


def case_fedtta_test_time(loop: str, patience: int):
  """FedTTA++ on C new clients × N examples, episodic batches of B, E = 50 inner steps
  with entropy patience ``patience`` (0: all 50), as a masked ``lax.scan`` or a
  ``lax.while_loop``; the jitted vmapped scan of core/test_time.py over clients, on an
  untrained FedTTA model (the steps each client runs are reported)."""
  config, module, algorithm, data, server = setup_algorithm(num_clients(), 'fedtta')
  variables = algorithm.global_model(server)
  settings = Adaptation(InnerStep(0.5, 0.1), 50, patience, loop)
  adapter = fedtta_adapter(module, settings)
  run_all = build_test_time(adapter, FLAGS.batch_size, 'episodic')
  device_data = jax.device_put(data)
  key = jax.random.key(0)
  run = lambda: jax.block_until_ready(run_all(variables, device_data, key))
  tick = time.perf_counter()
  run()
  compile_s = time.perf_counter() - tick
  median, times = timed(run, FLAGS.repeats)
  first_batches = device_data.x[:, :FLAGS.batch_size]
  steps = jax.jit(jax.vmap(lambda x: adapt(module, variables, x, np.ones(FLAGS.batch_size,
                                                                         np.float32),
                                           settings)[1]))(first_batches)
  return {'seconds': median, 'times': times, 'compile_s': compile_s,
          'mean_steps_first_batch': float(np.mean(steps)), 'max_steps_first_batch':
          int(np.max(steps))}


register('tta_vmap', lambda name: f'{FLAGS.tta_adapter} online: vmapped lax.scan over clients',
         lambda name: case_tta(True))
register('tta_loop', lambda name: f'{FLAGS.tta_adapter} online: Python loop of jitted steps',
         lambda name: case_tta(False))
register('tta_episodic',
         lambda name: f'{FLAGS.tta_adapter} episodic: vmapped lax.scan over clients',
         lambda name: case_tta(True, 'episodic'))
register('tta_transductive',
         lambda name: f'{FLAGS.tta_adapter} transductive, {FLAGS.tta_epochs} passes then '
                      f'prediction: vmapped lax.scan over clients',
         lambda name: case_tta(True, 'transductive'))
register('tta_compare', lambda name: f'online scans of {",".join(FLAGS.tta_compare)}, '
                                     'interleaved', lambda name: case_tta_compare())
register('fedtta_e50', 'FedTTA test time, fixed E = 50 steps (scan)',
         lambda name: case_fedtta_test_time('scan', 0))
register('fedtta_pp_scan', 'FedTTA++ test time, E ≤ 50, patience 1, masked scan',
         lambda name: case_fedtta_test_time('scan', 1))
register('fedtta_pp_while', 'FedTTA++ test time, E ≤ 50, patience 1, while_loop',
         lambda name: case_fedtta_test_time('while', 1))
