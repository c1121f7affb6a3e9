"""What every benchmark case shares: the cohort's size, its clients' sizes (uniform,
skewed, the default experiment's), the input shapes and timing. Imports nothing of
fedjax_shift at the top: the PyTorch and fedjax peers run in environments without it.
"""

import functools
import resource
import statistics
import time

import numpy as np
from absl import flags

from launch.benchmarks import find

FLAGS = flags.FLAGS

CONV_CHOICES = ('auto', 'lax', 'patches', 'lax_patch_grad')
CONV_MODELS = ('atp_cnn', 'evolve_cnn', 'domainbed64', 'lenet5')
TORCH_CASES = ('torch', 'torch_vmap')   # no convolution choice: run once per cohort size
SHAPES = {'atp_cnn': (32, 32, 3), 'mlp': (28, 28, 1), 'bn_mlp': (28, 28, 1),
          'evolve_cnn': (28, 28, 1), 'domainbed64': (28, 28, 1), 'vit': (28, 28, 3),
          'lenet5': (28, 28, 1)}
SIZE_PROFILES = ('uniform', 'skewed', 'default_experiment')
# 60 clients, 12,000 examples: a floor of 20 per client plus a Dirichlet(0.5) split of the
# other 10,800 (min 20, median 96, max 1,043), in client order.
SKEWED_SIZES = (59, 57, 530, 24, 41, 32, 386, 44, 161, 71, 20, 168, 162, 26, 23, 98, 520, 72,
                282, 94, 140, 41, 23, 44, 71, 246, 49, 159, 125, 28, 54, 44, 29, 607, 92, 1010,
                92, 52, 426, 810, 20, 244, 182, 137, 32, 245, 164, 219, 137, 70, 20, 212, 874,
                87, 297, 20, 1043, 394, 190, 401)


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


def peak_rss_gb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def unroll_value():
  text = FLAGS.unroll.lower()
  return {'true': True, 'false': False}.get(text, int(text) if text.isdigit() else True)


@functools.lru_cache(maxsize=None)
def default_experiment_sizes():
  """[20] the train-split sizes of the default experiment (configs/default.py, seed 0);
  built from fedjax_shift, imported here only: a peer's environment has none (it is
  given the sizes, --sizes_list)."""
  from configs.default import get_config
  from fedjax_shift.pipelines.runs import build_data
  return np.asarray(build_data(get_config(), 0).splits['train'].num_examples, np.int64)


def client_sizes(num_clients, profile: str = ''):
  """[C] examples per client of the --sizes ``profile`` ('' = --sizes, or --sizes_list
  when given); 'skewed' keeps the total C·N."""
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


def timed(fn, repeats):
  """(median seconds, all seconds) of ``fn()`` after one warm-up call."""
  fn()
  times = []
  for _ in range(repeats):
    tick = time.perf_counter()
    fn()
    times.append(time.perf_counter() - tick)
  return statistics.median(times), times


def first_then_timed(run) -> dict:
  """{'seconds': the median of FLAGS.repeats calls of ``run`` after a first one,
  'times', 'compile_s': that first call (compilation plus one call)}."""
  tick = time.perf_counter()
  run()
  compile_s = time.perf_counter() - tick
  median, times = timed(run, FLAGS.repeats)
  return {'seconds': median, 'times': times, 'compile_s': compile_s}


def cohort_arrays(num_clients):
  """(x [C, N, ...], y [C, N], mask [C, N], num_examples [C]) of random clients of
  ``client_sizes`` (seed 0), the padding zeroed."""
  rng = np.random.default_rng(0)
  shape = SHAPES[FLAGS.model]
  sizes = client_sizes(num_clients)
  num_clients, padded = len(sizes), int(sizes.max())
  mask = np.arange(padded)[None, :] < sizes[:, None]
  x = rng.random((num_clients, padded) + shape, dtype=np.float32) * mask.reshape(
      mask.shape + (1,) * len(shape))
  y = rng.integers(0, 10, (num_clients, padded)).astype(np.int32) * mask
  return x, y, mask, sizes.astype(np.int32)


def define_flags() -> None:
  """The command line (defined when run as a script, so that importing this file
  for its functions defines no flags beside another script's)."""
  flags.DEFINE_enum('model', 'atp_cnn', ['atp_cnn', 'mlp', 'bn_mlp', 'evolve_cnn',
                                          'domainbed64', 'vit', 'lenet5'],
                    'Model to benchmark (vit: the registered defaults, configs/fedins.py; '
                    "domainbed64: FedEvolve's Table 7 CNN, configs/fedevolve.py:domainbed64; "
                    "lenet5: the FedTTA authors' Fashion-MNIST LeNet 32/64/512, "
                    'configs/fedtta.py:fashion_mnist).')
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
  flags.DEFINE_float('max_scanned', None, 'engine.max_scanned for (a) with --client_chunk=0 '
                     "(0: one vmap of the whole cohort; unset: the config's default).")
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
  flags.DEFINE_string('tta_adapter', 'atp',
                      'Adapter of the tta_* cases: atp, tent, fedicon (its online variant '
                      'with a memory of 8 batches, on a FedICON model), fedthe (20 ensemble '
                      'steps), surgical, or any other registered adapter (its registered '
                      'defaults).')
  flags.DEFINE_list('tta_compare', ['tent', 'sar', 'cotta', 'rotta', 'note', 'no_adapt',
                                    'lame', 'pl', 'conjugate_pl'],
                    'Adapters of the tta_compare case, timed in turn (interleaved) on the '
                    'same batches; the first is the reference.')
  flags.DEFINE_integer('tta_epochs', 5, "Passes over the test split of the 'transductive' "
                       'test-time case (tta_transductive).')
  flags.DEFINE_list('populations', ['240', '1000', '10000'],
                    'Population sweep: clients of distinct rotated images.')
  flags.DEFINE_list('placements', ['host'], "The population sweep's stores: host, device.")
  flags.DEFINE_integer('sweep_repeats', 3, 'Timed repeats per population.')
  flags.DEFINE_string('case', '', 'Internal: run one case in this process and print JSON.')
  flags.DEFINE_string('out', '', 'Write the markdown table here.')
  flags.DEFINE_string('trace', '', 'Case (a): trace one more round with jax.profiler into '
                      'this folder and list its device kernels by total time.')


def run_case(name: str) -> dict:
  """Case ``name``'s result, with this process's peak RSS (GB)."""
  result = find(name).run(name)
  result['peak_rss_gb'] = peak_rss_gb()
  return result
