"""The benchmark base: ``Benchmark`` (splits, classes, example shape, info), the
``BENCHMARKS`` registry, and what benchmarks share (loading a pooled source,
partitioning it, checking those ``config.data`` fields).

A benchmark is a function ``(data_config, seed) -> Benchmark`` registered with its
own fields (``defaults``: the section ``config.data.<benchmark>``), a
``check(data_config)`` that raises naming the field, ``pipelines``: the run loops it
feeds, and ``partitioned=True`` when it deals a pooled ``data.source`` to clients by
``data.partition`` (the results' preamble then names both). ``DATA_DEFAULTS`` are the
fields every benchmark may read, beside the sections in ``config.data``; the
``data_config`` a benchmark and its check read is ``data_view(config.data)``: the shared
fields and its own section's, flat.
"""
from __future__ import annotations

import contextlib
import os
import re
from typing import Dict, Iterator, NamedTuple, Optional, Union

import ml_collections
import numpy as np

from fedjax_shift.data import partitions, sources
from fedjax_shift.data.federated import FederatedData
from fedjax_shift.data.store import ClientStore
from fedjax_shift.registry import Range, Registry, require

BENCHMARKS: Registry = Registry('benchmark')

EMBEDDED_SOURCES = ('mnist_embedded', 'uci_digits')
# IDX folders: 'fashion_mnist' (Debian's package by default, or data.data_dir's IDX
# files, or a prepared TFDS fashion_mnist there) and 'idx' (data.data_dir's files).
IDX_SOURCES = ('fashion_mnist', 'idx')
# Sources whose examples carry their natural client (data.partition='natural').
GROUPED_SOURCES = ('femnist',)
PARTITIONS = ('dirichlet', 'iid', 'pathological', 'step', 'natural')
# A CIFAR-10-C severity: an int, as the corruptions index their parameters with it.
SEVERITY = Range('an integer in 1..5', lambda value: isinstance(value, int) and
                 not isinstance(value, bool) and 1 <= value <= 5, 0)

# config.data fields every benchmark reads (its own: its section config.data.<name>).
DATA_DEFAULTS = {
    'benchmark': 'label_skew_corrupted',
    'source': 'mnist_embedded',       # or 'uci_digits', 'fashion_mnist', 'idx', 'tfds:<name>',
                                      # 'folder:<path>'
    'tfds_split': 'train',            # the split a TFDS or IDX source reads ('train+test':
                                      # both, train first)
    'data_dir': '',                   # the folder of an IDX, TFDS or image-folder source
                                      # ('' = Debian's Fashion-MNIST / TFDS's default)
    'max_examples': 0,                # cap on TFDS / IDX / folder examples read (0 = all)
    'num_clients': 20,                # FedTHE: 20 clients
    'partition': 'dirichlet',
    'dirichlet_alpha': 0.1,           # FedTHE / FedEvolve: 0.1 and 1.0
    'min_examples_per_client': 10,
    # How a Dirichlet partition meets that minimum: 'redraw' until a draw does (the papers'
    # partitioners), or 'top_up' one draw's short clients from the largest (large
    # populations, where no draw may meet it)
    'min_examples_rule': 'redraw',
    'classes_per_client': 2,          # pathological (FedTTA: 2 classes per client)
    'step_major_classes': 2,          # ATP step_2_16: 2 major classes ...
    'step_major_count': 80,           # ... with 80 samples each
    'step_minor_count': 5,            # ... and 5 for each minor class
    'image_size': 0,                  # resize (0 = keep)
    'channels': 0,                    # 1 or 3 (grey repeated to 3; 0 = the source's own)
    'store': 'device',                # 'device' | 'host' (population larger than device memory)
    # A folder for the built splits as files, memory-mapped while training (with
    # store='host' only the cohorts are read into memory: populations larger than RAM);
    # a later run of the same data config, seed and library reads them instead of building
    'store_dir': '',
    # Pad every client of every split to this many examples (0: each split's largest
    # client). A bound that holds for every seed gives every seed the same shapes, so a
    # multi-seed run compiles once.
    'pad_to': 0,
}


def data_sections() -> Dict[str, dict]:
  """{benchmark: its own fields' defaults}: the sections of ``config.data``."""
  return {name: BENCHMARKS.defaults(name).to_dict() for name in BENCHMARKS.names()}


def sections_with(field: str, first: str = '') -> list:
  """The benchmarks whose own section has ``field``, ``first`` (the run's) first, the
  others sorted."""
  names = [name for name, fields in data_sections().items() if field in fields]
  return sorted(names, key=lambda name: name != first)


def data_view(data_config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """What the benchmark ``data_config.benchmark`` reads: the shared fields of
  ``data_config`` (``config.data``) and its own section's (``config.data.<benchmark>``),
  flat, as runs record them (``data.<field>``); a data config recorded flat (before the
  sections) as it is."""
  sections = set(BENCHMARKS.names())
  own = data_config.get(data_config.benchmark)
  fields = {key: value for key, value in data_config.items() if key not in sections}
  if isinstance(own, ml_collections.ConfigDict):
    fields.update(own.to_dict())
  return ml_collections.ConfigDict(fields)


def nested_data(data: dict) -> dict:
  """A ``config.data`` dict as the config holds it: a recorded flat one (a run written
  before the sections) with each benchmark field moved into the section of the
  benchmark it ran (other benchmarks' fields dropped: they could not change it)."""
  sections = data_sections()
  if any(name in data for name in sections):
    return data
  own = sections.get(data.get('benchmark'), {})
  out = {key: value for key, value in data.items()
         if not any(key in fields for fields in sections.values())}
  if own:
    out[data['benchmark']] = {key: data.get(key, value) for key, value in own.items()}
  return out


@contextlib.contextmanager
def configured_names(benchmark: str) -> Iterator[None]:
  """A benchmark and its check name their own fields as ``data_view`` has them
  ('config.data.<field>'); a ValueError or FileNotFoundError raised inside names a field
  of ``benchmark``'s section as the config holds it ('config.data.<benchmark>.<field>')."""
  try:
    yield
  except (ValueError, FileNotFoundError) as err:
    own = BENCHMARKS.defaults(benchmark) if benchmark in BENCHMARKS else {}
    message = str(err)
    named = re.sub(r'config\.data\.(\w+)\b', lambda m: f'config.data.{benchmark}.{m[1]}'
                   if m[1] in own else m[0], message)
    if named == message or len(err.args) != 1:
      raise
    raise type(err)(named).with_traceback(err.__traceback__) from None


def check_data(data_config: ml_collections.ConfigDict) -> None:
  """``config.data``'s benchmark section: only its fields, each in its range
  (naming ``config.data.<benchmark>.<field>``), then the benchmark's own check of
  ``data_view`` (a flat data config: its benchmark's fields of it, in their ranges)."""
  benchmark = data_config.benchmark
  BENCHMARKS.get(benchmark, 'config.data.benchmark')
  section = data_config.get(benchmark)
  if section is None:   # a flat data config (data_view's, a recorded one): its own fields
    section = {field: data_config[field] for field in BENCHMARKS.defaults(benchmark)
               if field in data_config}
  else:   # config.data: shared fields and sections only (a field set beside them is read
    # by no benchmark)
    for field in data_config.keys():
      if field not in DATA_DEFAULTS and field not in BENCHMARKS:
        owners = sections_with(field, benchmark)
        where = ' or '.join(f'config.data.{name}.{field}' for name in owners)
        require(False, f'data.{field}', 'not a field every benchmark reads; ' + (
            f'a benchmark\'s own fields are in its section: {where}' if where else
            f'choose from {sorted(DATA_DEFAULTS)} or a benchmark\'s section '
            f'config.data.<benchmark>'))
  BENCHMARKS.check(benchmark, section, f'config.data.{benchmark}', run_check=False)
  with configured_names(benchmark):
    BENCHMARKS.run_check(benchmark, data_view(data_config))


def build_benchmark(data_config: ml_collections.ConfigDict, seed: int):
  """What benchmark ``data_config.benchmark`` builds for ``seed`` from
  ``data_view(data_config)`` (``config.data``), checked first (``check_data``)."""
  check_data(data_config)
  with configured_names(data_config.benchmark):
    return BENCHMARKS.get(data_config.benchmark)(data_view(data_config), seed)


def check_source(data_config: ml_collections.ConfigDict) -> None:
  """``data.source``: an embedded or IDX source, tfds:<name> of a known TFDS dataset (with
  the 'tfds' extra installed) or folder:<path>; 'idx' needs ``data.data_dir``."""
  source = data_config.source
  require(source in EMBEDDED_SOURCES + IDX_SOURCES + GROUPED_SOURCES or
          (source.startswith('tfds:') and
          source[5:].split('/')[0] in sources.TFDS_DATASETS) or
          (source.startswith('folder:') and len(source) > len('folder:')),
          'data.source', f'unknown source {source!r}; choose from '
          f'{list(EMBEDDED_SOURCES + IDX_SOURCES + GROUPED_SOURCES)}, tfds:<name> with <name> in '
          f'{sorted(sources.TFDS_DATASETS)}, or folder:<path> (class folders under '
          f'data.data_dir, e.g. folder:tiny-imagenet-200/train)')
  if source.startswith('tfds:'):   # before anything is built: the extra that reads it
    sources.require_tfds(source[len('tfds:'):])
  require(source not in ('idx',) + GROUPED_SOURCES or bool(data_config.data_dir),
          'data.data_dir', f'data.source={source!r} reads the files of data.data_dir: set it '
          f'to their folder')
  if source in IDX_SOURCES + GROUPED_SOURCES:
    splits = sources.LEAF_SPLITS if source in GROUPED_SOURCES else sources.IDX_SPLITS
    require(data_config.tfds_split in splits, 'data.tfds_split',
            f'data.source={source!r} reads {list(splits)}, got {data_config.tfds_split!r}')


def check_dirichlet(data_config: ml_collections.ConfigDict) -> None:
  alpha = data_config.dirichlet_alpha
  require(alpha > 0, 'data.dirichlet_alpha', f'must be > 0 (or inf), got {alpha}')
  rule = min_examples_rule(data_config)
  require(rule in partitions.MIN_EXAMPLES_RULES, 'data.min_examples_rule',
          f'unknown {rule!r}; choose from {list(partitions.MIN_EXAMPLES_RULES)}')


def min_examples_rule(data_config: ml_collections.ConfigDict) -> str:
  """``data.min_examples_rule``, its default where a config recorded before it lacks it."""
  return data_config.get('min_examples_rule', DATA_DEFAULTS['min_examples_rule'])


def natural_needs_writers(source: str) -> str:
  return (f"'natural' deals each writer's examples to one client: it needs a source of "
          f"writers ({list(GROUPED_SOURCES)}), not {source!r}")


def check_partition(data_config: ml_collections.ConfigDict) -> None:
  """``data.partition`` and its parameters, ``data.num_clients``."""
  require(data_config.partition in PARTITIONS, 'data.partition',
          f'unknown partition {data_config.partition!r}; choose from {list(PARTITIONS)}')
  if data_config.partition == 'dirichlet':
    check_dirichlet(data_config)
  require(data_config.partition != 'natural' or data_config.source in GROUPED_SOURCES,
          'data.partition', natural_needs_writers(data_config.source))
  require(data_config.num_clients >= 1, 'data.num_clients',
          f'must be >= 1, got {data_config.num_clients}')


class Benchmark(NamedTuple):
  # split name -> data over the same K clients: a ClientStore (each example once) or a
  # padded FederatedData
  splits: Dict[str, Union[FederatedData, ClientStore]]
  num_classes: int
  example_shape: tuple
  info: dict  # partition statistics, corruptions per client, ...


def load_source(data_config: ml_collections.ConfigDict, class_names=()) -> sources.Source:
  """Pooled source data named by ``data_config.source``, resized if asked."""
  name = data_config.source
  check_source(data_config)
  if name == 'mnist_embedded':
    src = sources.mnist_embedded()
  elif name == 'uci_digits':
    src = sources.uci_digits()
  elif name.startswith('tfds:'):
    src = sources.tfds_source(name[len('tfds:'):], data_config.tfds_split,
                              data_config.data_dir or None, data_config.max_examples or None)
  elif name in IDX_SOURCES:
    src = idx_or_tfds_source(data_config)
  elif name == 'femnist':
    src = sources.leaf_femnist(data_config.data_dir, data_config.tfds_split)
  elif name.startswith('folder:'):
    src = sources.image_folder(os.path.join(data_config.data_dir, name[len('folder:'):]),
                               data_config.image_size or 64, data_config.max_examples or None,
                               class_names, data_config.channels)
  x = src.x
  size = data_config.image_size
  if size and x.shape[1] != size:
    x = sources.resize_images(x, size, size)
  channels = data_config.channels
  if channels:
    x = sources.to_channels(x, channels)
  return src._replace(x=x)


def idx_or_tfds_source(data_config: ml_collections.ConfigDict) -> sources.Source:
  """``data.source`` 'fashion_mnist' or 'idx': the IDX files of ``data.data_dir`` (for
  'fashion_mnist' by default Debian's package folder); 'fashion_mnist' with a
  ``data_dir`` that holds no IDX files reads a prepared TFDS fashion_mnist there. The
  first ``data.max_examples`` when set."""
  split, limit = data_config.tfds_split, data_config.max_examples or None
  folder = data_config.data_dir or (sources.FASHION_MNIST_DIR
                                    if data_config.source == 'fashion_mnist' else '')
  if data_config.source == 'fashion_mnist' and data_config.data_dir and \
      not sources.idx_pairs(folder, split):
    try:
      return sources.tfds_source('fashion_mnist', split, folder, limit)
    except FileNotFoundError as err:
      raise FileNotFoundError(f'config.data.data_dir: {sources.missing_idx(folder, split)}; '
                              f'nor is a TFDS fashion_mnist prepared there ({err})') from None
  try:
    return sources.idx_source(folder, split, 10 if data_config.source == 'fashion_mnist' else 0,
                              limit)
  except FileNotFoundError as err:
    raise FileNotFoundError(f'config.data.source={data_config.source!r}: {err}') from None


def partition(labels: np.ndarray, data_config: ml_collections.ConfigDict, num_classes: int,
              rng: np.random.Generator, num_clients: Optional[int] = None,
              groups: Optional[np.ndarray] = None):
  """``labels`` split over ``num_clients`` (default ``data.num_clients``) clients by
  ``data.partition``: a list of index arrays. 'natural' needs ``groups`` [M], each
  example's writer."""
  kind = data_config.partition
  num_clients = num_clients or data_config.num_clients
  if kind == 'natural':
    if groups is None:
      raise ValueError(f'config.data.partition: {natural_needs_writers(data_config.source)}')
    return partitions.natural(groups, num_clients, rng)
  if kind == 'dirichlet':
    return partitions.dirichlet(labels, num_clients, data_config.dirichlet_alpha, rng,
                                min_examples=data_config.min_examples_per_client,
                                rule=min_examples_rule(data_config))
  if kind == 'iid':
    return partitions.dirichlet(labels, num_clients, float('inf'), rng, min_examples=0)
  if kind == 'pathological':
    return partitions.pathological(labels, num_clients, data_config.classes_per_client, rng)
  if kind == 'step':
    return partitions.step(labels, num_clients, data_config.step_major_classes,
                           data_config.step_major_count, data_config.step_minor_count, rng,
                           num_classes)
  raise ValueError(f'config.data.partition: unknown partition {kind!r}; choose from '
                   f'{list(PARTITIONS)}')


