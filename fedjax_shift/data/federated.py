"""Stacked, padded federated data: the layout every engine call consumes.

    FederatedData(x: [K, N, ...], y: [K, N], mask: [K, N] bool, num_examples: [K])

K clients, each padded to N examples. Padding rows are zeros, ``mask`` is False
there, and every loss and metric in the library ignores them. A client with zero
examples has ``num_examples == 0`` and gets weight 0 in every average.
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Sequence

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

  def take(self, client_ids) -> 'FederatedData':
    """Gathers a subset of clients (host-side, numpy)."""
    client_ids = np.asarray(client_ids)
    return FederatedData(*(np.asarray(a)[client_ids] for a in self))


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
  num_pad = int(pad_to if pad_to is not None else max(1, counts.max()))
  if counts.max() > num_pad:
    raise ValueError(f'pad_to={num_pad} is smaller than the largest client '
                     f'({counts.max()} examples)')
  if example_shape is None:
    example_shape = next(np.asarray(x).shape[1:] for x in xs if len(x))
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


def validate(data: FederatedData, num_classes: int, split: str = '') -> None:
  """Raises ValueError naming the client on malformed data.

  Checks shapes, mask/num_examples consistency, finiteness of inputs and labels in
  [0, num_classes) for every real (unmasked) example.
  """
  where = f' in split {split!r}' if split else ''
  num_clients, num_pad = data.y.shape
  if data.x.shape[:2] != (num_clients, num_pad) or data.mask.shape != (num_clients, num_pad):
    raise ValueError(f'inconsistent shapes{where}: x {data.x.shape}, y {data.y.shape}, '
                     f'mask {data.mask.shape}')
  counts = data.mask.sum(1)
  bad = np.nonzero(counts != data.num_examples)[0]
  if bad.size:
    raise ValueError(f'client {bad[0]}{where}: num_examples={data.num_examples[bad[0]]} '
                     f'but mask has {counts[bad[0]]} real examples')
  finite = np.isfinite(data.x.reshape(num_clients, num_pad, -1)).all(-1)
  bad = np.nonzero((~finite & data.mask).any(1))[0]
  if bad.size:
    raise ValueError(f'client {bad[0]}{where}: inputs contain NaN or inf')
  out_of_range = ((data.y < 0) | (data.y >= num_classes)) & data.mask
  bad = np.nonzero(out_of_range.any(1))[0]
  if bad.size:
    label = data.y[bad[0]][out_of_range[bad[0]]][0]
    raise ValueError(f'client {bad[0]}{where}: label {label} outside [0, {num_classes})')


def split_clients(xs: Sequence[np.ndarray], ys: Sequence[np.ndarray],
                  fractions: Dict[str, float], rng: np.random.Generator
                  ) -> Dict[str, tuple]:
  """Splits each client's examples into named splits by fraction.

  Every example goes to exactly one split; the last split takes the remainder.
  Returns {split: (list of x arrays, list of y arrays)}.
  """
  names = list(fractions)
  total = sum(fractions.values())
  if not np.isclose(total, 1.0):
    raise ValueError(f'split fractions must sum to 1, got {fractions}')
  out = {name: ([], []) for name in names}
  for x, y in zip(xs, ys):
    order = rng.permutation(len(y))
    bounds = np.floor(np.cumsum([fractions[n] for n in names]) * len(y)).astype(int)
    bounds[-1] = len(y)
    start = 0
    for name, stop in zip(names, bounds):
      idx = order[start:stop]
      out[name][0].append(x[idx])
      out[name][1].append(y[idx])
      start = stop
  return out


def partition_statistics(data: FederatedData, num_classes: int) -> dict:
  """Clients, examples per client and classes per client of one split."""
  counts = data.num_examples
  classes = np.array([len(np.unique(data.y[k][data.mask[k]])) for k in range(data.num_clients)])
  return dict(
      clients=int(data.num_clients),
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
