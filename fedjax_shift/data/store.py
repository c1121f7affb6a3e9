"""A population stored compactly: each split's examples once, in the order of its clients.

    ClientStore(x: [Σn, ...], y: [Σn], offsets: [K+1], num_examples: [K], palette: [P] | None)

Client k holds examples ``offsets[k] … offsets[k+1]-1``. Memory follows the examples,
never K × the largest client: 70,000 Fashion-MNIST images over 10,000 Dirichlet(0.1)
clients take 55 MB here (uint8) against 2.2 GB padded to float32.

Images keep their source's bytes: when every input value is one of at most 256 floats
(pixels k/255 of a uint8 image, the 17 grey levels of the UCI digits), ``x`` holds uint8
codes into ``palette`` and decoding is a table lookup, so the floats the model sees are
exactly the ones a padded float32 layout holds; other inputs stay float32.

``FederatedData`` (``data/federated.py``) stays the layout of a gathered cohort and of a
chunk of clients: ``take`` builds it on the host, ``gather_clients`` inside a compiled
program (the round's cohort, at the sizes the round's plan cut its groups to).
"""
from __future__ import annotations

import json
import os
import weakref
from typing import Optional, Sequence, Tuple

import flax
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_shift.data.federated import (FederatedData, check_integer_labels,
                                         client_statistics, partition_statistics)
from fedjax_shift.data.federated import pad_examples as federated_pad_examples
from fedjax_shift.data.federated import validate as federated_validate

MAX_PALETTE = 256
# A store's arrays start on this many bytes, so that on a CPU ``jax.device_put`` uses
# them in place instead of copying them (the device store then costs no second copy).
ALIGNMENT = 64


def aligned_empty(shape: Tuple[int, ...], dtype) -> np.ndarray:
  """An uninitialised array whose data start on an ``ALIGNMENT``-byte boundary."""
  dtype = np.dtype(dtype)
  size = int(np.prod(shape)) * dtype.itemsize
  buffer = np.empty(size + ALIGNMENT, np.uint8)
  start = -buffer.ctypes.data % ALIGNMENT
  return buffer[start:start + size].view(dtype).reshape(shape)


def aligned(array: np.ndarray) -> np.ndarray:
  """``array``, or an ``ALIGNMENT``-aligned copy of it where its data are not aligned."""
  array = np.asarray(array)
  if array.ctypes.data % ALIGNMENT == 0 and array.flags.c_contiguous:
    return array
  out = aligned_empty(array.shape, array.dtype)
  out[...] = array
  return out


@flax.struct.dataclass
class ClientStore:
  """One split of a federated dataset, each client's examples stored once.

  Attributes:
    x: [Σn, ...] uint8 codes into ``palette``, or float32 inputs when ``palette`` is None.
    y: [Σn] int32 labels.
    offsets: [K+1] int32, client k's examples are rows offsets[k] … offsets[k+1]-1.
    num_examples: [K] int32, ``diff(offsets)``.
    palette: [P ≤ 256] float32, the input value of each code; None for float32 ``x``.
    max_examples: N, the largest client's examples (at least 1; static: the padded size
      a gathered cohort or chunk of clients has unless cut shorter).
  """
  x: np.ndarray
  y: np.ndarray
  offsets: np.ndarray
  num_examples: np.ndarray
  palette: Optional[np.ndarray]
  max_examples: int = flax.struct.field(pytree_node=False, default=1)

  @property
  def num_clients(self) -> int:
    return int(self.num_examples.shape[0])

  @property
  def example_shape(self) -> Tuple[int, ...]:
    return tuple(self.x.shape[1:])

  def layout_key(self) -> tuple:
    """What a compiled program's shapes depend on, beside the stored rows (which any
    jitted call re-traces on): clients, N, the example's shape."""
    return ('store', self.num_clients, self.max_examples) + self.example_shape

  @property
  def nbytes(self) -> int:
    """Bytes of every array of the store."""
    return sum(int(np.asarray(leaf).nbytes) for leaf in jax.tree.leaves(self))

  def decode(self, codes):
    """Float32 inputs of stored rows ``codes`` (numpy on the host, jnp when traced)."""
    if self.palette is None:
      return codes
    return self.palette[codes]

  def take(self, client_ids, pad_to: Optional[int] = None) -> FederatedData:
    """The clients ``client_ids`` [C] as a padded FederatedData [C, ``pad_to`` (default
    ``max_examples``), ...] on the host (numpy), zeros where padded."""
    client_ids = np.asarray(client_ids, np.int64)
    num_pad = self.max_examples if pad_to is None else int(pad_to)
    counts = np.asarray(self.num_examples)[client_ids]
    if counts.size and counts.max() > num_pad:
      raise ValueError(f'pad_to={num_pad} is smaller than the largest client taken '
                       f'({counts.max()} examples)')
    rows, mask = _rows(np.asarray(self.offsets)[client_ids], counts, num_pad,
                       len(self.y), np)
    if not len(self.y):   # a split without examples (a fraction of 0): all padding
      x = np.zeros(mask.shape + self.example_shape, np.float32)
      return FederatedData(x, np.zeros(mask.shape, np.int32), mask, counts.astype(np.int32))
    x = np.where(mask.reshape(mask.shape + (1,) * len(self.example_shape)),
                 np.asarray(self.decode(np.asarray(self.x)[rows])), np.float32(0))
    y = np.where(mask, np.asarray(self.y)[rows], 0).astype(np.int32)
    return FederatedData(x.astype(np.float32), y, mask, counts.astype(np.int32))

  def padded(self, pad_to: Optional[int] = None) -> FederatedData:
    """Every client padded to ``pad_to`` (default ``max_examples``): K × N × the
    example's floats; for code that needs the whole padded layout at once."""
    return self.take(np.arange(self.num_clients), pad_to)

  def client(self, k: int) -> Tuple[np.ndarray, np.ndarray]:
    """Client ``k``'s (x [n_k, ...] float32, y [n_k]) on the host."""
    start, stop = int(self.offsets[k]), int(self.offsets[k + 1])
    return (np.asarray(self.decode(np.asarray(self.x)[start:stop]), np.float32),
            np.asarray(self.y[start:stop]))

  def first_example(self) -> np.ndarray:
    """x [1, ...] float32: client 0's first example, zeros when it has none (the row a
    padded layout holds there; what a model is initialised on)."""
    if int(self.num_examples[0]) == 0:
      return np.zeros((1,) + self.example_shape, np.float32)
    return np.asarray(self.decode(np.asarray(self.x)[:1]), np.float32)

  def with_rows(self, rows: int) -> 'ClientStore':
    """The store with its stored rows padded to ``rows`` (copies of row 0, never a
    client's), so that stores of several seeds stack into one array."""
    extra = int(rows) - len(self.y)
    if extra < 0:
      raise ValueError(f'with_rows({rows}): the store holds {len(self.y)} rows')
    if extra == 0:
      return self
    grow = lambda a: np.concatenate([np.asarray(a), np.repeat(np.asarray(a)[:1] if len(a)
                                     else np.zeros((1,) + a.shape[1:], a.dtype), extra, 0)])
    return self.replace(x=grow(self.x), y=grow(self.y))


def _rows(starts, counts, num_pad: int, total: int, xp):
  """Stored rows [C, num_pad] of clients starting at ``starts`` [C] with ``counts`` [C]
  examples (rows past a client's count repeat a valid row and are masked), and the
  mask [C, num_pad]; ``xp`` is numpy or jax.numpy."""
  positions = xp.arange(num_pad)
  mask = positions[None, :] < counts[:, None]
  rows = starts[:, None] + xp.minimum(positions[None, :], xp.maximum(counts[:, None] - 1, 0))
  return xp.minimum(rows, max(total - 1, 0)), mask


def gather_clients(store: ClientStore, rows, examples: Optional[int] = None
                   ) -> FederatedData:
  """Inside a compiled program: the clients ``rows`` [R] of ``store`` as FederatedData
  [R, ``examples`` (default ``store.max_examples``), ...] float32, zeros where padded.
  A client's examples past ``examples`` are cut (the round's plan never cuts real
  ones: ``core/plan.py``)."""
  num_pad = store.max_examples if examples is None else int(examples)
  counts = jnp.minimum(store.num_examples[rows], num_pad)
  stored, mask = _rows(store.offsets[rows], counts, num_pad, store.y.shape[0], jnp)
  x = store.decode(store.x[stored]).astype(jnp.float32)
  x = jnp.where(mask.reshape(mask.shape + (1,) * (x.ndim - 2)), x, 0.0)
  return FederatedData(x, jnp.where(mask, store.y[stored], 0), mask,
                       store.num_examples[rows])


# Rows encoded at once by ``encode_inputs``: about this many input values.
ENCODE_VALUES = 1 << 22


def encode_inputs(x: np.ndarray, rows: Optional[np.ndarray] = None
                  ) -> Tuple[np.ndarray, Optional[np.ndarray]]:
  """(codes, palette) of the rows ``rows`` of ``x`` (default: all): uint8 codes and the
  ≤ 256 float32 values they stand for when the inputs take no more values than that
  (exactly: ``palette[codes] == x[rows]``), else (``x[rows]`` as float32, None). Pixels
  k/255 are recognised a block of rows at a time, without sorting and without a float
  copy of the rows."""
  x = np.asarray(x)
  if x.dtype == np.uint8:   # raw values 0 … 255, as a float32 layout would hold them
    if rows is None:
      return x, np.arange(MAX_PALETTE, dtype=np.float32)
    codes = aligned_empty((len(rows),) + x.shape[1:], np.uint8)
    np.take(x, np.asarray(rows, np.int64), axis=0, out=codes)
    return codes, np.arange(MAX_PALETTE, dtype=np.float32)
  rows = np.arange(len(x)) if rows is None else np.asarray(rows, np.int64)
  if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)
          or x.dtype == bool):
    raise ValueError(f'inputs of dtype {x.dtype}: a model takes real numbers')
  if len(rows) == 0:
    return np.zeros((0,) + x.shape[1:], np.float32), None
  grey = np.arange(MAX_PALETTE, dtype=np.float32) / np.float32(255)
  codes = aligned_empty((len(rows),) + x.shape[1:], np.uint8)
  block = max(1, ENCODE_VALUES // max(1, int(np.prod(x.shape[1:]))))
  for start in range(0, len(rows), block):
    values = x[rows[start:start + block]].astype(np.float32, copy=False)
    with np.errstate(invalid='ignore'):   # NaN casts to some code; the comparison fails
      chunk = np.clip(np.rint(values * 255), 0, 255).astype(np.uint8)
    if not np.array_equal(grey[chunk], values):
      break
    codes[start:start + block] = chunk
  else:
    return codes, grey
  values = x[rows].astype(np.float32, copy=False)
  palette = np.unique(values)
  if palette.size > MAX_PALETTE or not np.isfinite(palette).all():
    return aligned(values), None
  return aligned(np.searchsorted(palette, values).astype(np.uint8)), palette.astype(np.float32)


def from_arrays(x: np.ndarray, y: np.ndarray, num_examples: Sequence[int],
                split: str = '', rows: Optional[np.ndarray] = None) -> ClientStore:
  """A store of examples in client order: x [Σn, ...], y [Σn] (or their ``rows`` [Σn],
  without a copy of the rest) and each client's count [K] (zeros allowed). Errors name
  the split and client."""
  where = f' in split {split!r}' if split else ''
  counts = np.asarray(num_examples, np.int64)
  if counts.ndim != 1 or counts.size == 0:
    raise ValueError(f'num_examples{where} must be one count per client, got shape '
                     f'{counts.shape}')
  if (counts < 0).any():
    bad = int(np.argmax(counts < 0))
    raise ValueError(f'client {bad}{where}: num_examples={counts[bad]} is negative')
  x, y = np.asarray(x), np.asarray(y)
  if rows is not None:
    y = y[rows]
  stored = len(x) if rows is None else len(rows)
  if stored != len(y) or len(y) != counts.sum():
    raise ValueError(f'the client counts{where} add up to {counts.sum()} examples but x has '
                     f'{stored} and y {len(y)}')
  if counts.sum() >= np.iinfo(np.int32).max:
    raise ValueError(f'{counts.sum()} examples{where}: a store holds fewer than 2**31')
  check_integer_labels(y, f'split {split!r}' if split else 'the labels')
  codes, palette = encode_inputs(x, rows)
  offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
  return ClientStore(codes, y.astype(np.int32), offsets, counts.astype(np.int32), palette,
                     max(1, int(counts.max())))


def from_parts(x: np.ndarray, y: np.ndarray, parts: Sequence[np.ndarray],
               split: str = '') -> ClientStore:
  """A store of the clients ``parts`` (K index arrays into x [M, ...], y [M]) without
  a per-client or float copy: memory follows Σ|part| in the store's dtype."""
  rows = np.concatenate([np.asarray(p, np.int64) for p in parts] or [np.zeros(0, np.int64)])
  return from_arrays(x, y, [len(p) for p in parts], split, rows)


def from_clients(xs: Sequence[np.ndarray], ys: Sequence[np.ndarray],
                 example_shape: Optional[tuple] = None, split: str = '') -> ClientStore:
  """A store of K per-client arrays (``stack_clients``' arguments, without padding)."""
  if len(xs) != len(ys):
    raise ValueError(f'got {len(xs)} input arrays but {len(ys)} label arrays')
  if not xs:
    raise ValueError('a store needs at least one client')
  shapes = [np.asarray(x).shape[1:] for x in xs if len(x)]
  if example_shape is None:
    if not shapes:
      raise ValueError(f'all {len(xs)} clients are empty: pass example_shape to store them')
    example_shape = shapes[0]
  for k, (x, y) in enumerate(zip(xs, ys)):
    if len(x) != len(y):
      raise ValueError(f'client {k}: {len(x)} inputs but {len(y)} labels')
    if len(x) and tuple(np.asarray(x).shape[1:]) != tuple(example_shape):
      raise ValueError(f'client {k}: examples of shape {tuple(np.asarray(x).shape[1:])}, '
                       f'the others {tuple(example_shape)}')
  x = np.concatenate([np.asarray(x, np.float32).reshape((-1,) + tuple(example_shape))
                      for x in xs])
  return from_arrays(x, np.concatenate([np.asarray(y).reshape(-1) for y in ys]),
                     [len(y) for y in ys], split)


def compact(data: FederatedData, split: str = '') -> ClientStore:
  """The store of a padded ``data``: each client's real examples, in order."""
  mask = np.asarray(data.mask)
  return from_arrays(np.asarray(data.x)[mask], np.asarray(data.y)[mask],
                     np.asarray(data.num_examples), split)


def padded(split) -> FederatedData:
  """``split`` as a padded FederatedData (a ClientStore is padded to its largest client)."""
  return split.padded() if isinstance(split, ClientStore) else split


def is_store(tree) -> bool:
  return isinstance(tree, ClientStore)


def layout_key(split) -> tuple:
  """The shapes a program compiled for ``split`` depends on (``ClientStore.layout_key``;
  a FederatedData's x shape)."""
  return split.layout_key() if is_store(split) else tuple(split.x.shape)


def pad_examples(split, num_examples: int):
  """``split`` with N = ``num_examples`` (``federated.pad_examples``; a store's
  ``max_examples``), a ValueError when a client holds more."""
  if not is_store(split):
    return federated_pad_examples(split, num_examples)
  largest = int(np.max(split.num_examples, initial=0))
  if largest > num_examples:
    raise ValueError(f'a client holds {largest} examples, more than {num_examples}')
  return split.replace(max_examples=int(num_examples))


def stack_stores(stores: Sequence[ClientStore]) -> ClientStore:
  """Stores of several runs (seeds) stacked on a leading axis: stored rows padded to
  the longest (``with_rows``); their N must agree (``data.pad_to``)."""
  sizes = {s.max_examples for s in stores}
  if len(sizes) > 1:
    raise ValueError(f'stores of largest clients {sorted(sizes)} cannot share a program: '
                     'set config.data.pad_to to a bound on every client of every seed')
  rows = max(len(s.y) for s in stores)
  return jax.tree.map(lambda *leaves: np.stack(leaves), *[s.with_rows(rows) for s in stores])


def split_statistics(split, num_classes: int) -> dict:
  """``federated.partition_statistics`` of either layout."""
  if not is_store(split):
    return partition_statistics(split, num_classes)
  counts = np.asarray(split.num_examples)
  owner = np.repeat(np.arange(len(counts)), counts)
  pairs = np.unique(owner * num_classes + np.asarray(split.y)[:len(owner)])
  classes = np.bincount(pairs // num_classes, minlength=len(counts))
  return client_statistics(counts, classes, num_classes)


# Clients padded at once by ``padded_chunks``: about this many bytes of floats.
CHUNK_BYTES = 64 * 2 ** 20


def padded_chunks(split):
  """``split``'s clients as consecutive padded FederatedData chunks of about
  ``CHUNK_BYTES`` (a FederatedData: itself, whole)."""
  if not is_store(split):
    yield split
    return
  per_client = split.max_examples * int(np.prod(split.example_shape)) * 4
  width = max(1, CHUNK_BYTES // max(per_client, 1))
  for start in range(0, split.num_clients, width):
    yield split.take(np.arange(start, min(start + width, split.num_clients)))


def validate_store(store: ClientStore, num_classes: Optional[int], split: str = '',
                   padded_rows: bool = False) -> None:
  """Raises ValueError naming the split (and client) on a malformed store: offsets that
  do not start at 0, decrease or disagree with ``num_examples`` or the stored rows,
  codes past the palette, inputs that are not finite, labels outside [0, num_classes)
  (not checked when ``num_classes`` is None). ``padded_rows``: rows past the last
  client's are padding, unchecked (a host cohort, ``round.cohort_store``)."""
  where = f' in split {split!r}' if split else ''
  offsets, counts = np.asarray(store.offsets, np.int64), np.asarray(store.num_examples)
  if offsets.shape != (counts.shape[0] + 1,) or offsets[0] != 0:
    raise ValueError(f'offsets{where} must be [K+1] from 0, got shape {offsets.shape} '
                     f'starting at {offsets[:1].tolist()}')
  steps = np.diff(offsets)
  bad = np.nonzero(steps != counts)[0]
  if bad.size:
    raise ValueError(f'client {bad[0]}{where}: offsets give {steps[bad[0]]} examples, '
                     f'num_examples {counts[bad[0]]}')
  stored = int(offsets[-1])
  if (stored > len(store.y) or (stored != len(store.y) and not padded_rows)
      or len(store.x) != len(store.y)):
    raise ValueError(f'the offsets{where} end at {stored} but the store holds '
                     f'{len(store.x)} inputs and {len(store.y)} labels')
  x = store.x
  client_of = lambda row: int(np.searchsorted(offsets, row, side='right') - 1)
  per_row = max(int(np.prod(x.shape[1:])) * x.dtype.itemsize, 1)
  width = max(1, CHUNK_BYTES // per_row)
  palette = None if store.palette is None else np.asarray(store.palette)
  finite_code = None if palette is None else np.isfinite(palette)
  for start in range(0, stored, width):   # a chunk at a time: x may be a mapped file
    rows = np.asarray(x[start:min(start + width, stored)])
    if palette is not None:
      if rows.size and int(rows.max()) >= len(palette):
        raise ValueError(f'code {int(rows.max())}{where} is past the palette of '
                         f'{len(palette)} values')
      finite = finite_code[rows]
    else:
      finite = np.isfinite(rows)
    finite = finite.reshape(len(rows), -1).all(1)
    if not finite.all():
      raise ValueError(f'client {client_of(start + int(np.argmin(finite)))}{where}: inputs '
                       'contain NaN or inf')
  if num_classes is None:
    return
  y = np.asarray(store.y[:stored])
  outside = (y < 0) | (y >= num_classes)
  if outside.any():
    row = int(np.argmax(outside))
    raise ValueError(f'client {client_of(row)}{where}: label {y[row]} outside '
                     f'[0, {num_classes})')


def validate_split(split, num_classes: Optional[int], name: str = '',
                   padded_rows: bool = False) -> None:
  """``validate_store`` of a ClientStore, ``federated.validate`` of a FederatedData
  (labels unchecked where ``num_classes`` is None); ValueError naming split and client."""
  if is_store(split):
    validate_store(split, num_classes, name, padded_rows)
  else:
    federated_validate(split, num_classes, name)


class FirstUseCheck:
  """``validate_split`` of each data object a compiled entry point is called with, the
  first time it is seen (a jitted program cannot raise on its values: labels outside
  [0, C) would train as other classes, NaN inputs as NaN). Objects are told apart by
  their arrays' identity, held weakly; an array changed in place after its first use
  is not checked again.

  ``num_classes``: C, or a function of the call's arguments giving it (computed only
  for data not seen yet), or None (shapes and finiteness only). ``what`` begins the
  error: the data's role ('the data of the round'); ``padded_rows``: a store's rows past
  its last client's are padding (``validate_store``).
  """

  def __init__(self, num_classes, what: str, padded_rows: bool = False):
    self._num_classes = num_classes
    self._what = what
    self._padded_rows = padded_rows
    self._seen = {}

  def __call__(self, data, *args) -> None:
    if (not isinstance(data, (ClientStore, FederatedData))
        or any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(data))):
      return   # inside a transformation (a vmapped grid): the values are not known here
    key = (id(data.x), id(data.y))
    if key in self._seen:
      return
    num_classes = (self._num_classes(data, *args) if callable(self._num_classes)
                   else self._num_classes)
    try:
      validate_split(data, num_classes, padded_rows=self._padded_rows)
    except ValueError as err:
      raise ValueError(f'{self._what}: {err}') from None
    forget = lambda _, key=key: self._seen.pop(key, None)
    self._seen[key] = (weakref.ref(data.x, forget), weakref.ref(data.y, forget))


# A store saved to a directory (``save``): one .npy file an array, and this file with
# the store's shapes and each file's size, so that ``open_saved`` refuses a cut or
# changed file before anything trains.
SAVED_INDEX = 'store.json'
SAVED_ARRAYS = ('x', 'y', 'offsets', 'num_examples', 'palette')


def save(store: ClientStore, directory: str) -> None:
  """Writes ``store`` to ``directory`` (created): x.npy, y.npy, offsets.npy,
  num_examples.npy, palette.npy (codes' values; absent for float32 inputs) and
  ``SAVED_INDEX``, last, so that a directory without it is an unfinished save."""
  os.makedirs(directory, exist_ok=True)
  sizes = {}
  for name in SAVED_ARRAYS:
    array = getattr(store, name)
    if array is None:
      continue
    path = os.path.join(directory, f'{name}.npy')
    np.save(path, np.asarray(array))
    sizes[name] = os.path.getsize(path)
  index = {'max_examples': store.max_examples, 'num_clients': store.num_clients,
           'rows': int(len(store.y)), 'x_shape': list(store.x.shape),
           'x_dtype': np.dtype(store.x.dtype).str, 'file_bytes': sizes}
  with open(os.path.join(directory, SAVED_INDEX + '.tmp'), 'w') as f:
    json.dump(index, f, indent=1)
  os.replace(os.path.join(directory, SAVED_INDEX + '.tmp'), os.path.join(directory, SAVED_INDEX))


def open_saved(directory: str, split: str = '') -> ClientStore:
  """The store ``save`` wrote to ``directory``, its examples memory-mapped (read from
  the file as the rounds gather them: a population larger than RAM trains from disk).
  A missing index, a file of another size than saved (cut short or rewritten) or
  arrays of other shapes than saved raise ValueError naming the split and the file."""
  where = f'split {split!r}: ' if split else ''
  index_path = os.path.join(directory, SAVED_INDEX)
  if not os.path.exists(index_path):
    raise ValueError(f'{where}{directory} holds no saved store ({SAVED_INDEX} is missing: '
                     'never saved, or its save did not finish); save it again')
  with open(index_path) as f:
    index = json.load(f)
  arrays = {}
  for name in SAVED_ARRAYS:
    path = os.path.join(directory, f'{name}.npy')
    if name not in index['file_bytes']:
      arrays[name] = None
      continue
    size = os.path.getsize(path) if os.path.exists(path) else None
    if size != index['file_bytes'][name]:
      raise ValueError(f'{where}{path} has {size} bytes, {index["file_bytes"][name]} when '
                       'saved: the file was cut short or changed; save the store again')
    arrays[name] = np.load(path, mmap_mode='r' if name == 'x' else None)
  saved = ClientStore(arrays['x'], arrays['y'], arrays['offsets'], arrays['num_examples'],
                      arrays['palette'], int(index['max_examples']))
  if (list(saved.x.shape) != index['x_shape'] or saved.num_clients != index['num_clients']
      or len(saved.y) != index['rows']):
    raise ValueError(f'{where}{directory}: arrays of shapes x {list(saved.x.shape)}, '
                     f'{saved.num_clients} clients, {len(saved.y)} labels, but '
                     f'{index["x_shape"]}, {index["num_clients"]}, {index["rows"]} when saved')
  return saved


def mapped_file(store: ClientStore) -> Optional[str]:
  """The file ``store.x`` is memory-mapped from, or None when it is in memory."""
  return getattr(store.x, 'filename', None) if isinstance(store.x, np.memmap) else None
