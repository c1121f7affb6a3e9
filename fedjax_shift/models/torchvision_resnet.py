"""torchvision's ResNet-18 weights (e.g. its ImageNet ``IMAGENET1K_V1``) in our
ResNet-18 with ``stem='imagenet'`` (ATP's Table 1 model: Bao et al., NeurIPS 2023,
start from an ImageNet-pretrained ResNet-18).

No weights can be downloaded by the library; a user converts torchvision's state dict
once, on a machine with torch, to a ``.npz`` of its own names::

    python -c "import numpy as np, torchvision; np.savez('resnet18_imagenet.npz', **{k: v.numpy() for k, v in torchvision.models.resnet18(weights='IMAGENET1K_V1').state_dict().items()})"

and points ``config.backbone.weights`` at it. Names map as torchvision's ``conv1`` /
``bn1`` → ``Conv_0`` / ``BatchNorm_0``, ``layer{s}.{b}`` → ``ResidualBlock_{2(s−1)+b}``
with ``conv1, bn1, conv2, bn2, downsample.0, downsample.1`` → ``Conv_0, BatchNorm_0,
Conv_1, BatchNorm_1, Conv_2, BatchNorm_2``; convolution kernels [O, I, kh, kw] →
[kh, kw, I, O]; a BatchNorm's weight / bias → scale / bias (params) and running_mean /
running_var → mean / var (batch_stats). The ``fc`` head and ``num_batches_tracked``
are not read (the classifier's head is new).
"""
from __future__ import annotations

from typing import Dict, Tuple

import jax
import numpy as np
from flax import traverse_util

from fedjax_shift.models.vit import checked_params

BLOCK_LAYERS = {'conv1': 'Conv_0', 'bn1': 'BatchNorm_0', 'conv2': 'Conv_1', 'bn2': 'BatchNorm_1',
                'downsample.0': 'Conv_2', 'downsample.1': 'BatchNorm_2'}
BATCH_NORM_FIELDS = {('params', 'scale'): 'weight', ('params', 'bias'): 'bias',
                     ('batch_stats', 'mean'): 'running_mean',
                     ('batch_stats', 'var'): 'running_var'}


def torch_prefix(module_path: Tuple[str, ...], blocks_per_stage: int = 2) -> str:
  """Our encoder module path, e.g. ('ResidualBlock_3', 'Conv_2') -> 'layer2.1.downsample.0'."""
  if len(module_path) == 1:
    return {'Conv_0': 'conv1', 'BatchNorm_0': 'bn1'}[module_path[0]]
  block = int(module_path[0].split('_')[-1])
  layer = {ours: theirs for theirs, ours in BLOCK_LAYERS.items()}[module_path[1]]
  return f'layer{block // blocks_per_stage + 1}.{block % blocks_per_stage}.{layer}'


def torch_name(collection: str, path: Tuple[str, ...]) -> str:
  """(collection, our flat path under the encoder) -> torchvision's state-dict key."""
  *module_path, leaf = path
  prefix = torch_prefix(tuple(module_path))
  if leaf == 'kernel':
    return f'{prefix}.weight'
  return f'{prefix}.{BATCH_NORM_FIELDS[(collection, leaf)]}'


def from_torch(name: str, value: np.ndarray) -> np.ndarray:
  """A convolution kernel [O, I, kh, kw] as ours [kh, kw, I, O]; others unchanged."""
  return value.transpose(2, 3, 1, 0) if name.endswith('weight') and value.ndim == 4 else value


def load_npz(path: str, encoder, example_x: jax.Array) -> Dict[str, dict]:
  """{'params', 'batch_stats'} of ``encoder`` (a ResNet18Encoder with stem 'imagenet')
  from a ``.npz`` of torchvision's state-dict names; a missing or wrong-shaped array
  is an error naming it."""
  if getattr(encoder, 'stem', None) != 'imagenet':
    raise ValueError(f'{path}: torchvision ResNet-18 weights need config.model.stem = '
                     f'"imagenet" (its 7x7 stem and max-pool)')
  shapes = jax.eval_shape(lambda: encoder.init(jax.random.key(0), example_x))
  with np.load(path) as stored:   # torchvision's layouts converted to ours
    converted = {name: from_torch(name, np.asarray(stored[name])) for name in stored.files}
  return {collection: traverse_util.unflatten_dict(checked_params(
      traverse_util.flatten_dict(shapes[collection]), converted,
      lambda key, collection=collection: torch_name(collection, key), path,
      lambda key: f'torchvision ResNet-18 state dict, converted; needed for '
                  f'encoder/{"/".join(key)}'))
      for collection in ('params', 'batch_stats')}


def save_npz(path: str, variables: Dict[str, dict]) -> None:
  """Our encoder's {'params', 'batch_stats'} as a ``.npz`` of torchvision's names (the
  inverse of ``load_npz``)."""
  arrays = {}
  for collection in ('params', 'batch_stats'):
    for key, value in traverse_util.flatten_dict(variables[collection]).items():
      name = torch_name(collection, key)
      value = np.asarray(value)
      arrays[name] = value.transpose(3, 2, 0, 1) if value.ndim == 4 else value
  np.savez(path, **arrays)
