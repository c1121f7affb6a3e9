"""Benchmark of the compiled round (a script, not a test).

For one model, on the same cohort (C clients × N examples, one local epoch of batch
B, FedAvg with SGD):

  (a) round   the compiled vmapped round (one jit call)
  (b) loop    a Python loop over clients calling a jitted per-client update, then
              the jitted server update (the naive port)
  (c) fused   one jitted centralized step over the pooled C·B-example batches for
              the same number of steps (same FLOPs) — the limit a round can approach
  (d) torch   the per-client PyTorch loop of the papers' code (deepcopy global,
              train, average), when torch is importable (never a dependency); on the
              GPU when torch sees one
  (e) torch_vmap  PyTorch torch.func: the clients' parameters stacked, one vmapped
              gradient per local step (BatchNorm on batch statistics); GPU as (d)
  (f) fedjax  fedjax 0.0.17's FedAvg (a Python loop of its jitted per-client step) on a
              Haiku twin of the MLP, in --fedjax_python's environment (fedjax needs an
              older jax); skipped with the reason when fedjax does not import
  loop_backend  the engine's round with ``engine.backend='loop'`` (sampling, keys,
              stragglers, scatter included), to compare with (a) and (b)
  tta_vmap / tta_loop  an online adapter (--tta_adapter: ATP with α = 0.1, Tent, Surgical
              as the ATP release runs it, whose block selection on 1,000 labelled
              source examples is timed on its own as select_s, FedICON's
              contrastive adaptation with a memory, or FedTHE's ensemble)
              over the same clients as target clients, batches of B: the jitted
              vmapped scan vs a Python loop over clients of a jitted step (opt-in)
  tta_episodic / tta_transductive  the vmapped scan in the episodic mode, and in the
              transductive mode (--tta_epochs passes over each client's shuffled test
              split, then prediction; FedICON only) (opt-in)
  fedevolve   FedEvolve's compiled round on the same cohort (the client data read as
              10 domains of N/10; one local iteration = 9 consecutive-domain steps,
              each a batch of B from both domains through φ and ψ), next to (a) (opt-in)
  fedtta      FedTTA's compiled round on the same cohort: one epoch of steps, each an
              inner step on ‖g(f(X; ψ); φ)‖₂ and the CE of the adapted model
              differentiated through it (second order), next to (a) (opt-in)
  algorithm:<name>[:<field>=<value>…]  the compiled round of any registered method
              (its registered defaults but the named fields of its section, one epoch)
              on the same cohort, next to (a) (opt-in; e.g.
              --cases=round,algorithm:scaffold,algorithm:fedins:head_pool=True)
  seeds_vmap / seeds_loop  --seeds seeds of the FedAvg round on the same cohort: one
              call vmapped over seeds (engine.vmap_seeds) vs one call per seed (opt-in)
  processes:<P>  the default experiment's tiny variant through launch/train.py, FedAvg
              with a cohort of 4 over 4 CPU devices: P = 2 processes of 2 devices on the
              loopback address (JAX's distributed runtime, Gloo collectives) or P = 1
              process of 4; seconds per round (median of rounds 2-10 of metrics.jsonl);
              next to each other (opt-in; --cases=processes:1,processes:2)
  grid_vmap / grid_loop  a hyperparameter sweep: --grid_rates client learning rates ×
              --seeds seeds of the FedAvg round (each seed its own init and keys), as the
              pipeline runs config.sweep (the rate a traced argument, points × seeds one
              vmapped call) vs one run after another (a program per rate, a call per
              run); seconds per round of all runs, compile seconds of all programs
              (opt-in)
  hetero_fedtta / hetero_fedtta_medium  HeteroFedTTA's grouped round (core/groups.py):
              the C clients dealt to small / medium / big MLPs (or all medium, one
              group), 10 Eq. 14 digest steps on a 500-image public set, one epoch of
              FedTTA steps, logits on the public set; MLP models only (opt-in)
  fedtta_e50 / fedtta_pp_scan / fedtta_pp_while  FedTTA's test-time adaptation of C
              new clients (episodic batches of B): 50 inner steps, vs FedTTA++'s entropy
              early stop (patience 1) as a masked scan and as a while_loop (opt-in)
  rates:<K>:<remat|plain>  the learned-rates round (adapters/learned_rates.py) of
              --tta_adapter (atp: α online; tent: per-BN-layer rates) through K online
              test batches of B, one step, with or without jax.checkpoint on each
              test-time step; next to alpha_round (opt-in; e.g. --cases=alpha_round,
              rates:1:plain,rates:5:plain,rates:5:remat,rates:10:plain,rates:10:remat)
  fedavg_1step / alpha_round  the compiled FedAvg round with ONE local step of batch
              B vs ATP's α-training round with one α step of batch B on the same
              cohort (entropy forward/backward for h, then CE forward/backward
              through θ − α⊙h) (opt-in)

then a population sweep (host store, cohort fixed) over K clients.

Client sizes: --sizes picks a profile ('uniform': N each; 'skewed': SKEWED_SIZES, a
floor of 20 plus a Dirichlet(0.5) split, tiled and scaled to C clients of mean N;
'default_experiment': the train split of configs/default.py, seed 0). --profiles
runs every case at each listed profile instead, interleaved case by case, --passes
times, and prints one table: seconds with the machine's load, the ratio to the first
profile, and the round's real / scanned local steps (its own metrics). The round cases
plan the cohort as the pipeline does (groups sorted by size, width fitted under
--max_scanned or --client_chunk, padded sizes fitted to the sizes). Each case runs in
its own subprocess so its peak RSS is its own. Prints a markdown table; --out writes it.

--clients and --conv take lists: every case runs at each cohort size with each
convolution (the PyTorch peers once per size), one table each, then a cohort-sweep
table of (a), (c), (d), (e) and the ratios (a)/(c), (a)/(d), (a)/(e) per row (the
targets on a GPU: (a)/(e) ≤ 1 at every size and (a)/(c) ≤ 2 at 240 clients).

    python launch/benchmark.py --model=atp_cnn --out=/tmp/bench_cnn.md
    python launch/benchmark.py --model=mlp --out=/tmp/bench_mlp.md
    python launch/benchmark.py --model=atp_cnn --clients=60,240,1000 --conv=lax,patches \
        --cases=round,fused,torch,torch_vmap --populations= --out=/tmp/bench_sweep.md
    python launch/benchmark.py --model=mlp --profiles=uniform,skewed --passes=3 --unroll=1 \
        --cases=round,loop_backend,fused,torch,fedjax --torch_threads=1 \
        --fedjax_python=/path/to/fedjax-venv/bin/python --populations=
"""
import ast
import functools
import importlib.metadata
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402


def define_flags() -> None:
  """The command line (defined when run as a script, so that importing this file
  for its functions defines no flags beside another script's)."""
  flags.DEFINE_enum('model', 'atp_cnn', ['atp_cnn', 'mlp', 'bn_mlp', 'evolve_cnn',
                                          'domainbed64', 'vit'],
                    'Model to benchmark (vit: the registered defaults, configs/fedins.py; '
                    "domainbed64: FedEvolve's Table 7 CNN, configs/fedevolve.py:domainbed64).")
  flags.DEFINE_list('clients', ['60'], 'Cohort sizes C: one, or a sweep (60,240,1000) that '
                    'runs every case at each size and prints a table of the ratios.')
  flags.DEFINE_integer('examples', 200, 'Examples per client N (the mean with --sizes).')
  flags.DEFINE_enum('sizes', 'uniform', list(SIZE_PROFILES),
                    "Client sizes: 'uniform' (N each); 'skewed' (a floor of 20 and a "
                    "Dirichlet(0.5) split of the rest, SKEWED_SIZES, tiled and scaled to C "
                    "clients of mean N); 'default_experiment' (the train sizes of "
                    "configs/default.py, seed 0, 20 clients; --clients and --examples "
                    "ignored).")
  flags.DEFINE_list('profiles', [], 'Size profiles to compare (e.g. uniform,skewed): every '
                    'case at each profile, interleaved case by case, --passes times; one '
                    'table of seconds, profile ratios and real-step fractions, with the '
                    "machine's load beside each figure.")
  flags.DEFINE_integer('passes', 1, 'Passes over the cases of --profiles (the median of the '
                       "passes' medians is reported).")
  flags.DEFINE_list('sizes_list', [], 'Internal: the client sizes, passed to case processes '
                    '(a peer environment without fedjax_shift cannot compute them).')
  flags.DEFINE_string('fedjax_python', '', "Interpreter of an environment with fedjax 0.0.17 "
                      "for the 'fedjax' case (its own jax, e.g. 0.5.3; '' = this one).")
  flags.DEFINE_integer('torch_threads', 0, 'torch.set_num_threads for the PyTorch cases (0: '
                       "torch's default; on a shared machine take peer figures at 1).")
  flags.DEFINE_integer('batch_size', 20, 'Local batch size B.')
  flags.DEFINE_integer('repeats', 5, 'Timed repeats after one warm-up (median reported).')
  flags.DEFINE_string('unroll', 'true', "lax.scan unroll of local steps: 'true', 'false' or an int.")
  flags.DEFINE_integer('client_chunk', 0, 'Engine client_chunk for (a) (0: fitted to the '
                       'sizes under --max_scanned, as the pipeline does).')
  flags.DEFINE_float('max_scanned', 1.2, 'engine.max_scanned for (a) with --client_chunk=0 '
                     '(0: one vmap of the whole cohort).')
  flags.DEFINE_integer('rounds_per_call', 5, 'R of the rounds_calls / rounds_scan cases.')
  flags.DEFINE_integer('seeds', 3, 'Seeds S of the seeds_vmap / seeds_loop cases.')
  flags.DEFINE_list('grid_rates', ['0.003', '0.005', '0.01', '0.02', '0.03', '0.05', '0.1',
                                   '0.2'], 'Client learning rates of the grid_* cases.')
  flags.DEFINE_list('conv', ['auto'],
                    "config.model.conv, one or several of auto, lax, patches, lax_patch_grad "
                    "(auto: patches on GPU/TPU, lax_patch_grad on CPU); several run every JAX "
                    "case once per choice (the PyTorch peers once per cohort size).")
  flags.DEFINE_list('cases', ['round', 'loop', 'fused', 'torch', 'torch_vmap', 'loop_backend'],
                    'Cases to run (loop_backend: the engine round with backend=loop; '
                    'tta_vmap / tta_loop: test-time Tent over the clients as target clients).')
  flags.DEFINE_enum('tta_adapter', 'atp', ['atp', 'tent', 'fedicon', 'fedthe', 'surgical'],
                    'Adapter of the tta_* cases (fedicon: its online variant with a memory '
                    'of 8 batches, on a FedICON model; fedthe: 20 ensemble steps).')
  flags.DEFINE_integer('tta_epochs', 5, "Passes over the test split of the 'transductive' "
                       'test-time case (tta_transductive).')
  flags.DEFINE_list('populations', ['240', '1000', '10000'], 'Population sweep (host store).')
  flags.DEFINE_integer('sweep_repeats', 3, 'Timed repeats per population.')
  flags.DEFINE_string('case', '', 'Internal: run one case in this process and print JSON.')
  flags.DEFINE_string('out', '', 'Write the markdown table here.')
  flags.DEFINE_string('trace', '', 'Case (a): trace one more round with jax.profiler into '
                      'this folder and list its device kernels by total time.')


FLAGS = flags.FLAGS

CONV_CHOICES = ('auto', 'lax', 'patches', 'lax_patch_grad')
CONV_MODELS = ('atp_cnn', 'evolve_cnn', 'domainbed64')
TORCH_CASES = ('torch', 'torch_vmap')   # no convolution choice: run once per cohort size


def num_clients() -> int:
  """The cohort size C of a case's process (spawn passes one value of --clients)."""
  if len(FLAGS.clients) != 1:
    raise ValueError(f'--clients: a case runs at one cohort size, got {FLAGS.clients}')
  if FLAGS.sizes_list:
    return len(FLAGS.sizes_list)
  if FLAGS.sizes == 'default_experiment':
    return len(default_experiment_sizes())
  return int(FLAGS.clients[0])


def conv_choice() -> str:
  """The ``config.model.conv`` of a case's process (one value of --conv)."""
  if len(FLAGS.conv) != 1:
    raise ValueError(f'--conv: a case runs with one convolution, got {FLAGS.conv}')
  return FLAGS.conv[0]


def check_flags():
  """Errors naming the flag for a cohort size that is not a positive integer or an
  unknown convolution."""
  for size in FLAGS.clients:
    if not size.isdigit() or int(size) < 1:
      raise app.UsageError(f'--clients: {size!r} is not a positive integer')
  for profile in FLAGS.profiles:
    if profile not in SIZE_PROFILES:
      raise app.UsageError(f'--profiles: unknown {profile!r}; choose from '
                           f'{", ".join(SIZE_PROFILES)}')
  if FLAGS.passes < 1:
    raise app.UsageError(f'--passes must be >= 1, got {FLAGS.passes}')
  for conv in FLAGS.conv:
    if conv not in CONV_CHOICES:
      raise app.UsageError(f'--conv: unknown {conv!r}; choose from {", ".join(CONV_CHOICES)}')
  for conv in FLAGS.conv:
    if conv != 'auto' and FLAGS.model not in CONV_MODELS:
      raise app.UsageError(f'--conv={conv}: --model={FLAGS.model} has no convolutions '
                           f'(leave --conv at auto)')

SHAPES = {'atp_cnn': (32, 32, 3), 'mlp': (28, 28, 1), 'bn_mlp': (28, 28, 1),
          'evolve_cnn': (28, 28, 1), 'domainbed64': (28, 28, 1), 'vit': (28, 28, 3)}


def peak_rss_gb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def unroll_value():
  text = FLAGS.unroll.lower()
  return {'true': True, 'false': False}.get(text, int(text) if text.isdigit() else True)


def make_config():
  from fedjax_shift.config import base_config
  config = base_config()
  config.model.name = FLAGS.model
  config.model.conv = conv_choice()
  if FLAGS.model == 'vit':   # configs/fedins.py's ViT (no convolution choice)
    from configs.fedins import vit_model
    config.model = vit_model()
  if FLAGS.model == 'domainbed64':   # DomainBed's MNIST trunk + Linear 128→64 (Table 7)
    config.model = {'name': 'domainbed_cnn', 'hidden': 64, 'conv': conv_choice()}
  config.client.batch_size = FLAGS.batch_size
  config.client.learning_rate = 0.01
  config.client.local_epochs = 1
  config.engine.unroll = unroll_value()
  return config


SIZE_PROFILES = ('uniform', 'skewed', 'default_experiment')
# 60 clients, 12,000 examples: a floor of 20 per client plus a Dirichlet(0.5) split of the
# other 10,800 (min 20, median 96, max 1,043), in client order.
SKEWED_SIZES = (59, 57, 530, 24, 41, 32, 386, 44, 161, 71, 20, 168, 162, 26, 23, 98, 520, 72,
                282, 94, 140, 41, 23, 44, 71, 246, 49, 159, 125, 28, 54, 44, 29, 607, 92, 1010,
                92, 52, 426, 810, 20, 244, 182, 137, 32, 245, 164, 219, 137, 70, 20, 212, 874,
                87, 297, 20, 1043, 394, 190, 401)


@functools.lru_cache(maxsize=None)
def default_experiment_sizes():
  """[20] the train-split sizes of the default experiment (configs/default.py, seed 0)."""
  import numpy as np
  from configs.default import get_config
  from fedjax_shift.pipelines.runs import build_data
  return np.asarray(build_data(get_config(), 0).splits['train'].num_examples, np.int64)


def client_sizes(num_clients, profile: str = ''):
  """[C] examples per client of the --sizes ``profile`` ('' = --sizes, or --sizes_list
  when given); 'skewed' keeps the total C·N."""
  import numpy as np
  if FLAGS.sizes_list and not profile:
    return np.asarray([int(n) for n in FLAGS.sizes_list], np.int64)
  profile = profile or FLAGS.sizes
  if profile == 'uniform':
    return np.full(num_clients, FLAGS.examples, np.int64)
  if profile == 'default_experiment':
    return default_experiment_sizes()
  profile = np.resize(np.asarray(SKEWED_SIZES, np.float64), num_clients)
  return np.maximum(1, np.round(profile * num_clients * FLAGS.examples / profile.sum())
                    ).astype(np.int64)


def padded_examples() -> int:
  """N of the case's padded [C, N] data: the largest client."""
  return int(client_sizes(num_clients()).max())


def real_steps(sizes) -> int:
  """Local steps of one epoch of batch B over clients of ``sizes``."""
  return int(sum(-(-int(n) // FLAGS.batch_size) for n in sizes))


def cohort_data(num_clients):
  import numpy as np
  from fedjax_shift.data.federated import FederatedData
  rng = np.random.default_rng(0)
  shape = SHAPES[FLAGS.model]
  sizes = client_sizes(num_clients)
  num_clients, padded = len(sizes), int(sizes.max())
  mask = np.arange(padded)[None, :] < sizes[:, None]
  x = rng.random((num_clients, padded) + shape, dtype=np.float32) * mask.reshape(
      mask.shape + (1,) * len(shape))
  y = rng.integers(0, 10, (num_clients, padded)).astype(np.int32) * mask
  return FederatedData(x, y, mask, sizes.astype(np.int32))


def timed(fn, repeats):
  """(median seconds, all seconds) of ``fn()`` after one warm-up call."""
  fn()
  times = []
  for _ in range(repeats):
    tick = time.perf_counter()
    fn()
    times.append(time.perf_counter() - tick)
  return statistics.median(times), times


def setup_algorithm(num_clients_data, kind='fedavg'):
  """kind: 'fedavg' (one epoch), 'fedavg_1step' (one local step), 'fedevolve',
  'fedtta' (one epoch), 'alpha' (ATP's α training around the initial model, one α
  step) or 'algorithm:<name>' (any registered method with its defaults, one epoch,
  every client of the cohort in the population)."""
  import jax
  import jax.numpy as jnp
  from fedjax_shift import models
  from fedjax_shift import algorithms
  from fedjax_shift.algorithms.atp import atp_training
  config = make_config()
  module = models.create(config.model, 10)
  data = cohort_data(num_clients_data)
  if kind == 'fedavg_1step':
    config.client.local_steps = 1
  info = {'num_domains': 10} if kind == 'fedevolve' else {}  # 10 source domains of N/10
  name = kind if kind in ('fedevolve', 'fedtta') else 'fedavg'
  if kind.startswith('algorithm:'):
    name, *fields = kind.split(':')[1:]
    for field in fields:   # '<field>=<value>' of the method's section
      key, value = field.split('=', 1)
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
    algorithm = atp_training(config.atp, module, padded_examples(), server.variables,
                             config.engine.unroll)
    server = algorithm.init(jax.random.key(0), jnp.asarray(data.x[0, :1]))
  return config, module, algorithm, data, server


def rates_algorithm(config, module, variables, kind: str):
  """The learned-rates round (adapters/learned_rates.py) of --tta_adapter (ATP's α
  online: the pipeline's row atp_online_k, or Tent's per-layer rates online:
  tent_learned) through K test batches of B, one local SGD step, ``remat`` on or off."""
  from fedjax_shift.core.test_time import SourceContext
  from fedjax_shift.pipelines.atp import build_rates_training, learned_row
  _, k, remat = kind.split(':')
  key = 'tent_learned' if FLAGS.tta_adapter == 'tent' else 'atp_online_k'
  config.learned.num_batches[key] = int(k)
  config.learned.remat = remat == 'remat'
  config.learned.local_steps = 1
  config.learned.optimizer = 'sgd'
  hparams = config.adapters[learned_row(config, key)[0]]
  context = SourceContext(variables, 10, FLAGS.batch_size)
  return build_rates_training(config, key, module, hparams, context, FLAGS.examples)[0]


def round_config(config, data, backend: str = 'vmap'):
  """The engine's RoundConfig of the cohort as the pipeline builds it
  (``pipelines.programs.round_config``): every client in the round, sorted by
  examples, groups of --client_chunk or fitted under --max_scanned, each cut to its
  fitted padded size."""
  from fedjax_shift.pipelines.programs import round_config as pipeline_round_config
  config.cohort_size = num_clients()
  config.engine.client_chunk = FLAGS.client_chunk
  config.engine.max_scanned = FLAGS.max_scanned
  config.engine.backend = backend
  return pipeline_round_config(config, data)


def case_round(backend='vmap', kind='fedavg'):
  import jax
  import jax.numpy as jnp
  from fedjax_shift.core.round import build_round, stack_client_states
  config, _, algorithm, data, server = setup_algorithm(num_clients(), kind)
  clients = stack_client_states(algorithm, server, num_clients())
  round_cfg = round_config(config, data, backend)
  _, round_host = build_round(algorithm, round_cfg, backend=backend)
  device_data = jax.device_put(data)
  ids = jnp.arange(num_clients(), dtype=jnp.int32)
  key = jax.random.key(0)
  tick = time.perf_counter()
  if backend == 'vmap':
    compiled = round_host.lower(server, clients, device_data, ids, key).compile()
  else:  # the loop backend compiles on its first call (which also runs the round)
    compiled = round_host
    jax.block_until_ready(compiled(server, clients, device_data, ids, key))
  compile_s = time.perf_counter() - tick
  run = lambda: jax.block_until_ready(compiled(server, clients, device_data, ids, key))
  median, times = timed(run, FLAGS.repeats)
  from fedjax_shift.pipelines.runs import uploaded_parameters
  result = {'seconds': median, 'times': times, 'compile_s': compile_s,
            'uploaded_parameters': uploaded_parameters(algorithm, server, clients, data),
            'client_chunk': round_cfg.client_chunk}
  metrics = run().metrics
  if 'scanned_steps' in metrics:
    result['local_steps'] = int(metrics['local_steps'])
    result['scanned_steps'] = int(metrics['scanned_steps'])
  if FLAGS.trace and backend == 'vmap':
    result['kernels'] = traced_kernels(run, os.path.join(
        FLAGS.trace, f'{FLAGS.model}_{num_clients()}_{conv_choice()}'))
  return result


def traced_kernels(run, logdir: str, top: int = 12) -> dict:
  """One call of ``run`` under ``jax.profiler.trace`` into ``logdir``: kernel_summary of
  its Perfetto trace, and the trace's path."""
  import glob
  import gzip
  import jax
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
  import collections
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


def case_seeds(vmapped: bool):
  """FLAGS.seeds seeds of the FedAvg round on the same cohort (each its own init and
  keys): one call of the round vmapped over seeds (engine.vmap_seeds), or one call per
  seed. Seconds per round of all seeds."""
  import jax
  import jax.numpy as jnp
  from fedjax_shift.core.round import RoundConfig, build_round, round_key, stack_client_states
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


def first_then_timed(run) -> dict:
  """{'seconds': the median of FLAGS.repeats calls of ``run`` after a first one,
  'times', 'compile_s': that first call (compilation plus one call)}."""
  tick = time.perf_counter()
  run()
  compile_s = time.perf_counter() - tick
  median, times = timed(run, FLAGS.repeats)
  return {'seconds': median, 'times': times, 'compile_s': compile_s}


def case_grid(vmapped: bool):
  """len(FLAGS.grid_rates) client learning rates × FLAGS.seeds seeds of the FedAvg
  round on the same cohort: the sweep's one program (core.runs.grid_round over the
  traced rate) or one run after another. Seconds per round of all runs; 'compile_s':
  the first round of all runs (every compilation)."""
  import jax
  import jax.numpy as jnp
  from fedjax_shift import algorithms
  from fedjax_shift.core.round import RoundConfig, build_round, round_key, stack_client_states
  from fedjax_shift.pipelines import sweep
  from fedjax_shift.core.runs import grid_round, stack_runs
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
  import shutil
  import socket
  import statistics as stats
  import tempfile
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


def case_hetero(sizes):
  """HeteroFedTTA's grouped round (core/groups.py): the C clients dealt in turn to the
  architectures ``sizes``, every client in the round, a public set of 500 random
  images in batches of 50; the algorithm's defaults (10 digest steps) and one epoch of
  FedTTA meta-training steps."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from fedjax_shift.algorithms import hetero_fedtta
  from fedjax_shift.core.groups import build_grouped_round, init_group_states, split_groups
  from fedjax_shift.core.local import LocalSchedule
  import optax
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


def case_rounds(scan: bool):
  """--rounds_per_call R consecutive rounds (state chained, cohort = every client):
  R calls of the compiled round, reading the loss back after each as the trainer does,
  or one call scanning R rounds (config.engine.rounds_per_call). Seconds per round."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from fedjax_shift.core.round import RoundConfig, build_round, round_key, stack_client_states
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
  import jax
  import jax.numpy as jnp
  from fedjax_shift.core.algorithm import ClientData
  from fedjax_shift.core.round import NO_STEP_LIMIT, aggregation_weights
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
  import jax
  import jax.numpy as jnp
  import optax
  from fedjax_shift.algorithms import base
  config, module, _, data, server = setup_algorithm(num_clients())
  import numpy as np
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


def torch_twin(batch_statistics_only: bool = False):
  """(model, x [K, N, ...], y [K, N]) of the PyTorch twin of --model, or a str saying
  why there is none. ``batch_statistics_only``: BatchNorm without running statistics
  (what a functional, vmapped call can use)."""
  try:
    import torch
  except ImportError:
    return 'torch is not installed'
  if FLAGS.torch_threads:
    torch.set_num_threads(FLAGS.torch_threads)
  if FLAGS.model not in ('atp_cnn', 'mlp'):
    return f'no PyTorch twin of {FLAGS.model}'
  from torch import nn
  data = cohort_data(num_clients())
  track = not batch_statistics_only
  if FLAGS.model == 'atp_cnn':
    def block(cin, cout, pool):
      layers = [nn.Conv2d(cin, cout, 3, bias=False),
                nn.BatchNorm2d(cout, track_running_stats=track), nn.ReLU()]
      return layers + ([nn.MaxPool2d(2)] if pool else [])
    model = nn.Sequential(*block(3, 32, True), *block(32, 64, True), *block(64, 64, False),
                          nn.Flatten(), nn.Linear(64 * 4 * 4, 64),
                          nn.BatchNorm1d(64, track_running_stats=track),
                          nn.ReLU(), nn.Linear(64, 10))
    x = torch.from_numpy(data.x).permute(0, 1, 4, 2, 3).contiguous()
  else:
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 200), nn.ReLU(), nn.Linear(200, 200),
                          nn.ReLU(), nn.Linear(200, 10))
    x = torch.from_numpy(data.x)
  return model, x, torch.from_numpy(data.y).long()


def case_torch():
  """(d) the papers' loop: per client, a deep copy of the global model, local SGD, then
  the mean of the state dicts; on the GPU when torch sees one."""
  twin = torch_twin()
  if isinstance(twin, str):
    return {'skipped': twin}
  import copy
  import torch
  model, x, y = twin
  sizes = client_sizes(num_clients())
  device = 'cuda' if torch.cuda.is_available() else 'cpu'
  model, x, y = model.to(device), x.to(device), y.to(device)
  loss_fn = torch.nn.CrossEntropyLoss()

  def run():
    states = []
    for k in range(num_clients()):
      local = copy.deepcopy(model)
      local.train()
      opt = torch.optim.SGD(local.parameters(), lr=0.01)
      perm = torch.randperm(int(sizes[k]), device=device)   # the client's own examples
      for start in range(0, int(sizes[k]), FLAGS.batch_size):
        idx = perm[start:start + FLAGS.batch_size]
        opt.zero_grad()
        loss_fn(local(x[k][idx]), y[k][idx]).backward()
        opt.step()
      states.append(local.state_dict())
    with torch.no_grad():
      averaged = {name: sum(s[name].float() for s in states) / len(states)
                  for name in states[0]}
      model.load_state_dict({n: v.to(states[0][n].dtype) for n, v in averaged.items()})
    if device == 'cuda':
      torch.cuda.synchronize()

  median, times = timed(run, FLAGS.repeats)
  return {'seconds': median, 'times': times, 'compile_s': 0.0, 'device': device,
          'torch': torch.__version__, 'threads': torch.get_num_threads()}


def case_fedjax():
  """(f) fedjax 0.0.17's FedAvg (``fedjax.algorithms.fed_avg``: a Python loop over
  clients of its jitted per-client step, ``for_each_client``) on the same clients, a
  Haiku twin of the MLP; run in --fedjax_python's environment (fedjax needs an older
  jax), or skipped with the reason when fedjax does not import. Imports nothing of
  fedjax_shift."""
  try:
    import jax
    if not hasattr(jax, 'tree_map'):   # fedjax 0.0.17 calls jax.tree_map
      jax.tree_map = jax.tree_util.tree_map
    import fedjax
    import haiku as hk
  except Exception as err:   # noqa: BLE001  (any import failure means: no peer here)
    return {'skipped': f'fedjax does not import here ({type(err).__name__}: {err}); '
                       f'give --fedjax_python of an environment with fedjax 0.0.17'}
  if FLAGS.model != 'mlp':
    return {'skipped': f'no fedjax twin of {FLAGS.model}'}
  import numpy as np
  sizes = client_sizes(num_clients())
  rng = np.random.default_rng(0)
  clients_data = {f'{k}'.encode(): {
      'x': rng.random((int(n),) + SHAPES[FLAGS.model], dtype=np.float32),
      'y': rng.integers(0, 10, int(n)).astype(np.int32)} for k, n in enumerate(sizes)}

  def forward(batch):
    x = batch['x'].reshape((batch['x'].shape[0], -1))
    return hk.Sequential([hk.Linear(200), jax.nn.relu, hk.Linear(200), jax.nn.relu,
                          hk.Linear(10)])(x)

  transformed = hk.transform(forward)
  sample = {'x': np.zeros((1,) + SHAPES[FLAGS.model], np.float32), 'y': np.zeros(1, np.int32)}
  model = fedjax.create_model_from_haiku(
      transformed_forward_pass=transformed, sample_batch=sample,
      train_loss=lambda batch, preds: fedjax.metrics.unreduced_cross_entropy_loss(
          batch['y'], preds))
  grad_fn = fedjax.model_grad(model)
  algorithm = fedjax.algorithms.fed_avg.federated_averaging(
      grad_fn, fedjax.optimizers.sgd(0.01), fedjax.optimizers.sgd(1.0),
      fedjax.ShuffleRepeatBatchHParams(batch_size=FLAGS.batch_size, num_epochs=1,
                                       drop_remainder=False))
  state = algorithm.init(model.init(jax.random.PRNGKey(0)))
  clients = [(cid, fedjax.ClientDataset(data), jax.random.PRNGKey(k))
             for k, (cid, data) in enumerate(clients_data.items())]

  def run():
    new_state, _ = algorithm.apply(state, clients)
    return jax.block_until_ready(new_state.params)

  tick = time.perf_counter()
  run()
  compile_s = time.perf_counter() - tick
  median, times = timed(run, FLAGS.repeats)
  return {'seconds': median, 'times': times, 'compile_s': compile_s,
          'fedjax': importlib.metadata.version('fedjax'), 'jax': jax.__version__}


def case_torch_vmap():
  """(e) PyTorch ``torch.func``: the clients' parameters stacked, one ``vmap``ped
  gradient per local step over every client's batch (BatchNorm on batch statistics),
  SGD, then the mean — the vmapped peer of (a), on the GPU when torch sees one."""
  if len(set(client_sizes(num_clients()).tolist())) > 1:
    return {'skipped': 'stacked clients of equal size only (--sizes=uniform)'}
  twin = torch_twin(batch_statistics_only=True)
  if isinstance(twin, str):
    return {'skipped': twin}
  import torch
  from torch.func import functional_call, grad, vmap
  model, x, y = twin
  device = 'cuda' if torch.cuda.is_available() else 'cpu'
  model, x, y = model.to(device), x.to(device), y.to(device)
  global_params = {k: v.detach() for k, v in model.named_parameters()}
  loss_fn = torch.nn.CrossEntropyLoss()

  def loss(params, xb, yb):
    return loss_fn(functional_call(model, params, (xb,)), yb)

  client_grads = vmap(grad(loss))
  clients = torch.arange(num_clients(), device=device)[:, None]

  def run():
    params = {k: v.expand(num_clients(), *v.shape).clone() for k, v in global_params.items()}
    perms = torch.argsort(torch.rand(num_clients(), FLAGS.examples, device=device), dim=1)
    for start in range(0, FLAGS.examples, FLAGS.batch_size):
      idx = perms[:, start:start + FLAGS.batch_size]
      grads = client_grads(params, x[clients, idx], y[clients, idx])
      params = {k: params[k] - 0.01 * grads[k] for k in params}
    averaged = {k: v.mean(0) for k, v in params.items()}
    if device == 'cuda':
      torch.cuda.synchronize()
    return averaged

  median, times = timed(run, FLAGS.repeats)
  return {'seconds': median, 'times': times, 'compile_s': 0.0, 'device': device,
          'torch': torch.__version__, 'threads': torch.get_num_threads()}


def case_tta(vmapped: bool, mode: str = 'online'):
  """An adapter (--tta_adapter) on C target clients × N test examples, batches of B: the
  jitted vmapped scan of core/test_time.py in ``mode`` ('online', 'episodic', or
  'transductive': --tta_epochs passes, then prediction), or a Python loop over clients
  and batches of a jitted ``adapter.step`` (online)."""
  import jax
  import jax.numpy as jnp
  from fedjax_shift import models
  from fedjax_shift.adapters import atp as atp_lib
  from fedjax_shift.adapters.tent import tent
  from fedjax_shift.core.test_time import AdaptBatch, build_test_time
  from fedjax_shift.parts import atp_rates
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
    from fedjax_shift.adapters.surgical import selection_scores, source_selected
    from fedjax_shift.core.test_time import SourceContext
    shape = data.x.shape[2:]
    context = SourceContext(variables, 10, FLAGS.batch_size,
                            jnp.asarray(data.x.reshape((-1,) + shape)[:1000]),
                            jnp.asarray(data.y.reshape(-1)[:1000]), None, shape)
    tick = time.perf_counter()
    jax.block_until_ready(selection_scores(module, context, 0.1, (), 1000)[0])
    select_s = time.perf_counter() - tick   # compile included: it runs once per build
    adapter = source_selected(module, context, 0.1, 'after', (), 1000)
  elif FLAGS.tta_adapter == 'fedicon':   # a FedICON model: encoder, projection, head
    from fedjax_shift.adapters.fedicon import fedicon_tta
    _, _, _, _, server = setup_algorithm(num_clients(), 'algorithm:fedicon')
    variables = server.variables
    adapter = fedicon_tta(module, memory_size=8 * FLAGS.batch_size,
                          batch_size=FLAGS.batch_size, epochs=FLAGS.tta_epochs)
  else:                                  # a FedTHE model: two heads and the features
    from fedjax_shift.adapters.fedthe import fedthe_adapter
    from fedjax_shift.algorithms.fedthe import PersonalState, personal_model
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


def case_fedtta_test_time(loop: str, patience: int):
  """FedTTA++ on C new clients × N examples, episodic batches of B, E = 50 inner steps
  with entropy patience ``patience`` (0: all 50), as a masked ``lax.scan`` or a
  ``lax.while_loop``; the jitted vmapped scan of core/test_time.py over clients, on an
  untrained FedTTA model (the steps each client runs are reported)."""
  import jax
  import numpy as np
  from fedjax_shift.adapters.fedtta import adapt, fedtta_adapter
  from fedjax_shift.core.test_time import build_test_time
  config, module, algorithm, data, server = setup_algorithm(num_clients(), 'fedtta')
  variables = algorithm.global_model(server)
  adapter = fedtta_adapter(module, 0.5, 50, patience, 0.1, loop)
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
                                           0.5, 50, patience, 0.1, loop)[1]))(first_batches)
  return {'seconds': median, 'times': times, 'compile_s': compile_s,
          'mean_steps_first_batch': float(np.mean(steps)), 'max_steps_first_batch':
          int(np.max(steps))}


def case_sweep(population):
  import jax
  import numpy as np
  from fedjax_shift.core.round import (HostStore, RoundConfig, build_round, round_key,
                                       stack_client_states)
  from fedjax_shift.data.federated import FederatedData
  _, _, algorithm, base_data, server = setup_algorithm(num_clients())
  # The population's examples are a broadcast view of one cohort's worth of data:
  # host memory for K clients is not allocated, only each sampled cohort is gathered.
  view = lambda a: np.broadcast_to(a[:1], (population,) + a.shape[1:])
  data = FederatedData(view(base_data.x), view(base_data.y), view(base_data.mask),
                       np.full(population, FLAGS.examples, np.int32))
  round_config = RoundConfig(cohort_size=num_clients())
  _, round_host = build_round(algorithm, round_config)
  clients = stack_client_states(algorithm, server, population)
  seed_key = jax.random.key(0)
  store = HostStore(data, seed_key, round_config)
  state = {'round': 0}

  def run():
    r = state['round']
    cohort, ids = store.cohort(r)
    out = round_host(server, clients, cohort, ids, round_key(seed_key, r))
    state['round'] += 1
    return jax.block_until_ready(out.server_state)

  tick = time.perf_counter()
  run()
  compile_s = time.perf_counter() - tick
  median, times = timed(run, FLAGS.sweep_repeats)
  store.close()
  return {'seconds': median, 'times': times, 'compile_s': compile_s}


def case_experiment(tensorboard: bool):
  """The README's default experiment (configs/default.py) end to end in a fresh workdir,
  with or without the TensorBoard event files; 'seconds' is the whole run."""
  import shutil
  import tempfile
  from configs import default
  from fedjax_shift import pipelines
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
  import shutil
  import tempfile
  import numpy as np
  from fedjax_shift.pipelines import workdir as workdir_lib
  directory = tempfile.mkdtemp(prefix='fedjax_shift_digest_')
  try:
    path = os.path.join(directory, 'vit_b16.npz')
    np.savez(path, params=np.ones(VIT_B16_PARAMETERS, np.float32))
    cache = os.path.join(directory, 'digests.json')
    tick = time.perf_counter()
    first = workdir_lib.content_digest(path, cache)
    hash_seconds = time.perf_counter() - tick
    median, times = timed(lambda: workdir_lib.content_digest(path, cache), FLAGS.repeats)
    assert workdir_lib.content_digest(path, cache) == first
    size_gb = os.path.getsize(path) / 2 ** 30
  finally:
    shutil.rmtree(directory, ignore_errors=True)
  return {'seconds': median, 'times': times, 'compile_s': hash_seconds, 'file_gb': size_gb}


def run_case(name):
  if name.startswith('sweep:'):
    result = case_sweep(int(name.split(':')[1]))
  elif name.startswith('processes:'):
    result = case_processes(int(name.split(':')[1]))
  elif name.startswith('experiment:'):
    result = case_experiment(name.split(':')[1] == 'events')
  elif name.startswith(('algorithm:', 'rates:')):
    result = case_round(kind=name)
  else:
    result = {'round': case_round, 'loop': case_loop, 'fused': case_fused,
              'torch': case_torch, 'torch_vmap': case_torch_vmap, 'fedjax': case_fedjax,
              'rounds_calls': lambda: case_rounds(scan=False),
              'rounds_scan': lambda: case_rounds(scan=True),
              'loop_backend': lambda: case_round('loop'),
              'tta_vmap': lambda: case_tta(True), 'tta_loop': lambda: case_tta(False),
              'tta_episodic': lambda: case_tta(True, 'episodic'),
              'tta_transductive': lambda: case_tta(True, 'transductive'),
              'fedavg_1step': lambda: case_round(kind='fedavg_1step'),
              'fedevolve': lambda: case_round(kind='fedevolve'),
              'fedtta': lambda: case_round(kind='fedtta'),
              'hetero_fedtta': lambda: case_hetero(('small', 'medium', 'big')),
              'seeds_vmap': lambda: case_seeds(True),
              'seeds_loop': lambda: case_seeds(False),
              'grid_vmap': lambda: case_grid(True),
              'grid_loop': lambda: case_grid(False),
              'hetero_fedtta_medium': lambda: case_hetero(('medium',)),
              'alpha_round': lambda: case_round(kind='alpha'),
              'fedtta_e50': lambda: case_fedtta_test_time('scan', 0),
              'fedtta_pp_scan': lambda: case_fedtta_test_time('scan', 1),
              'fedtta_pp_while': lambda: case_fedtta_test_time('while', 1),
              'digest': case_digest}[name]()
  result['peak_rss_gb'] = peak_rss_gb()
  return result


def spawn(name, clients: int, conv: str, sizes: str = ''):
  """Runs case ``name`` at cohort size ``clients`` with ``config.model.conv=conv`` and
  client sizes ``sizes`` (a --sizes profile; '' = --sizes) in a subprocess (its own
  peak RSS; the 'fedjax' case in --fedjax_python's interpreter); returns its result
  dict (with the machine's 1-minute load average at its start) or {'error': last
  stderr line}."""
  sizes = sizes or FLAGS.sizes
  python = FLAGS.fedjax_python if name == 'fedjax' and FLAGS.fedjax_python else sys.executable
  listed = ','.join(str(n) for n in client_sizes(clients, sizes))
  argv = [python, os.path.abspath(__file__), f'--case={name}', f'--clients={clients}',
          f'--conv={conv}', f'--sizes={sizes}', f'--sizes_list={listed}']
  argv += [f'--{f}={FLAGS[f].serialize().split("=", 1)[1]}' for f in
           ('model', 'examples', 'batch_size', 'repeats', 'unroll', 'client_chunk',
            'sweep_repeats', 'tta_adapter', 'tta_epochs', 'rounds_per_call', 'seeds', 'trace',
            'grid_rates', 'max_scanned', 'torch_threads')]
  load = os.getloadavg()[0]
  proc = subprocess.run(argv, capture_output=True, text=True)
  if proc.returncode:
    return {'error': proc.stderr.strip().splitlines()[-1] if proc.stderr else 'failed',
            'load': load}
  return {**json.loads(proc.stdout.strip().splitlines()[-1]), 'load': load}


def profile_comparison(clients: int, conv: str) -> str:
  """The --profiles table: each case of --cases at every profile, run interleaved (case
  by case, profile by profile) --passes times."""
  profiles, cases = FLAGS.profiles, FLAGS.cases
  runs = {(profile, name): [] for profile in profiles for name in cases}
  for _ in range(FLAGS.passes):
    for name in cases:
      for profile in profiles:
        result = spawn(name, clients, conv, profile)
        print(profile, name, json.dumps(result), flush=True)
        runs[(profile, name)].append(result)

  def cell(profile, name):
    done = [r for r in runs[(profile, name)] if 'seconds' in r]
    if not done:
      first = runs[(profile, name)][0]
      return None, first.get('skipped') or first.get('error'), ''
    seconds = statistics.median(r['seconds'] for r in done)
    load = max(r['load'] for r in done)
    steps = ''
    if 'scanned_steps' in done[0]:
      steps = (f"{done[0]['local_steps']}/{done[0]['scanned_steps']} "
               f"({done[0]['local_steps'] / done[0]['scanned_steps']:.0%})")
    return seconds, f'{seconds:.4g} (load {load:.1f})', steps

  sizes = {p: client_sizes(clients, p) for p in profiles}
  lines = [f'### Size profiles: {FLAGS.model}, one epoch of batch {FLAGS.batch_size}, '
           f'unroll={FLAGS.unroll}, max_scanned={FLAGS.max_scanned}, '
           f'client_chunk={FLAGS.client_chunk} (0: fitted)\n',
           f'Machine: {machine()}. s/round: median of {FLAGS.passes} interleaved passes, each '
           f'the median of {FLAGS.repeats} after one warm-up; load: the 1-minute load '
           f'average at the start of the case (the highest of the passes).\n']
  for p in profiles:
    n = sizes[p]
    lines.append(f'- {p}: {len(n)} clients, {int(n.sum()):,} examples (min {n.min()}, median '
                 f'{int(statistics.median(n.tolist()))}, max {n.max()}), '
                 f'{real_steps(n)} real local steps')
  columns = ([f'{p} s/round' for p in profiles] + [f'{p} / {profiles[0]}' for p in profiles[1:]]
             + [f'{p} real/scanned steps' for p in profiles])
  lines += ['', '| case | ' + ' | '.join(columns) + ' |', '|---' * (1 + len(columns)) + '|']
  seconds = {}
  for name in cases:
    cells = [cell(p, name) for p in profiles]
    for p, (value, _, _) in zip(profiles, cells):
      seconds[(p, name)] = value
    ratios = [f'{c[0] / cells[0][0]:.2f}×' if c[0] and cells[0][0] else '—' for c in cells[1:]]
    row = [c[1] for c in cells] + ratios + [c[2] or '—' for c in cells]
    lines.append(f'| {label(name)} | ' + ' | '.join(row) + ' |')
  for ours in ('round', 'loop_backend'):
    for peer in ('torch', 'fedjax'):
      pairs = [f'{p} {seconds[(p, ours)] / seconds[(p, peer)]:.2f}' for p in profiles
               if seconds.get((p, ours)) and seconds.get((p, peer))]
      if pairs:
        lines.append(f'\n{label(ours)} / {label(peer)}: ' + ', '.join(pairs))
  return '\n'.join(lines)


def machine() -> str:
  import jax
  device = jax.devices()[0]
  return (f'{platform.processor() or platform.machine()}, {os.cpu_count()} cores, '
          f'{jax.default_backend()} ({device.device_kind}), jax {jax.__version__}')


def label(name: str) -> str:
  """The table row name of case ``name``."""
  labels = {'round': '(a) compiled vmapped round', 'loop': '(b) Python loop of jitted clients',
            'fused': '(c) fused centralized step (same FLOPs)',
            'torch': '(d) PyTorch per-client loop',
            'torch_vmap': '(e) PyTorch torch.func vmap over stacked clients',
            'fedjax': '(f) fedjax 0.0.17 FedAvg (for_each_client)',
            'rounds_calls': f'{FLAGS.rounds_per_call} rounds as {FLAGS.rounds_per_call} calls '
                            f'(loss read each round), per round',
            'rounds_scan': f'{FLAGS.rounds_per_call} rounds as one scan '
                           f'(rounds_per_call={FLAGS.rounds_per_call}), per round',
            'loop_backend': "engine backend='loop' round",
            'tta_vmap': f'{FLAGS.tta_adapter} online: vmapped lax.scan over clients',
            'tta_loop': f'{FLAGS.tta_adapter} online: Python loop of jitted steps',
            'tta_episodic': f'{FLAGS.tta_adapter} episodic: vmapped lax.scan over clients',
            'tta_transductive': f'{FLAGS.tta_adapter} transductive, {FLAGS.tta_epochs} '
                                f'passes then prediction: vmapped lax.scan over clients',
            'fedavg_1step': 'FedAvg round, 1 local step',
            'fedevolve': 'FedEvolve round, 1 local iteration (9 domain pairs)',
            'fedtta': 'FedTTA round, 1 epoch (inner + outer step each)',
            'hetero_fedtta': 'HeteroFedTTA grouped round, 3 architectures (digest + 1 epoch '
                             '+ public logits)',
            'hetero_fedtta_medium': 'HeteroFedTTA round, all clients medium (one group)',
            'seeds_vmap': f'{FLAGS.seeds} seeds of the FedAvg round, vmapped over seeds '
                          f'(engine.vmap_seeds), all seeds',
            'seeds_loop': f'{FLAGS.seeds} seeds of the FedAvg round, one call per seed, '
                          f'all seeds',
            'grid_vmap': f'{len(FLAGS.grid_rates)} learning rates × {FLAGS.seeds} seeds of the '
                         f'FedAvg round, one vmapped program (config.sweep), all runs',
            'grid_loop': f'{len(FLAGS.grid_rates)} learning rates × {FLAGS.seeds} seeds of the '
                         f'FedAvg round, one run after another, all runs',
            'alpha_round': 'ATP α round, 1 α step',
            'fedtta_e50': 'FedTTA test time, fixed E = 50 steps (scan)',
            'fedtta_pp_scan': 'FedTTA++ test time, E ≤ 50, patience 1, masked scan',
            'fedtta_pp_while': 'FedTTA++ test time, E ≤ 50, patience 1, while_loop',
            'digest': 'fingerprint of a ViT-B/16-sized .npz (0.32 GB): a re-run reads its '
                      'cached digest (compile s column: the first run\'s hash)'}
  if name in labels:
    return labels[name]
  if name.startswith('processes:'):
    count = int(name.split(':')[1])
    return (f'FedAvg round, cohort 4 over 4 CPU devices: {count} process(es) of '
            f'{4 // count} device(s) (launch/train.py, tiny)')
  if name.startswith('experiment:'):
    return (f"default experiment, whole run (s), TensorBoard event files "
            f"{'on' if name.endswith(':events') else 'off'}")
  if name.startswith('rates:'):
    _, k, remat = name.split(':')
    return (f"learned-rates round ({FLAGS.tta_adapter if FLAGS.tta_adapter == 'tent' else 'atp'}"
            f"-online), K = {k}, remat {'on' if remat == 'remat' else 'off'}, 1 step")
  method, *fields = name.split(':')[1:]
  settings = ', '.join(fields) if fields else 'registered defaults'
  return f'{method} round, 1 epoch ({settings})'


def seconds(results: dict, name: str):
  """Seconds of case ``name``, or None where it did not run (skipped, error, absent)."""
  return results.get(name, {}).get('seconds')


def case_table(results: dict) -> str:
  """The markdown table of one cohort size and convolution, with its ratio lines."""
  base = seconds(results, 'fused')
  lines = ['| case | s/round | compile s | peak RSS GB | vs (c) fused | parameters sent per '
           'client |', '|---|---|---|---|---|---|']
  for name, result in results.items():
    if 'seconds' not in result:
      lines.append(f"| {label(name)} | {result.get('skipped') or result.get('error')} | | | | |")
      continue
    ratio = f"{result['seconds'] / base:.2f}×" if base else ''
    sent = f"{result['uploaded_parameters']:,}" if 'uploaded_parameters' in result else ''
    lines.append(f"| {label(name)} | {result['seconds']:.4g} | {result['compile_s']:.1f} | "
                 f"{result['peak_rss_gb']:.2f} | {ratio} | {sent} |")
  kernels = results.get('round', {}).get('kernels')
  if kernels:
    lines += [f"\nDevice kernels of one traced round of (a) ({kernels['kernel_seconds']:.4g} s "
              f"summed; trace {kernels['trace']}):\n", '| kernel | s | calls | share |',
              '|---|---|---|---|']
    lines += [f'| {name[:100]} | {seconds:.4g} | {count} | '
              f"{seconds / max(kernels['kernel_seconds'], 1e-12):.1%} |"
              for name, seconds, count in kernels['top']]
  pairs = [('round', 'loop', '(a)/(b)'), ('round', 'torch', '(a)/(d)'),
           ('round', 'torch_vmap', '(a)/(e)'), ('tta_vmap', 'tta_loop', 'tta vmapped / tta loop'),
           ('seeds_vmap', 'seeds_loop', 'seeds vmapped / seeds one by one'),
           ('grid_vmap', 'grid_loop', 'sweep as one program / runs one by one'),
           ('grid_vmap', 'round', 'sweep as one program / one run'),
           ('alpha_round', 'fedavg_1step', 'α round / FedAvg 1-step round'),
           ('processes:2', 'processes:1', '2 processes × 2 devices / 1 process × 4'),
           ('experiment:events', 'experiment:no_events',
            'default experiment with / without event files')]
  for top, bottom, text in pairs:
    if seconds(results, top) and seconds(results, bottom):
      lines.append(f'\n{text} = {seconds(results, top) / seconds(results, bottom):.2f}')
  return '\n'.join(lines)


def cohort_sweep_table(runs) -> str:
  """One row per (cohort size, convolution) of ``runs`` [(clients, conv, results)]: the
  seconds of (a), (c), (d), (e) and the ratios the GPU targets are stated in."""
  steps = -(-FLAGS.examples // FLAGS.batch_size)
  fmt = lambda value: '—' if value is None else f'{value:.4g}'
  ratio = lambda top, bottom: '—' if not (top and bottom) else f'{top / bottom:.2f}'
  lines = [f'### Cohort sweep: {FLAGS.model}, {FLAGS.examples} examples per client, {steps} '
           f'local steps of batch {FLAGS.batch_size} (s/round, median of {FLAGS.repeats})\n',
           '| clients | conv | (a) round | (a) compile s | (c) fused | (d) torch loop | '
           '(e) torch.func vmap | (a)/(c) | (a)/(d) | (a)/(e) |',
           '|---|---|---|---|---|---|---|---|---|---|']
  for clients, conv, results in runs:
    a = seconds(results, 'round')
    compile_s = results.get('round', {}).get('compile_s')
    lines.append(
        f"| {clients} | {conv} | {fmt(a)} | {'—' if compile_s is None else f'{compile_s:.1f}'} | "
        f"{fmt(seconds(results, 'fused'))} | {fmt(seconds(results, 'torch'))} | "
        f"{fmt(seconds(results, 'torch_vmap'))} | {ratio(a, seconds(results, 'fused'))} | "
        f"{ratio(a, seconds(results, 'torch'))} | {ratio(a, seconds(results, 'torch_vmap'))} |")
  return '\n'.join(lines)


def population_sweep(clients: int, conv: str) -> str:
  """The host-store population sweep at cohort size ``clients`` (markdown)."""
  lines = [f'\nPopulation sweep (host store, cohort {clients}, median of '
           f'{FLAGS.sweep_repeats}):\n', '| population | s/round | first round s | '
           'peak RSS GB | vs smallest |', '|---|---|---|---|---|']
  first = None
  for population in FLAGS.populations:
    result = spawn(f'sweep:{population}', clients, conv)
    print('sweep', population, json.dumps(result), flush=True)
    if 'seconds' not in result:
      lines.append(f"| {population} | {result.get('error')} | | | |")
      continue
    first = first or result['seconds']
    lines.append(f"| {population} | {result['seconds']:.4g} | {result['compile_s']:.1f} | "
                 f"{result['peak_rss_gb']:.2f} | {result['seconds'] / first:.2f}× |")
  return '\n'.join(lines)


def main(argv):
  del argv
  if FLAGS.case:
    print(json.dumps(run_case(FLAGS.case)))
    return
  check_flags()
  if FLAGS.profiles:
    text = profile_comparison(int(FLAGS.clients[0]), FLAGS.conv[0]) + '\n'
    print('\n' + text)
    if FLAGS.out:
      with open(FLAGS.out, 'w') as f:
        f.write(text)
    return
  steps = -(-FLAGS.examples // FLAGS.batch_size)
  sizes = [int(size) for size in FLAGS.clients]
  sections, runs, torch_results = [], [], {}
  for clients in sizes:
    for conv in FLAGS.conv:
      header = (f'### {FLAGS.model}, {SHAPES[FLAGS.model]} inputs, {clients} clients × '
                f'{FLAGS.examples} examples, {steps} local steps of batch {FLAGS.batch_size}, '
                f'unroll={FLAGS.unroll}, client_chunk={FLAGS.client_chunk}, conv={conv}\n\n'
                f'Machine: {machine()}. Median of {FLAGS.repeats} after one warm-up.\n')
      print(header, flush=True)
      results = {}
      for name in FLAGS.cases:
        if name in TORCH_CASES and (clients, name) in torch_results:
          results[name] = torch_results[(clients, name)]   # the same run for every conv
          continue
        results[name] = spawn(name, clients, conv)
        print(name, json.dumps(results[name]), flush=True)
        if name in TORCH_CASES:
          torch_results[(clients, name)] = results[name]
      sections.append(header + '\n' + case_table(results))
      runs.append((clients, conv, results))
  text = '\n\n'.join(sections) + '\n'
  if len(runs) > 1:
    text += '\n' + cohort_sweep_table(runs) + '\n'
  if FLAGS.populations and FLAGS.populations != ['']:
    text += population_sweep(sizes[0], FLAGS.conv[0]) + '\n'
  print('\n' + text)
  if FLAGS.out:
    with open(FLAGS.out, 'w') as f:
      f.write(text)


if __name__ == '__main__':
  define_flags()
  app.run(main)
