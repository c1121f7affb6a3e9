"""Stacked, padded federated data: the layout every engine call consumes.

    FederatedData(x: [K, N, ...], y: [K, N], mask: [K, N] bool, num_examples: [K])

K clients, each padded to N examples. Padding rows are zeros, ``mask`` is False
there, and every loss and metric in the library ignores them. A client with zero
examples has ``num_examples == 0`` and gets weight 0 in every average.
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Sequence

import numpy as np


class FederatedData(NamedTuple):
  """One split of a federated dataset, stacked over clients.

  Attributes:
    x: [K, N, ...] float32 inputs, zeros where padded.
    y: [K, N] int32 labels, 0 where padded.
    mask: [K, N] bool, True for real examples.
    num_examples: [K] int32, ``mask.sum(1)``.
  """
  x: np.ndarray
  y: np.ndarray
  mask: np.ndarray
  num_examples: np.ndarray

  @property
  def num_clients(self) -> int:
    return int(self.x.shape[0])

  @property
  def max_examples(self) -> int:
    return int(self.x.shape[1])

  @property
  def example_shape(self) -> tuple:
    return tuple(self.x.shape[2:])

  def first_example(self) -> np.ndarray:
    """x [1, ...]: client 0's first row (what a model is initialised on)."""
    return np.asarray(self.x[0, :1])

  def client(self, k: int) -> tuple:
    """Client ``k``'s real examples (x [n_k, ...], y [n_k]) on the host."""
    mask = np.asarray(self.mask[k])
    return np.asarray(self.x[k])[mask], np.asarray(self.y[k])[mask]

  def take(self, client_ids) -> 'FederatedData':
    """Gathers a subset of clients (host-side, numpy)."""
    client_ids = np.asarray(client_ids)
    return FederatedData(*(np.asarray(a)[client_ids] for a in self))


def pad_examples(data: FederatedData, num_examples: int) -> FederatedData:
  """``data`` with every client padded (or its padding cut) to N = ``num_examples``
  rows; a ValueError when a client's real examples reach past row N."""
  if np.asarray(data.mask)[:, num_examples:].any():
    raise ValueError(f'a client holds {int(np.max(data.num_examples))} examples, more than '
                     f'{num_examples}')
  extra = num_examples - data.max_examples
  if extra <= 0:
    return FederatedData(*(np.asarray(a)[:, :num_examples] for a in data[:3]),
                         np.asarray(data.num_examples))
  pad = lambda a: np.concatenate([a, np.zeros((a.shape[0], extra) + a.shape[2:], a.dtype)], 1)
  return FederatedData(pad(np.asarray(data.x)), pad(np.asarray(data.y)),
                       pad(np.asarray(data.mask)), np.asarray(data.num_examples))


# A federated dataset: split name ('train', 'val', 'test', 'test_corrupted', ...)
# -> FederatedData over the same K clients.
FederatedDataset = Dict[str, FederatedData]


def stack_clients(xs: Sequence[np.ndarray], ys: Sequence[np.ndarray],
                  pad_to: int | None = None,
                  example_shape: tuple | None = None) -> FederatedData:
  """Stacks per-client arrays into a padded FederatedData.

  Args:
    xs: K arrays [n_k, ...] (n_k may be 0).
    ys: K int arrays [n_k].
    pad_to: N; defaults to max n_k (at least 1).
    example_shape: shape of one example, needed when every client is empty.
  """
  if len(xs) != len(ys):
    raise ValueError(f'got {len(xs)} input arrays but {len(ys)} label arrays')
  if not xs:
    raise ValueError('stack_clients needs at least one client')
  counts = np.array([len(y) for y in ys], dtype=np.int32)
  for k, (x, y) in enumerate(zip(xs, ys)):
    if len(x) != len(y):
      raise ValueError(f'client {k}: {len(x)} inputs but {len(y)} labels')
    check_integer_labels(np.asarray(y), f'client {k}')
  num_pad = int(pad_to if pad_to is not None else max(1, counts.max()))
  if counts.max() > num_pad:
    raise ValueError(f'pad_to={num_pad} is smaller than the largest client '
                     f'({counts.max()} examples)')
  if example_shape is None:
    shapes = [np.asarray(x).shape[1:] for x in xs if len(x)]
    if not shapes:
      raise ValueError(f'all {len(xs)} clients are empty: pass example_shape to stack them')
    example_shape = shapes[0]
  for k, x in enumerate(xs):
    if len(x) and tuple(np.asarray(x).shape[1:]) != tuple(example_shape):
      raise ValueError(f'client {k}: examples of shape {tuple(np.asarray(x).shape[1:])}, '
                       f'the others {tuple(example_shape)}')
  x_out = np.zeros((len(xs), num_pad) + tuple(example_shape), np.float32)
  y_out = np.zeros((len(xs), num_pad), np.int32)
  mask = np.zeros((len(xs), num_pad), bool)
  for k, (x, y) in enumerate(zip(xs, ys)):
    n = len(y)
    if n:
      x_out[k, :n] = x
      y_out[k, :n] = y
      mask[k, :n] = True
  return FederatedData(x_out, y_out, mask, counts)


def check_integer_labels(y: np.ndarray, where: str) -> None:
  """Labels must be whole numbers (a float array of 0., 1., … is accepted)."""
  if y.size and not np.issubdtype(y.dtype, np.integer):
    if not np.issubdtype(y.dtype, np.number):
      raise ValueError(f'{where}: labels of dtype {y.dtype}, need integers')
    fractional = ~np.isfinite(y) | (np.floor(y) != y)
    if fractional.any():
      raise ValueError(f'{where}: label {y[fractional][0]} is not an integer class index')


def validate(data: FederatedData, num_classes: Optional[int], split: str = '') -> None:
  """Raises ValueError naming the client on malformed data.

  Checks shapes (x [K, N, ...], y and mask [K, N], num_examples [K]),
  mask/num_examples consistency, finiteness of inputs, and integer labels in
  [0, num_classes) for every real (unmasked) example (any integer when
  ``num_classes`` is None).
  """
  where = f' in split {split!r}' if split else ''
  data = FederatedData(*(np.asarray(array) for array in data))   # jax arrays: to the host
  if np.ndim(data.y) != 2:
    raise ValueError(f'labels{where} must be [clients, examples], got shape {np.shape(data.y)}')
  num_clients, num_pad = data.y.shape
  if data.x.shape[:2] != (num_clients, num_pad) or data.mask.shape != (num_clients, num_pad):
    raise ValueError(f'inconsistent shapes{where}: x {data.x.shape}, y {data.y.shape}, '
                     f'mask {data.mask.shape}')
  if np.shape(data.num_examples) != (num_clients,):
    raise ValueError(f'num_examples{where} has shape {np.shape(data.num_examples)}, '
                     f'need one count per client ({num_clients},)')
  for k in ([] if np.issubdtype(np.asarray(data.y).dtype, np.integer) else range(num_clients)):
    check_integer_labels(np.asarray(data.y[k])[np.asarray(data.mask[k])],
                         f'client {k}{where}')
  counts = data.mask.sum(1)
  bad = np.nonzero(counts != data.num_examples)[0]
  if bad.size:
    raise ValueError(f'client {bad[0]}{where}: num_examples={data.num_examples[bad[0]]} '
                     f'but mask has {counts[bad[0]]} real examples')
  finite = np.isfinite(data.x.reshape(num_clients, num_pad, -1)).all(-1)
  bad = np.nonzero((~finite & data.mask).any(1))[0]
  if bad.size:
    raise ValueError(f'client {bad[0]}{where}: inputs contain NaN or inf')
  if num_classes is None:
    return
  out_of_range = ((data.y < 0) | (data.y >= num_classes)) & data.mask
  bad = np.nonzero(out_of_range.any(1))[0]
  if bad.size:
    label = data.y[bad[0]][out_of_range[bad[0]]][0]
    raise ValueError(f'client {bad[0]}{where}: label {label} outside [0, {num_classes})')


def split_clients(xs: Sequence[np.ndarray], ys: Sequence[np.ndarray],
                  fractions: Dict[str, float], rng: np.random.Generator
                  ) -> Dict[str, tuple]:
  """Splits each client's examples into named splits by fraction (``split_positions``).

  Returns {split: (list of x arrays, list of y arrays)}.
  """
  positions = split_positions([len(y) for y in ys], fractions, rng)
  return {name: ([x[p] for x, p in zip(xs, chosen)], [y[p] for y, p in zip(ys, chosen)])
          for name, chosen in positions.items()}


def split_positions(sizes: Sequence[int], fractions: Dict[str, float],
                    rng: np.random.Generator) -> Dict[str, list]:
  """{split: K position arrays}: each client's ``sizes[k]`` examples dealt to the named
  splits by fraction, in a random order drawn per client from ``rng``. Every example
  goes to exactly one split; the last split takes the remainder."""
  names = list(fractions)
  total = sum(fractions.values())
  if not np.isclose(total, 1.0):
    raise ValueError(f'split fractions must sum to 1, got {fractions}')
  out = {name: [] for name in names}
  cumulative = np.cumsum([fractions[n] for n in names])
  for size in sizes:
    order = rng.permutation(size)
    bounds = np.floor(cumulative * size).astype(int)
    bounds[-1] = size
    start = 0
    for name, stop in zip(names, bounds):
      out[name].append(order[start:stop])
      start = stop
  return out


def partition_statistics(data: FederatedData, num_classes: int) -> dict:
  """Clients, examples per client and classes per client of one split."""
  classes = np.array([len(np.unique(data.y[k][data.mask[k]])) for k in range(data.num_clients)])
  return client_statistics(np.asarray(data.num_examples), classes, num_classes)


def client_statistics(counts: np.ndarray, classes: np.ndarray, num_classes: int) -> dict:
  """``partition_statistics`` from each client's examples [K] and classes [K]."""
  return dict(
      clients=int(len(counts)),
      examples=int(counts.sum()),
      examples_per_client_min=int(counts.min()),
      examples_per_client_mean=float(counts.mean()),
      examples_per_client_max=int(counts.max()),
      empty_clients=int((counts == 0).sum()),
      classes_per_client_mean=float(classes.mean()),
      classes_per_client_min=int(classes.min()),
      classes_per_client_max=int(classes.max()),
      num_classes=int(num_classes),
  )
