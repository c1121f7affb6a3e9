"""The base experiment config, named variants, and validation before compilation.

configs/<method>.py start from ``base_config()``, set their method's fields and
call ``apply_variant``. ``validate`` raises ValueError naming the field and the
allowed values for every bad input it knows, before any data is built or any
function compiled.
"""
from __future__ import annotations

import math
import os
import re

import ml_collections

from fedjax_shift import models
from fedjax_shift.algorithms import ALGORITHMS, base
from fedjax_shift.benchmarks import BENCHMARKS, EMBEDDED_SOURCES, PARTITIONS
from fedjax_shift.core.round import BACKENDS, SAMPLING, WEIGHTING
from fedjax_shift.data import corruptions, sources


def base_config() -> ml_collections.ConfigDict:
  """FedAvg on the embedded MNIST digits, 20 clients, Dirichlet 0.1 (FedTHE-style)."""
  c = ml_collections.ConfigDict()
  c.algorithms = ('fedavg',)        # methods to run, each over every seed
  c.seeds = (0, 1, 2)               # partition, sampling and training all follow the seed
  c.rounds = 30
  c.cohort_size = 10                # clients per round, without replacement
  c.sampling = 'uniform'            # 'uniform' | 'num_examples'
  c.weighting = 'num_examples'      # aggregation weights (McMahan et al. 2017: n_k)
  c.straggler_prob = 0.0            # FedEvolve Table 6: r
  c.straggler_max_steps = 1         # FedEvolve Table 6: τ

  c.data = ml_collections.ConfigDict()
  c.data.benchmark = 'label_skew_corrupted'
  c.data.source = 'mnist_embedded'  # or 'uci_digits', 'tfds:<name>'
  c.data.tfds_split = 'train'
  c.data.data_dir = ''              # TFDS data_dir ('' = TFDS default / $TFDS_DATA_DIR)
  c.data.max_examples = 0           # cap on TFDS examples read (0 = all)
  c.data.num_clients = 20           # FedTHE: 20 clients
  c.data.partition = 'dirichlet'
  c.data.dirichlet_alpha = 0.1      # FedTHE / FedEvolve: 0.1 and 1.0
  c.data.min_examples_per_client = 10
  c.data.classes_per_client = 2     # pathological (FedTTA: 2 classes per client)
  c.data.step_major_classes = 2     # ATP step_2_16: 2 major classes ...
  c.data.step_major_count = 80      # ... with 80 samples each
  c.data.step_minor_count = 5       # ... and 5 for each minor class
  c.data.split_fractions = ml_collections.ConfigDict(
      {'train': 0.6, 'val': 0.2, 'test': 0.2})  # FedTHE: 60/20/20
  c.data.corruptions = ('gaussian_noise', 'shot_noise', 'impulse_noise', 'defocus_blur',
                        'motion_blur', 'contrast', 'elastic_transform', 'pixelate')
  c.data.severity = 5               # FedTHE corrupted test set: severity 5
  c.data.image_size = 0             # resize (0 = keep)
  c.data.channels = 0               # repeat grey to 3 channels (0 = keep)
  c.data.store = 'device'           # 'device' | 'host' (population larger than device memory)

  c.model = ml_collections.ConfigDict()
  c.model.name = 'mlp'

  c.client = ml_collections.ConfigDict()
  c.client.optimizer = 'sgd'
  c.client.learning_rate = 0.05
  c.client.momentum = 0.0
  c.client.weight_decay = 0.0
  c.client.batch_size = 20          # ATP: batch 20
  c.client.local_epochs = 1
  c.client.local_steps = 0          # > 0: fixed steps per round instead of epochs

  c.server = ml_collections.ConfigDict()
  c.server.optimizer = 'sgd'        # 'sgd' with lr 1 is FedAvg; 'fedavgm'; 'fedadam'
  c.server.learning_rate = 1.0
  c.server.momentum = 0.9           # FedAvgM (Hsu et al. 2019)
  c.server.beta1 = 0.9              # FedAdam (Reddi et al. 2021)
  c.server.beta2 = 0.99
  c.server.adam_eps = 1e-3

  c.fedprox = ml_collections.ConfigDict({'mu': 0.01})   # FedProx μ (ATP Table 7: 0.01)
  c.finetune = ml_collections.ConfigDict({'epochs': 1})  # FedAvg-FT local epochs
  c.qffl = ml_collections.ConfigDict({'q': 1.0})         # q-FFL q (ATP Table 7: q = 1)
  c.ditto = ml_collections.ConfigDict({'lam': 0.1})      # Ditto λ (FedEvolve App. D: 0.1)
  c.fedrep = ml_collections.ConfigDict({'head_epochs': 10})  # FedRep head epochs (our default)
  c.apfl = ml_collections.ConfigDict({'alpha': 0.5})     # APFL fixed mixing α (our default)
  c.gma = ml_collections.ConfigDict({'threshold': 0.1})  # GMA τ (FedEvolve App. D: 0.1)
  c.fedsr = ml_collections.ConfigDict({'l2r': 0.01, 'cmi': 0.001})  # FedEvolve App. D

  # ATP α training (atp.txt Algorithm 1; REFERENCE.md, the authors' code).
  c.atp = ml_collections.ConfigDict()
  c.atp.rounds = 400                # CNN: 400 rounds (ResNet-18: 200)
  c.atp.cohort_size = 60            # 25 % of the 240 source clients
  c.atp.optimizer = 'sgd'
  c.atp.learning_rate = 0.1         # lr_α = 0.1
  c.atp.scaling = 'sqrt'            # ∂CE/∂α_i / sqrt(numel_i) ('none', 'numel')
  c.atp.batch_size = 20             # batch 20
  c.atp.local_epochs = 1            # one pass over the client's 40 held-out samples
  c.atp.local_steps = 0             # > 0: fixed α steps per round instead

  c.engine = ml_collections.ConfigDict()
  c.engine.unroll = 1               # lax.scan unroll of local steps (True on CPU convnets)
  c.engine.backend = 'vmap'         # 'vmap': one compiled round; 'loop': Python loop of jitted clients
  c.engine.client_chunk = 0         # 0: vmap the whole cohort; c: vmap chunks of c clients
  c.engine.num_devices = 0          # shard the cohort over this many devices (0 = one)
  c.engine.donate = False           # donate server/client buffers (GPU/TPU)
  c.engine.eval_chunk_size = 64     # clients per compiled evaluation call
  c.engine.eval_batch_size = 256

  c.eval_every = 10                 # rounds between evaluations (the last round always)
  c.eval_adapters = ()              # test-time methods on the trained models, '<adapter>:<mode>'
  c.eval_adapter_algorithms = ()    # ... applied to these algorithms' models
  c.eval_adapter_batch_size = 32    # their test batch size
  c.checkpoint_every = 5
  c.keep_checkpoints = 2
  c.progress = True
  return c


VARIANT_PATTERN = re.compile(r'^(?P<source>mnist|uci|cifar10|emnist|fashion_mnist)'
                             r'_(?P<partition>dir(?P<alpha>[0-9.]+|inf)|iid|path(?P<k>\d+))$')
TFDS_VARIANTS = {'cifar10': 'tfds:cifar10', 'emnist': 'tfds:emnist',
                 'fashion_mnist': 'tfds:fashion_mnist'}


def apply_variant(config: ml_collections.ConfigDict, arg: str | None) -> ml_collections.ConfigDict:
  """Applies a ``get_config(arg)`` variant: comma-separated parts, each one of

  * ``<source>_dir<α>`` / ``<source>_iid`` / ``<source>_path<k>`` with source in
    mnist (embedded), uci (embedded), cifar10, emnist, fashion_mnist (TFDS);
  * ``tiny``: a seconds-long run for tests and smoke checks;
  * ``quick``: one seed, fewer rounds.
  """
  for part in filter(None, (arg or '').split(',')):
    match = VARIANT_PATTERN.match(part)
    if match:
      source = match['source']
      config.data.source = {'mnist': 'mnist_embedded', 'uci': 'uci_digits'}.get(
          source, TFDS_VARIANTS.get(source))
      if source == 'cifar10':
        config.model.name = 'atp_cnn'
      if match['alpha']:
        config.data.partition = 'dirichlet'
        config.data.dirichlet_alpha = float(match['alpha'])
      elif match['k']:
        config.data.partition = 'pathological'
        config.data.classes_per_client = int(match['k'])
      else:
        config.data.partition = 'iid'
    elif part == 'tiny':
      config.seeds = (0,)
      config.rounds = 3
      config.data.num_clients = 6
      config.cohort_size = 3
      config.data.min_examples_per_client = 2
      config.data.corruptions = ('gaussian_noise', 'contrast')
      config.eval_every = 3
      config.checkpoint_every = 1
      config.model.name = 'mlp'
      config.model.hidden = (32,)
      config.progress = False
    elif part == 'quick':
      config.seeds = (0,)
      config.rounds = 10
    else:
      raise ValueError(f'unknown config variant {part!r}; use <source>_dir<alpha>, '
                       f'<source>_iid, <source>_path<k>, tiny or quick')
  return config


def _require(condition: bool, field: str, message: str):
  if not condition:
    raise ValueError(f'config.{field}: {message}')


def validate(config: ml_collections.ConfigDict, workdir: str | None = None) -> None:
  """Checks a config before any data is built or function compiled."""
  algorithms = config.algorithms
  if isinstance(algorithms, str):
    algorithms = tuple(a.strip() for a in algorithms.split(','))
  _require(len(algorithms) > 0, 'algorithms', 'name at least one algorithm')
  for name in algorithms:
    ALGORITHMS.get(name, 'config.algorithms')
  models.MODELS.get(config.model.name, 'config.model.name')
  if config.get('pipeline', 'federated') == 'federated':
    BENCHMARKS.get(config.data.benchmark, 'config.data.benchmark')
  source = config.data.source
  if config.data.benchmark == 'timed_images':
    from fedjax_shift.benchmarks.evolving import TIMED_SOURCES
    _require(source in TIMED_SOURCES, 'data.source',
             f'timed_images reads {sorted(TIMED_SOURCES)}, got {source!r}')
    _require(bool(config.data.data_dir), 'data.data_dir',
             f'{source} is not shipped with any package: pass the folder of its images '
             f'(<class>/<file> with the capture time in the name; see '
             f'fedjax_shift/data/sources.py TIMESTAMP_FORMATS)')
  _require(config.data.benchmark in ('circle', 'timed_images') or source in EMBEDDED_SOURCES or (source.startswith('tfds:') and
           source[5:].split('/')[0] in sources.TFDS_DATASETS),
           'data.source', f'unknown source {source!r}; choose from {list(EMBEDDED_SOURCES)} or '
           f'tfds:<name> with <name> in {sorted(sources.TFDS_DATASETS)}')
  _require(config.data.partition in PARTITIONS, 'data.partition',
           f'unknown partition {config.data.partition!r}; choose from {list(PARTITIONS)}')
  if config.data.partition == 'dirichlet':
    alpha = config.data.dirichlet_alpha
    _require(alpha > 0, 'data.dirichlet_alpha', f'must be > 0 (or inf), got {alpha}')
  _require(config.data.num_clients >= 1, 'data.num_clients',
           f'must be >= 1, got {config.data.num_clients}')
  _require(1 <= config.cohort_size <= config.data.num_clients, 'cohort_size',
           f'must be in [1, data.num_clients={config.data.num_clients}], got {config.cohort_size}')
  _require(config.sampling in SAMPLING, 'sampling',
           f'unknown {config.sampling!r}; choose from {list(SAMPLING)}')
  _require(config.weighting in WEIGHTING, 'weighting',
           f'unknown {config.weighting!r}; choose from {list(WEIGHTING)}')
  _require(isinstance(config.data.severity, int) and 1 <= config.data.severity <= 5,
           'data.severity', f'must be an integer in 1..5, got {config.data.severity!r}')
  for name in config.data.corruptions:
    _require(name in corruptions.ALL_CORRUPTIONS, 'data.corruptions',
             f'unknown corruption {name!r}; choose from {list(corruptions.ALL_CORRUPTIONS)}')
  fractions = dict(config.data.split_fractions)
  _require('train' in fractions and all(v >= 0 for v in fractions.values()) and
           math.isclose(sum(fractions.values()), 1.0), 'data.split_fractions',
           f'need a "train" split and non-negative fractions summing to 1, got {fractions}')
  _require(config.data.store in ('device', 'host'), 'data.store',
           f"unknown {config.data.store!r}; choose from ['device', 'host']")
  _require(config.rounds >= 1, 'rounds', f'must be >= 1, got {config.rounds}')
  _require(config.client.learning_rate > 0, 'client.learning_rate',
           f'must be > 0, got {config.client.learning_rate}')
  _require(config.server.learning_rate > 0, 'server.learning_rate',
           f'must be > 0, got {config.server.learning_rate}')
  _require(config.client.optimizer in base.CLIENT_OPTIMIZERS, 'client.optimizer',
           f'unknown {config.client.optimizer!r}; choose from {list(base.CLIENT_OPTIMIZERS)}')
  _require(config.server.optimizer in base.SERVER_OPTIMIZERS, 'server.optimizer',
           f'unknown {config.server.optimizer!r}; choose from {list(base.SERVER_OPTIMIZERS)}')
  _require(config.client.batch_size >= 1, 'client.batch_size',
           f'must be >= 1, got {config.client.batch_size}')
  _require(config.client.local_epochs >= 1 or config.client.local_steps >= 1,
           'client.local_epochs', 'need local_epochs >= 1 or local_steps >= 1')
  _require(config.client.local_steps >= 0, 'client.local_steps',
           f'must be >= 0, got {config.client.local_steps}')
  _require(0.0 <= config.straggler_prob <= 1.0, 'straggler_prob',
           f'must be in [0, 1], got {config.straggler_prob}')
  _require(config.straggler_max_steps >= 1, 'straggler_max_steps',
           f'must be >= 1, got {config.straggler_max_steps}')
  _require(config.fedprox.mu >= 0, 'fedprox.mu', f'must be >= 0, got {config.fedprox.mu}')
  _require(config.eval_every >= 1, 'eval_every', f'must be >= 1, got {config.eval_every}')
  _require(config.checkpoint_every >= 1, 'checkpoint_every',
           f'must be >= 1, got {config.checkpoint_every}')
  _require(config.engine.num_devices >= 0, 'engine.num_devices',
           f'must be >= 0, got {config.engine.num_devices}')
  if config.engine.num_devices:
    _require(config.cohort_size % config.engine.num_devices == 0, 'cohort_size',
             f'{config.cohort_size} is not divisible by engine.num_devices='
             f'{config.engine.num_devices}')
  _require(config.engine.backend in BACKENDS, 'engine.backend',
           f'unknown {config.engine.backend!r}; choose from {list(BACKENDS)}')
  _require(not (config.engine.backend == 'loop' and config.engine.num_devices), 'engine.backend',
           "'loop' runs clients one at a time and cannot shard over engine.num_devices")
  chunk = config.engine.client_chunk
  _require(chunk >= 0 and (chunk == 0 or config.cohort_size % chunk == 0), 'engine.client_chunk',
           f'must be 0 or divide cohort_size={config.cohort_size}, got {chunk}')
  _require(len(config.seeds) >= 1, 'seeds', 'name at least one seed')
  if workdir is not None:
    check_workdir(workdir)


def check_workdir(workdir: str) -> None:
  """Raises ValueError when ``workdir`` cannot be created or written."""
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as err:
    raise ValueError(f'workdir {workdir!r} cannot be created: {err}') from err
  probe = os.path.join(workdir, '.write_test')
  try:
    with open(probe, 'w') as f:
      f.write('ok')
    os.remove(probe)
  except OSError as err:
    raise ValueError(f'workdir {workdir!r} is not writable: {err}') from err


def algorithm_names(config: ml_collections.ConfigDict):
  algorithms = config.algorithms
  if isinstance(algorithms, str):
    return tuple(a.strip() for a in algorithms.split(',') if a.strip())
  return tuple(algorithms)
