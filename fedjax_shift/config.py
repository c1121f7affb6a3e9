"""The base experiment config, named variants, and validation before compilation.

``base_config()`` holds every field the library reads, each with one default: the
run's own fields here, and the sections the registries own — each algorithm's
``config.<name>``, each adapter's ``config.adapters.<name>`` (a variant's section: only
what it changes from its method's, ``Registry.register(variant_of=)``), each benchmark's
``config.data.<benchmark>`` beside the shared ``config.data`` fields and each pipeline's
sections (the test-time pipeline's ``tta`` and ``atp``) — filled from what their files registered. configs/<method>.py
start from ``base_config()``, set their fields and call ``apply_variant``.
``validate`` raises ValueError naming the field and the allowed values for every bad
input it knows, before any data is built or any function compiled.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
from typing import Callable, Optional, Sequence, Tuple

import ml_collections

from fedjax_shift import papers, pipelines  # noqa: F401  (papers: registers their table layouts)
from fedjax_shift.adapters import ADAPTERS
from fedjax_shift.algorithms import ALGORITHMS
from fedjax_shift.benchmarks import DATA_DEFAULTS, data_sections
from fedjax_shift.core import plan
from fedjax_shift.pipelines import PIPELINES, callbacks


def engine_defaults() -> ml_collections.ConfigDict:
  """``config.engine``: how rounds are compiled and run (nothing in it changes a
  trained state, so none of it is fingerprinted)."""
  e = ml_collections.ConfigDict()
  e.unroll = 1                      # lax.scan unroll of local steps (True on CPU convnets)
  e.backend = 'auto'                # 'vmap': one compiled round; 'loop': Python loop of jitted
                                    # clients; 'auto': loop for conv models on CPU, else vmap
  e.rounds_per_call = 1             # R rounds per compiled call (a lax.scan); metrics per round
  e.vmap_seeds = False              # every seed of a method in lockstep, the round vmapped over
                                    # seeds (one call per round; needs equal shapes: data.pad_to)
  e.client_chunk = 0                # c: the cohort sorted by local steps, vmapped in groups of
                                    # c clients, each looping to its largest client's steps
                                    # (less memory, less padding); 0: fitted, see max_scanned
  e.max_scanned = plan.MAX_SCANNED  # client_chunk 0: the widest groups whose
                                    # scanned local steps stay <= this x the real ones on the
                                    # train split's sizes (0: one vmap of the whole cohort)
  e.example_buckets = ()            # padded client sizes, ascending, the last >= the largest
                                    # client: a group of the sorted cohort (or, with the loop
                                    # backend, a client) is cut to the smallest that holds it;
                                    # (): at most example_shapes sizes fitted to the train split
  e.example_shapes = 4              # ... one compiled client update per size
  e.likely_plan = True              # cohorts drawn from a larger population: groups cut to
                                    # sizes likely cohorts hold, a cohort that exceeds them
                                    # running at sizes every cohort holds (not with
                                    # vmap_seeds or a sweep: their runs would pay for both)
  e.num_devices = 0                 # shard the cohort over this many devices (0 = one)
  e.donate = False                  # donate server/client buffers (GPU/TPU)
  e.deterministic = False           # XLA deterministic GPU ops (launch/train.py; no-op on CPU)
  e.eval_chunk_size = 0             # clients per compiled evaluation call (0: 1 with the
                                    # loop backend, 64 with the vmapped round)
  e.eval_batch_size = 256
  return e


def base_config() -> ml_collections.ConfigDict:
  """FedAvg on the embedded MNIST digits, 20 clients, Dirichlet 0.1 (FedTHE-style)."""
  c = ml_collections.ConfigDict()
  c.pipeline = 'federated'          # run loop: 'federated' | 'atp' | 'hetero' | 'pretrain'
  c.algorithms = ('fedavg',)        # methods to run, each over every seed
  c.seeds = (0, 1, 2)               # partition, sampling and training all follow the seed
  c.rounds = 30
  c.cohort_size = 10                # clients per round, without replacement
  c.sampling = 'uniform'            # 'uniform' | 'num_examples'
  c.weighting = 'num_examples'      # aggregation weights (McMahan et al. 2017: n_k)
  c.straggler_prob = 0.0            # FedEvolve Table 6: r
  c.straggler_max_steps = 1         # FedEvolve Table 6: τ

  c.data = ml_collections.ConfigDict({**DATA_DEFAULTS, **data_sections()})  # benchmarks/*.py

  c.model = ml_collections.ConfigDict()
  c.model.name = 'mlp'              # other fields are the model builder's keyword arguments
  c.model.conv = 'auto'             # 'lax' | 'patches' | 'lax_patch_grad' | 'auto' (models/)

  c.client = ml_collections.ConfigDict()
  c.client.optimizer = 'sgd'
  c.client.learning_rate = 0.05
  c.client.momentum = 0.0
  c.client.weight_decay = 0.0
  c.client.clip_norm = 0.0          # > 0: each local step's gradient clipped to this global
                                    # norm before weight decay and the step (0: none)
  c.client.batch_size = 20          # ATP: batch 20
  c.client.local_epochs = 1
  c.client.local_steps = 0          # > 0: fixed steps per round instead of epochs
  c.client.augmentation = ()        # data/augment.py VIEW_AUGMENTATIONS names, applied in
                                    # order to every training image (e.g. flip, rotate15)

  c.client_overrides = ml_collections.ConfigDict()  # <method>: config.client fields that
                                    # method trains with instead, e.g. {'fedprox':
                                    # {'learning_rate': 0.3}} (a paper's per-method rate)

  c.server = ml_collections.ConfigDict()
  c.server.optimizer = 'sgd'        # 'sgd' with lr 1 is FedAvg; 'fedavgm'; 'fedadam'
  c.server.learning_rate = 1.0
  c.server.momentum = 0.9           # FedAvgM (Hsu et al. 2019)
  c.server.beta1 = 0.9              # FedAdam (Reddi et al. 2021)
  c.server.beta2 = 0.99
  c.server.adam_eps = 1e-3

  for name in ALGORITHMS.names():   # each method's hyperparameters (algorithms/<name>.py)
    c[name] = ALGORITHMS.own_defaults(name)   # a variant's: what it changes
  c.adapters = ml_collections.ConfigDict(  # each adapter's (adapters/<name>.py)
      {name: ADAPTERS.own_defaults(name) for name in ADAPTERS.names()})
  for name in PIPELINES.names():    # each pipeline's sections (pipelines/<name>.py)
    for section, fields in PIPELINES.defaults(name).items():
      c[section] = fields

  c.engine = engine_defaults()

  c.eval_every = 10                 # rounds between evaluations (the last round always)
  c.eval_adapters = ()              # test-time methods on the trained models, '<adapter>:<mode>'
  c.eval_adapter_algorithms = ()    # ... applied to these algorithms' models (): every method
                                    # run that one of the adapters adapts
  c.eval_adapter_batch_size = 32    # their test batch size
  c.eval_adapter_splits = ('test',) # ... run on the evaluation splits named with these prefixes
  c.paper_tables = ''               # a registered paper table (fedjax_shift/papers/) to print too
  c.paper_rounds = 0                # the rounds of the protocol the config follows (set by
                                    # apply_variant): fewer, and its claims are not judged
  c.checkpoint_every = 5
  c.keep_checkpoints = 2            # >= 1: the final checkpoint is what a re-run resumes from
  c.resume = ''                     # '' | 'extend': continue finished runs to a larger rounds
                                    # (and runs stopped early past their stop)
  c.on_divergence = 'stop'          # 'stop' | 'continue': a NaN run stops the pipeline, or is
                                    # recorded as diverged and the other runs go on
  c.progress = True                 # a bar on a terminal; in a log file, plain lines:
  c.log_every = 0                   # every log_every rounds (0: about a tenth of the run)
  c.tensorboard = True              # <run dir>/tensorboard/: metrics.jsonl as event files
  c.early_stopping = callbacks.early_stopping_defaults()   # stop a run on a validation metric
  c.log_to = ()                     # loggers of every record: ('wandb',), ('mlflow',) (extras)
  c.log_project = 'fedjax_shift'    # ... their W&B project / MLflow experiment
  c.sweep = ml_collections.ConfigDict()   # a hyperparameter grid shaped as the config, e.g.
                                    # {'client': {'learning_rate': (0.01, 0.1)}}: each point
                                    # x seed a run (pipelines/sweep.py)
  c.sweep_select = 'last'           # per method, the point of best mean validation accuracy at
                                    # the last round, or 'best_round' (at each run's best)
  c.sweep_metric = ml_collections.ConfigDict()  # that metric per method ({}: the global
                                    # model's on the val split), '*' for every method not
                                    # named, e.g. {'fedper': 'personalized/val/accuracy'}
  return c


# A variant: (pattern, apply(config, match)); get_config(arg) applies each
# comma-separated part of arg with the first variant whose pattern matches it in full.
Variant = Tuple[str, Callable[[ml_collections.ConfigDict, re.Match], None]]


def _tiny(c: ml_collections.ConfigDict, match=None) -> None:
  """Seconds-long runs for tests and smoke checks: one seed, 3 rounds of 3 of 6 clients."""
  c.seeds = (0,)
  c.rounds = 3
  c.data.num_clients = 6
  c.cohort_size = 3
  c.eval_every = 3
  c.checkpoint_every = 1
  c.progress = False


def _quick(c: ml_collections.ConfigDict, match=None) -> None:
  """One seed, 10 rounds."""
  c.seeds = (0,)
  c.rounds = 10


# Shared by every config; a config's own 'tiny' / 'quick' runs after these.
RUN_VARIANTS: Tuple[Variant, ...] = (('tiny', _tiny), ('quick', _quick))

# The variants' sources: embedded, Debian's Fashion-MNIST (data.data_dir: another folder
# of its IDX files, or a prepared TFDS build), TFDS.
VARIANT_SOURCES = {'mnist': 'mnist_embedded', 'uci': 'uci_digits', 'fashion_mnist': 'fashion_mnist',
                   'cifar10': 'tfds:cifar10', 'emnist': 'tfds:emnist'}


def _source_partition(c: ml_collections.ConfigDict, match: re.Match) -> None:
  source = match['source']
  c.data.source = VARIANT_SOURCES[source]
  if source == 'cifar10':
    c.model.name = 'atp_cnn'
  if match['alpha']:
    c.data.partition = 'dirichlet'
    c.data.dirichlet_alpha = float(match['alpha'])
  elif match['k']:
    c.data.partition = 'pathological'
    c.data.classes_per_client = int(match['k'])
  else:
    c.data.partition = 'iid'


def _label_skew_tiny(c: ml_collections.ConfigDict, match=None) -> None:
  c.data.min_examples_per_client = 2
  c.data.label_skew_corrupted.corruptions = ('gaussian_noise', 'contrast')
  # A small MLP; with BatchNorm where the config's model has it (FedBN keeps it local).
  batch_norm = c.model.name in ('bn_mlp', 'atp_cnn', 'resnet18') or 'fedbn' in c.algorithms
  c.model.name = 'bn_mlp' if batch_norm else 'mlp'
  c.model.hidden = (32,)


# The label-skew configs' variants (configs/fedavg.py, fedprox.py, …): the default.
SOURCE_VARIANTS: Tuple[Variant, ...] = (
    (r'(?P<source>mnist|uci|cifar10|emnist|fashion_mnist)'
     r'_(?P<partition>dir(?P<alpha>[0-9.]+|inf)|iid|path(?P<k>\d+))', _source_partition),
    ('tiny', _label_skew_tiny),
)
SOURCE_VARIANTS_HELP = ('<source>_dir<alpha>, <source>_iid, <source>_path<k> (source in mnist, '
                        'uci, fashion_mnist, cifar10, emnist)')


def apply_variant(config: ml_collections.ConfigDict, arg: Optional[str],
                  variants: Sequence[Variant] = SOURCE_VARIANTS,
                  usage: str = SOURCE_VARIANTS_HELP) -> ml_collections.ConfigDict:
  """Applies a ``get_config(arg)`` variant: comma-separated parts, each matched in
  full by the shared ``RUN_VARIANTS`` (``tiny``, ``quick``) and/or one of the
  config's own ``variants`` (both run, the shared one first). ``usage`` names the
  config's own variants in the error for an unknown part. ``config.paper_rounds``
  becomes the rounds of the protocol without the shortening ``tiny`` and ``quick``
  (a variant that shortens a paper's protocol itself sets the paper's rounds there)."""
  protocol = ml_collections.ConfigDict(config.to_dict())
  for part in filter(None, (arg or '').split(',')):
    if not any(re.fullmatch(pattern, part) for pattern, _ in RUN_VARIANTS):
      for pattern, apply in variants:
        match = re.fullmatch(pattern, part)
        if match:
          apply(protocol, match)
          break
  for part in filter(None, (arg or '').split(',')):
    matched = False
    for pattern, apply in tuple(RUN_VARIANTS) + tuple(variants):
      match = re.fullmatch(pattern, part)
      if match:
        apply(config, match)
        matched = True
        if pattern not in dict(RUN_VARIANTS):
          break
    if not matched:
      raise ValueError(f'unknown config variant {part!r}; the known variants are {usage}, '
                       f'tiny and quick (an unknown variant is never ignored)')
  config.paper_rounds = max(protocol.paper_rounds, protocol.rounds)
  return config


# The repository's configs/ beside the package (an editable install: pip install -e .).
REPOSITORY_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  'configs')


def config_path(path: str) -> str:
  """The file ``path`` names: itself where it exists (relative to the working
  directory), else the repository's ``configs/<name>`` ('configs/default.py' and
  'default.py' from any directory); FileNotFoundError naming both places."""
  for candidate in (path, os.path.join(REPOSITORY_CONFIGS, os.path.basename(path))):
    if os.path.isfile(candidate):
      return os.path.abspath(candidate)
  known = (sorted(n for n in os.listdir(REPOSITORY_CONFIGS) if n.endswith('.py'))
           if os.path.isdir(REPOSITORY_CONFIGS) else
           'not beside this install: pip install -e the repository')
  raise FileNotFoundError(f'no config file {path!r} here ({os.getcwd()}) nor in the '
                          f'repository\'s configs ({REPOSITORY_CONFIGS}: {known})')


def load(spec: str) -> ml_collections.ConfigDict:
  """The config ``spec`` names, as ``launch/train.py --config=<spec>`` reads it:
  ``'<file>.py[:<variant>]'``, the file found by ``config_path`` (so
  ``load('configs/default.py:tiny')`` works from any directory), its ``get_config``
  called with the variant. A config file may import its siblings (``from configs import
  fedevolve``)."""
  path, _, variant = spec.partition(':')
  path = config_path(path)
  root = os.path.dirname(os.path.dirname(path))
  loader = importlib.util.spec_from_file_location(
      f'fedjax_shift_config_{os.path.splitext(os.path.basename(path))[0]}', path)
  module = importlib.util.module_from_spec(loader)
  added = root not in sys.path
  if added:   # its siblings import as configs.<name>
    sys.path.insert(0, root)
  try:
    loader.loader.exec_module(module)
  finally:
    if added:
      sys.path.remove(root)
  return module.get_config(variant) if variant else module.get_config()


def validate(config: ml_collections.ConfigDict, workdir: str | None = None) -> None:
  """The checks of ``config.pipeline`` (pipelines/run_config.py ``check_run`` and the
  pipeline's own), then that ``workdir`` is writable."""
  pipelines.validate(config, workdir)
