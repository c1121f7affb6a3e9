"""Many runs and whole runs: vmapped seeds, a hyperparameter grid as one program,
several processes, the host-store population sweep, the default experiment with and
without event files, a large file's fingerprint.
"""
import json
import os
import shutil
import socket
import statistics as stats
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from configs import default
from fedjax_shift import algorithms, pipelines
from fedjax_shift.core.round import (HostStore, RoundConfig, build_round, round_key,
                                     stack_client_states)
from fedjax_shift.core.runs import grid_round, stack_runs
from fedjax_shift.data import partitions, sources, store as client_store
from fedjax_shift.pipelines import sweep
from fedjax_shift.pipelines import fingerprints
from fedjax_shift.pipelines.programs import round_config as pipeline_round_config
from launch.benchmarks import register
from launch.benchmarks.common import FLAGS, first_then_timed, num_clients, timed
from launch.benchmarks.engine import setup_algorithm



def case_seeds(vmapped: bool):
  """FLAGS.seeds seeds of the FedAvg round on the same cohort (each its own init and
  keys): one call of the round vmapped over seeds (engine.vmap_seeds), or one call per
  seed. Seconds per round of all seeds."""
  config, _, algorithm, data, _ = setup_algorithm(num_clients())
  seeds = range(FLAGS.seeds)
  servers = [algorithm.init(jax.random.key(s), jnp.asarray(data.x[0, :1])) for s in seeds]
  clients = [stack_client_states(algorithm, server, num_clients()) for server in servers]
  round_device, _ = build_round(algorithm, RoundConfig(cohort_size=num_clients()))
  device_data = jax.device_put(data)
  keys = [round_key(jax.random.key(s), 0) for s in seeds]
  if vmapped:
    stack = lambda trees: jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)
    round_all = jax.jit(jax.vmap(round_device))
    args = (stack(servers), stack(clients), stack([device_data] * FLAGS.seeds),
            jnp.stack(keys))
    run = lambda: jax.block_until_ready(round_all(*args))
  else:
    run = lambda: jax.block_until_ready([round_device(servers[s], clients[s], device_data,
                                                      keys[s]) for s in seeds])
  return first_then_timed(run)


def case_grid(vmapped: bool):
  """len(FLAGS.grid_rates) client learning rates × FLAGS.seeds seeds of the FedAvg
  round on the same cohort: the sweep's one program (core.runs.grid_round over the
  traced rate) or one run after another. Seconds per round of all runs; 'compile_s':
  the first round of all runs (every compilation)."""
  config, module, algorithm, data, _ = setup_algorithm(num_clients())
  rates = [float(rate) for rate in FLAGS.grid_rates]
  seeds = range(FLAGS.seeds)

  def round_at(rate):
    point = sweep.with_values(config, {'client.learning_rate': rate})
    built = algorithms.build('fedavg', point, module, FLAGS.examples, {},
                             num_clients=num_clients(), example_shape=data.x.shape[2:],
                             check=False)
    return build_round(built, RoundConfig(cohort_size=num_clients()))[0]

  servers = [algorithm.init(jax.random.key(s), jnp.asarray(data.x[0, :1])) for s in seeds]
  clients = [stack_client_states(algorithm, server, num_clients()) for server in servers]
  device_data = jax.device_put(data)
  keys = [round_key(jax.random.key(s), 0) for s in seeds]
  if vmapped:
    round_all = grid_round(lambda values, *args: round_at(values[0])(*args), len(rates),
                           len(seeds))
    args = ((jnp.stack([jnp.asarray(rate) for rate in rates]),),
            stack_runs(servers * len(rates)), stack_runs(clients * len(rates)),
            stack_runs([device_data] * len(seeds)), jnp.stack(keys))
    run = lambda: jax.block_until_ready(round_all(*args))
  else:
    rounds = [round_at(rate) for rate in rates]
    run = lambda: jax.block_until_ready([one(servers[s], clients[s], device_data, keys[s])
                                         for one in rounds for s in seeds])
  return first_then_timed(run)


def case_processes(count: int):
  """FedAvg on configs/default.py:tiny (cohort 4, 10 rounds) over 4 CPU devices as
  ``count`` processes of 4 / count devices each, through launch/train.py."""
  workdir = tempfile.mkdtemp(prefix='fedjax_shift_processes_')
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=(
      os.environ.get('XLA_FLAGS', '') +
      f' --xla_force_host_platform_device_count={4 // count}').strip())
  argv = [sys.executable, os.path.join(root, 'launch', 'train.py'), f'--workdir={workdir}',
          f'--config={os.path.join(root, "configs", "default.py")}:tiny',
          "--config.algorithms=('fedavg',)", '--config.cohort_size=4', '--config.rounds=10',
          '--config.eval_every=10', '--config.engine.num_devices=4', '--compilation_cache=']
  try:
    if count > 1:
      with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
      procs = [subprocess.Popen(argv + ['--distributed', f'--coordinator=127.0.0.1:{port}',
                                        f'--num_processes={count}', f'--process_id={i}'],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for i in range(count)]
      if any(proc.wait() for proc in procs):
        raise RuntimeError(f'a process of the {count}-process run failed')
    else:
      subprocess.run(argv, env=env, check=True, capture_output=True)
    with open(os.path.join(workdir, 'fedavg', 'seed_0', 'metrics.jsonl')) as f:
      records = [json.loads(line) for line in f]
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  times = [r['round_seconds'] for r in records[1:]]
  return {'seconds': stats.median(times), 'times': times,
          'compile_s': records[0]['round_seconds']}


# The population cases' data: rotated Fashion-MNIST, 12 angles 0°-165° over the 70,000
# images (840,000 distinct examples) when Debian's dataset-fashion-mnist is installed (or
# launch/gpu_check.sh fmnist_data copied it to .data/fashion-mnist), else
# the 5,000 embedded digits (60,000); each population gets EXAMPLES_PER_CLIENT × K of them.
ANGLES = tuple(range(0, 180, 15))
EXAMPLES_PER_CLIENT = 8.4   # 840,000 images over 100,000 clients


def rotated_population(population: int, rng: np.random.Generator):
  """(ClientStore, source name): EXAMPLES_PER_CLIENT × ``population`` distinct (image,
  angle) pairs of ``ANGLES`` (every pair when the population is that large), dealt by
  Dirichlet(0.1) label skew without a minimum, each rotated image rounded back to 8-bit
  pixels and written once, straight into the store's client order."""
  for folder in (sources.FASHION_MNIST_DIR, os.path.join('.data', 'fashion-mnist')):
    if sources.idx_pairs(folder, 'train+test'):   # Debian's, or gpu_check.sh fmnist_data's
      images, labels = sources.idx_arrays(folder, 'train+test')
      name = 'rotated Fashion-MNIST'
      break
  else:
    embedded = sources.mnist_embedded()
    images, labels = np.rint(embedded.x * 255).astype(np.uint8), embedded.y
    name = 'rotated embedded MNIST'
  images = images.reshape((-1, 28, 28, 1))
  pairs = len(ANGLES) * len(labels)
  chosen = np.sort(rng.permutation(pairs)[:min(pairs, int(EXAMPLES_PER_CLIENT * population))])
  angle_of, image_of = np.divmod(chosen, len(labels))
  parts = partitions.dirichlet(np.asarray(labels)[image_of], population, 0.1, rng,
                               min_examples=0)
  order = np.concatenate(parts)
  x = client_store.aligned_empty((len(order), 28, 28, 1), np.uint8)   # used in place
  for a, angle in enumerate(ANGLES):
    at = np.flatnonzero(angle_of[order] == a)   # store rows holding this angle
    for start in range(0, len(at), 10_000):
      rows = at[start:start + 10_000]
      block = images[image_of[order[rows]]].astype(np.float32) / 255
      x[rows] = np.rint(sources.rotate(block, angle) * 255).astype(np.uint8)
  return client_store.from_arrays(x, np.asarray(labels)[image_of[order]],
                                  [len(p) for p in parts], 'train'), name


def case_population(population: int, placement: str):
  """FedAvg rounds at cohort ``num_clients()`` over a population of ``population``
  clients holding distinct real examples (``rotated_population``), stored compactly
  (data/store.py) on the device or in host memory. Reports the store's bytes against
  the examples' own and the host→device bytes a round moves against the cohort's real
  examples' bytes."""
  tick = time.perf_counter()
  data, name = rotated_population(population, np.random.default_rng(0))
  build_s = time.perf_counter() - tick
  config, _, algorithm, _, server = setup_algorithm(num_clients())
  config.cohort_size = num_clients()
  round_config = pipeline_round_config(config, data, 'fedavg')
  clients = stack_client_states(algorithm, server, population)
  seed_key = jax.random.key(0)
  round_device, round_host = build_round(algorithm, round_config)
  host = HostStore(data, seed_key, round_config) if placement == 'host' else None
  on_device = jax.device_put(data) if host is None else None
  state = {'round': 0, 'cohort_bytes': [], 'fallbacks': 0, 'steps': [], 'scanned': []}
  example_bytes = int(np.prod(data.example_shape)) * data.x.dtype.itemsize

  def run():
    r = state['round']
    key = round_key(seed_key, r)
    if host is not None:
      cohort, ids = host.cohort(r)
      out = round_host(server, clients, cohort, ids, key)
    else:
      out = round_device(server, clients, on_device, key)
    state['cohort_bytes'].append(int(out.metrics['cohort_examples']) * example_bytes)
    state['fallbacks'] += int(out.metrics.get('fallback_plan', 0))
    state['steps'].append(int(out.metrics['local_steps']))
    state['scanned'].append(int(out.metrics['scanned_steps']))
    state['round'] += 1
    return jax.block_until_ready(out.server_state)

  first_s = time.perf_counter()
  run()
  compile_s = time.perf_counter() - first_s
  median, times = timed(run, FLAGS.sweep_repeats)
  rounds = state['round']
  sent = 0.0
  if host is not None:
    host.close()
    sent = host.bytes_sent / (rounds + 1)   # every fetched cohort, the prefetched one too
  sizes = np.asarray(data.num_examples)
  return {'seconds': median, 'times': times, 'compile_s': compile_s, 'data': name,
          'build_s': build_s, 'examples': int(sizes.sum()),
          'store_bytes': data.nbytes, 'example_bytes': int(sizes.sum()) * example_bytes,
          'sent_bytes_per_round': sent,
          'cohort_bytes_per_round': float(np.mean(state['cohort_bytes'])),
          'median_client': float(np.median(sizes)), 'largest_client': int(sizes.max()),
          'group_examples': list(round_config.group_examples),
          'fallback_examples': list(round_config.fallback_examples),
          'fallback_rounds': state['fallbacks'], 'rounds': rounds,
          # rows a round gathers from the store: each group's clients at its padded size
          'gathered_rows': (round_config.client_chunk or config.cohort_size) * sum(
              round_config.group_examples or (data.max_examples,)),
          'local_steps': float(np.mean(state['steps'])),
          'scanned_steps': float(np.mean(state['scanned']))}


def case_experiment(tensorboard: bool):
  """The README's default experiment (configs/default.py) end to end in a fresh workdir,
  with or without the TensorBoard event files; 'seconds' is the whole run."""
  config = default.get_config()
  config.tensorboard = tensorboard
  config.progress = False
  workdir = tempfile.mkdtemp(prefix='fedjax_shift_experiment_')
  try:
    tick = time.perf_counter()
    pipelines.run(config, workdir)
    total = time.perf_counter() - tick
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  return {'seconds': total, 'times': [total], 'compile_s': 0.0}


VIT_B16_PARAMETERS = 86_567_656   # timm vit_base_patch16_224 with its 1,000-class head


def case_digest():
  """Fingerprinting a ViT-B/16-sized backbone.weights .npz: the first run hashes it
  ('compile_s' column: the hash), a re-run reads the cached digest ('seconds')."""
  directory = tempfile.mkdtemp(prefix='fedjax_shift_digest_')
  try:
    path = os.path.join(directory, 'vit_b16.npz')
    np.savez(path, params=np.ones(VIT_B16_PARAMETERS, np.float32))
    cache = os.path.join(directory, 'digests.json')
    tick = time.perf_counter()
    first = fingerprints.content_digest(path, cache)
    hash_seconds = time.perf_counter() - tick
    median, times = timed(lambda: fingerprints.content_digest(path, cache), FLAGS.repeats)
    assert fingerprints.content_digest(path, cache) == first
    size_gb = os.path.getsize(path) / 2 ** 30
  finally:
    shutil.rmtree(directory, ignore_errors=True)
  return {'seconds': median, 'times': times, 'compile_s': hash_seconds, 'file_gb': size_gb}


register('seeds_vmap', lambda name: f'{FLAGS.seeds} seeds of the FedAvg round, vmapped over '
         f'seeds (engine.vmap_seeds), all seeds', lambda name: case_seeds(True))
register('seeds_loop', lambda name: f'{FLAGS.seeds} seeds of the FedAvg round, one call per '
         f'seed, all seeds', lambda name: case_seeds(False))
register('grid_vmap', lambda name: f'{len(FLAGS.grid_rates)} learning rates × {FLAGS.seeds} '
         f'seeds of the FedAvg round, one vmapped program (config.sweep), all runs',
         lambda name: case_grid(True))
register('grid_loop', lambda name: f'{len(FLAGS.grid_rates)} learning rates × {FLAGS.seeds} '
         f'seeds of the FedAvg round, one run after another, all runs',
         lambda name: case_grid(False))
register('processes:', lambda name: f'FedAvg round, cohort 4 over 4 CPU devices: '
         f'{name.split(":")[1]} process(es) of {4 // int(name.split(":")[1])} device(s) '
         f'(launch/train.py, tiny)', lambda name: case_processes(int(name.split(':')[1])))
register('experiment:', lambda name: f"default experiment, whole run (s), TensorBoard event "
         f"files {'on' if name.endswith(':events') else 'off'}",
         lambda name: case_experiment(name.split(':')[1] == 'events'))
register('sweep:', lambda name: f'FedAvg round over a population of {name.split(":")[1]} '
         f'clients of distinct rotated images, {name.split(":")[2]} store',
         lambda name: case_population(int(name.split(':')[1]), name.split(':')[2]))
register('digest', "fingerprint of a ViT-B/16-sized .npz (0.32 GB): a re-run reads its cached "
         "digest (compile s column: the first run's hash)", lambda name: case_digest())
