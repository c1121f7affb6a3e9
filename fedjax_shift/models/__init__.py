"""Models: Flax classifiers split into encoder / head, and a functional apply.

``apply(module, variables, x, mode)`` is the one way the library runs a model:

  mode='train'       batch statistics, running statistics updated and returned
  mode='eval'        running statistics
  mode='batch_stats' batch statistics, running statistics left unchanged
                     (BN-Adapt / Tent style)

It returns ``(logits [B, C], variables)``, the variables carrying updated
``batch_stats`` in train mode. Models without BatchNorm ignore the mode.
"""
from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
from flax import traverse_util

from fedjax_shift.models.classifiers import (BN_MOMENTUM, CONV_IMPLS, AdaptationMLP,  # noqa: F401
                                             ATPCNNEncoder, BNMLPEncoder,
                                             Classifier,
                                             EvolveCNNEncoder, LeNetEncoder, MLPEncoder,
                                             ResNet18Encoder,
                                             WideResNetEncoder)
from fedjax_shift.models.vit import ViTClassifier, ViTEncoder
from fedjax_shift.registry import Registry

Variables = Any
MODES = ('train', 'eval', 'batch_stats')
MODELS: Registry = Registry('model')


@MODELS.register('mlp')
def mlp(num_classes: int, hidden=(200, 200), head_hidden=()) -> nn.Module:
  return Classifier(MLPEncoder(tuple(hidden)), num_classes, tuple(head_hidden))


@MODELS.register('bn_mlp')
def bn_mlp(num_classes: int, hidden=(200, 200)) -> nn.Module:
  return Classifier(BNMLPEncoder(tuple(hidden)), num_classes)


@MODELS.register('atp_cnn')
def atp_cnn(num_classes: int, conv: str = 'lax') -> nn.Module:
  return Classifier(ATPCNNEncoder(conv=conv), num_classes)


@MODELS.register('evolve_cnn')
def evolve_cnn(num_classes: int, pool: str = 'flatten', conv: str = 'lax') -> nn.Module:
  return Classifier(EvolveCNNEncoder(pool=pool, conv=conv), num_classes)


@MODELS.register('domainbed_cnn')
def domainbed_cnn(num_classes: int, conv: str = 'lax', hidden: int = 0) -> nn.Module:
  """DomainBed's MNIST CNN trunk (FedEvolve's Table 7 network), a linear head on its
  128 pooled features; ``hidden`` > 0 puts a bias-free Linear 128→hidden + ReLU before
  the head (App. D's "two linear layers", hidden 64: Table 7's 379,392 for FedEvp and
  the baselines is the trunk + 128·64 + 64·10, both layers without bias)."""
  return Classifier(EvolveCNNEncoder(widths=(64, 128, 128, 128), strides=(1, 2, 1, 1),
                                     features=hidden, feature_bias=False, pool='mean',
                                     conv=conv), num_classes)


@MODELS.register('lenet5')
def lenet5(num_classes: int, channels=(16, 32), features: int = 512,
           conv: str = 'lax') -> nn.Module:
  return Classifier(LeNetEncoder(tuple(channels), features, conv), num_classes)


@MODELS.register('resnet18')
def resnet18(num_classes: int, conv: str = 'lax', stem: str = 'cifar') -> nn.Module:
  """``stem='imagenet'``: torchvision's layout, loadable from its ImageNet weights
  (models/torchvision_resnet.py)."""
  return Classifier(ResNet18Encoder(conv=conv, stem=stem), num_classes)


@MODELS.register('wide_resnet')
def wide_resnet(num_classes: int, depth: int = 16, widen: int = 4, conv: str = 'lax'
                ) -> nn.Module:
  return Classifier(WideResNetEncoder(depth, widen, conv=conv), num_classes)


@MODELS.register('vit')
def vit_model(num_classes: int, patch_size: int = 4, width: int = 64, depth: int = 4, heads: int = 4,
        mlp_dim: int = 128) -> nn.Module:
  """A ViT with SSF points (models/vit.py). Defaults: a CPU-sized ViT for 28×28 digits
  (7×7 patches of 4); ViT-B/16 is patch_size 16, width 768, depth 12, heads 12,
  mlp_dim 3072 (configs/fedins.py:vit_b16)."""
  return ViTClassifier(ViTEncoder(patch_size, width, depth, heads, mlp_dim), num_classes)


def conv_impl(choice: str) -> str:
  """``config.model.conv``: 'lax' | 'patches' | 'lax_patch_grad' | 'auto'.
  auto: 'patches' on GPU/TPU, where a vmapped lax convolution becomes a slow grouped
  convolution; 'lax_patch_grad' on CPU, where XLA's kernel-gradient convolution runs
  6–14× slower inside the rolled ``lax.scan`` of local steps (BENCHMARKS.md)."""
  if choice == 'auto':
    return 'lax_patch_grad' if jax.default_backend() == 'cpu' else 'patches'
  if choice not in CONV_IMPLS:
    raise ValueError(f'config.model.conv: unknown {choice!r}; choose from '
                     f'{list(CONV_IMPLS) + ["auto"]}')
  return choice


def is_convolutional(name: str) -> bool:
  """Whether the registered model ``name`` has convolutions (its builder takes ``conv``)."""
  return 'conv' in inspect.signature(MODELS.get(name, 'model.name')).parameters


def create(model_config: ml_collections.ConfigDict, num_classes: int) -> nn.Module:
  """Builds the model named by ``model_config.name`` with its extra fields (keyword
  arguments of its builder); ``conv`` ('auto' if absent) picks how convolutional
  models compute their convolutions and is ignored by models without any."""
  kwargs = {k: v for k, v in model_config.items() if k not in ('name', 'conv')}
  builder = MODELS.get(model_config.name, 'model.name')
  conv = conv_impl(model_config.conv if 'conv' in model_config else 'auto')
  if 'conv' in inspect.signature(builder).parameters:
    kwargs['conv'] = conv
  elif 'conv' in model_config and model_config.conv != 'auto':
    raise ValueError(f'config.model.conv={model_config.conv!r}: model {model_config.name!r} '
                     f'has no convolutions (leave it at auto)')
  return builder(num_classes, **kwargs)


def init(module: nn.Module, rng: jax.Array, example_x: jax.Array) -> Variables:
  """Variables {'params', ['batch_stats']} for inputs shaped like ``example_x`` [B, ...]."""
  return module.init(rng, example_x, train=False)


def apply(module: nn.Module, variables: Variables, x: jax.Array,
          mode: str = 'eval') -> Tuple[jax.Array, Variables]:
  """Runs the model; see the module docstring for ``mode``. x: [B, ...] -> [B, C]."""
  if mode == 'eval':
    return module.apply(variables, x, train=False), variables
  if mode not in MODES:
    raise ValueError(f'unknown model mode {mode!r}; choose from {MODES}')
  if 'batch_stats' not in variables:
    return module.apply(variables, x, train=True), variables
  logits, updates = module.apply(variables, x, train=True, mutable=['batch_stats'])
  if mode == 'batch_stats':
    return logits, variables
  return logits, {**variables, 'batch_stats': updates['batch_stats']}


def is_batch_norm_path(path) -> bool:
  """True for a flattened variable path inside a BatchNorm layer (flax names them
  BatchNorm_<i>): its scale/bias in 'params' or its statistics in 'batch_stats'."""
  return any('BatchNorm' in str(part) for part in path)


def has_batch_norm(variables: Variables) -> bool:
  return bool(jax.tree_util.tree_leaves(variables.get('batch_stats', {})))


def num_parameters(tree) -> int:
  return int(sum(leaf.size for leaf in jax.tree_util.tree_leaves(tree)))


def batch_statistics(module: nn.Module, variables: Variables, x: jax.Array) -> Variables:
  """Per-layer batch statistics {'mean', 'var'} of ``x`` [B, ...] (same tree as
  ``variables['batch_stats']``), each layer normalising its input with the batch
  statistics computed so far (train-mode forward). Variance is biased (1/B), as
  flax normalises with it.

  Read off one train-mode update from zeroed running statistics:
  running' = m·0 + (1 − m)·batch, so batch = running' / (1 − m).
  """
  zeroed = {**variables, 'batch_stats': jax.tree.map(jnp.zeros_like, variables['batch_stats'])}
  _, updates = module.apply(zeroed, x, train=True, mutable=['batch_stats'])
  return jax.tree.map(lambda s: s / (1.0 - BN_MOMENTUM), updates['batch_stats'])


def eval_with_batch_statistics(module: nn.Module, variables: Variables, x: jax.Array
                               ) -> Tuple[jax.Array, Variables]:
  """One eval-mode forward (every BatchNorm normalises with its running statistics)
  that also records each BatchNorm input's batch statistics.

  Returns (logits [B, C], stats) with ``stats`` shaped like
  ``variables['batch_stats']``: per layer {'mean', 'var'} over the batch (and the
  spatial positions for convolutions), variance unbiased (1/(n−1)) as PyTorch's
  running-variance update uses it. This is ATP's h for BN statistics (the ATP authors' code:
  "all from one forward pass that uses the source statistics"); it differs from
  ``batch_statistics``, whose layers normalise with batch statistics.
  """
  captured = {}

  def record(next_fun, args, kwargs, context):
    if isinstance(context.module, nn.BatchNorm) and context.method_name == '__call__':
      inputs = args[0]
      axes = tuple(range(inputs.ndim - 1))
      count = math.prod(inputs.shape[:-1])
      mean = jnp.mean(inputs, axes)
      var = jnp.var(inputs, axes) * (count / max(count - 1, 1))
      node = captured
      for part in context.module.path:
        node = node.setdefault(part, {})
      node.update(mean=mean, var=var)
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):
    logits = module.apply(variables, x, train=False)
  return logits, captured


def eval_with_mixed_statistics(module: nn.Module, variables: Variables, x: jax.Array,
                               prior, unbiased: bool = True) -> jax.Array:
  """Logits [B, C] of one forward pass in which every BatchNorm normalises its input
  with p·(running statistics) + (1 − p)·(that input's batch statistics), layer by layer,
  so a deeper layer's batch statistics are those of an input normalised upstream with
  mixed statistics (the ATP authors' ``ModifiedBatchNorm2d``, after Schneider et al.).
  ``unbiased``: the batch variance over n = B·(spatial positions) values divided by
  n − 1, as PyTorch's statistics update computes it. ``prior`` p may be traced."""

  def mixed(next_fun, args, kwargs, context):
    layer = context.module
    if not (isinstance(layer, nn.BatchNorm) and context.method_name == '__call__'):
      return next_fun(*args, **kwargs)
    inputs = args[0]
    axes = tuple(range(inputs.ndim - 1))
    count = math.prod(inputs.shape[:-1])
    var = jnp.var(inputs, axes) * (count / max(count - 1, 1) if unbiased else 1.0)
    mean = prior * layer.get_variable('batch_stats', 'mean') + (1 - prior) * jnp.mean(inputs, axes)
    var = prior * layer.get_variable('batch_stats', 'var') + (1 - prior) * var
    out = (inputs - mean) * jax.lax.rsqrt(var + layer.epsilon)
    if layer.use_scale:
      out = out * layer.get_variable('params', 'scale')
    if layer.use_bias:
      out = out + layer.get_variable('params', 'bias')
    return out

  with nn.intercept_methods(mixed):
    return module.apply(variables, x, train=False)


def features(module: nn.Module, variables: Variables, x: jax.Array,
             mode: str = 'eval') -> jax.Array:
  """Encoder output [B, F] of x [B, ...] in mode 'eval' or 'batch_stats' (no
  running statistics change)."""
  if mode == 'eval':
    return module.apply(variables, x, train=False, method='features')
  if mode != 'batch_stats':
    raise ValueError(f"features mode must be 'eval' or 'batch_stats', got {mode!r}")
  if 'batch_stats' not in variables:
    return module.apply(variables, x, train=True, method='features')
  return module.apply(variables, x, train=True, method='features', mutable=['batch_stats'])[0]


def train_features(module: nn.Module, variables: Variables, x: jax.Array
                   ) -> Tuple[jax.Array, Variables]:
  """Encoder output [B, F] in train mode and the variables with updated running
  statistics (as ``apply(..., 'train')`` for the whole model)."""
  if 'batch_stats' not in variables:
    return module.apply(variables, x, train=True, method='features'), variables
  features, updates = module.apply(variables, x, train=True, method='features',
                                   mutable=['batch_stats'])
  return features, {**variables, 'batch_stats': updates['batch_stats']}


def head_hidden(variables: Variables, features: jax.Array) -> jax.Array:
  """The input [B, H] of the head's final linear layer: features [B, F] through the
  head's hidden layers, those its parameters hold ('hidden_0', …; none: the features)."""
  params = variables['params']['head']
  index = 0
  while f'hidden_{index}' in params:
    layer = params[f'hidden_{index}']
    features = jax.nn.relu(features @ layer['kernel'] + layer['bias'])
    index += 1
  return features


def linear_head(variables: Variables, penultimate: jax.Array) -> jax.Array:
  """The head's final linear layer: logits [B, C] of its input [B, H]."""
  params = variables['params']['head']
  return penultimate @ params['kernel'] + params['bias']


def head(variables: Variables, features: jax.Array) -> jax.Array:
  """The head's logits [B, C] of features [B, F] (``Classifier.head``: its hidden
  layers, if any, then the linear layer)."""
  return linear_head(variables, head_hidden(variables, features))


def feature_dim(variables: Variables) -> int:
  """F, the width of the features the head takes."""
  params = variables['params']['head']
  return (params['hidden_0'] if 'hidden_0' in params else params)['kernel'].shape[0]


@functools.lru_cache(maxsize=64)
def layer_order(module: nn.Module, input_shape: Tuple[int, ...]) -> Tuple[str, ...]:
  """The layers of ``module`` that hold parameters, as '/'-joined paths
  ('encoder/Conv_0', …, 'head'), in the order its forward pass on inputs of
  ``input_shape`` (one example's shape) first uses them, i.e. the order the model
  defines them in — never dict order (JAX sorts dict keys, so after any tree map
  'Dense_0' sorts after 'Conv_3' and 'BatchNorm_0' before both). A module that holds
  parameters of its own besides children (a ViT's class token and position embedding)
  comes right after its first child. Read once per (module, shape) from an abstract
  evaluation: nothing is computed."""
  x = jax.ShapeDtypeStruct((1, *input_shape), jnp.float32)
  variables = jax.eval_shape(lambda x: init(module, jax.random.key(0), x), x)
  owners = {tuple(path[:-1]) for path in traverse_util.flatten_dict(variables['params'])}
  calls = []

  def record(next_fun, args, kwargs, context):
    scope = context.module.scope
    if scope is not None and tuple(scope.path) not in calls:
      calls.append(tuple(scope.path))
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):
    jax.eval_shape(lambda v, x: apply(module, v, x, 'eval'), variables, x)
  order = []
  for path in calls:
    if path in owners and path not in order:
      order.append(path)
  # A parent that owns parameters goes right after its first child.
  for parent in [p for p in order if any(q[:len(p)] == p and q != p for q in order)]:
    order.remove(parent)
    child = next(i for i, q in enumerate(order) if q[:len(parent)] == parent)
    order.insert(child + 1, parent)
  missing = owners - set(order)
  if missing:
    raise ValueError(f'layer_order: the forward pass never used {sorted(missing)}')
  return tuple('/'.join(path) for path in order)


def prefix_selector(block: str) -> Callable[[Tuple[str, ...]], bool]:
  """A predicate on flat parameter paths: those under the '/'-joined prefix ``block``."""
  prefix = tuple(block.split('/'))
  return lambda path: tuple(path[:len(prefix)]) == prefix


def layer_selector(module: nn.Module, input_shape: Tuple[int, ...], block, field: str
                   ) -> Callable[[Tuple[str, ...]], bool]:
  """A predicate on flat parameter paths selecting what ``block`` names: 'first' /
  'last' (the encoder's first or last layer in ``layer_order``) or an int k (the k-th
  layer of the whole model from 0, negative from the end) select that layer's own
  parameters; a path prefix ('encoder/Dense_0', 'head') selects everything under it.
  Raises ValueError naming ``field`` and the model's layers when it names none."""
  layers = layer_order(module, tuple(input_shape))
  encoder = [layer for layer in layers if layer.split('/')[0] == 'encoder']
  layer = None
  if block in ('first', 'last') and encoder:
    layer = encoder[0 if block == 'first' else -1]
  elif isinstance(block, int) and not isinstance(block, bool) and -len(layers) <= block < len(layers):
    layer = layers[block]
  if layer is not None:
    own = tuple(layer.split('/'))
    return lambda path: tuple(path[:-1]) == own
  if isinstance(block, str) and block and any(name == block or name.startswith(block + '/')
                                              for name in layers):
    return prefix_selector(block)
  raise ValueError(f'{field}: {block!r} names no layer of this model; its layers, in '
                   f'order: {list(layers)} (or first, last, or an index)')
