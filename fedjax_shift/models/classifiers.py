"""Flax classifiers. Every classifier is ``head(encoder(x))`` with two submodules
named ``encoder`` and ``head``, so methods can split parameters by top-level key
(FedRep, FedICON, T3A, FedEvp, FedIns). ``train`` selects BatchNorm behaviour:
True normalises with batch statistics (and updates running ones when
``batch_stats`` is mutable), False uses running statistics.
"""
from __future__ import annotations

import functools
from typing import Any, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

# Every BatchNorm of the library: running ← 0.9·running + 0.1·batch (PyTorch's 0.1).
BN_MOMENTUM = 0.9


def batch_norm(train: bool) -> nn.Module:
  return nn.BatchNorm(use_running_average=not train, momentum=BN_MOMENTUM, epsilon=1e-5)


# How a convolution is computed (same parameters, same values):
#   'lax'      lax.conv_general_dilated. Vmapped over stacked client models it lowers to
#              a grouped convolution (feature_group_count = clients), slow on GPUs at
#              large cohorts (BENCHMARKS.md: 3.03 s vs a vmapped PyTorch peer's 1.10 s at 1,000).
#   'patches'  the input's patches (shared by construction, exact: strided slices of
#              the padded input) times the kernel as a matrix; vmapped over clients this
#              is a batched matmul.
CONV_IMPLS = ('lax', 'patches', 'lax_patch_grad')
NHWC = ('NHWC', 'HWIO', 'NHWC')


def image_patches(x: jax.Array, kernel_size: Tuple[int, int], strides: Tuple[int, int],
                  padding) -> jax.Array:
  """x [B, H, W, C] -> patches [B, H', W', kh·kw·C], features ordered (kh, kw, C) as a
  HWIO kernel flattens. Strided slices of the zero-padded input, one per kernel offset:
  exact, and its gradient is a pad and a sum. (``lax.conv_general_dilated_patches`` is an
  identity convolution with one group per channel; vmapped over clients on a GPU it runs
  as cuDNN's grouped direct kernel, 59 % of an ATP-CNN round at 240 clients on an H100.)"""
  kh, kw = kernel_size
  if isinstance(padding, str):
    padding = lax.padtype_to_pads(x.shape[1:3], (kh, kw), strides, padding)
  (top, bottom), (left, right) = padding
  x = jnp.pad(x, ((0, 0), (top, bottom), (left, right), (0, 0)))
  batch, height, width, channels = x.shape
  out_h = (height - kh) // strides[0] + 1
  out_w = (width - kw) // strides[1] + 1
  return jnp.concatenate([
      lax.slice(x, (0, i, j, 0),
                (batch, i + (out_h - 1) * strides[0] + 1, j + (out_w - 1) * strides[1] + 1,
                 channels), (1, strides[0], strides[1], 1))
      for i in range(kh) for j in range(kw)], axis=-1)


def patches_conv(x: jax.Array, kernel: jax.Array, strides: Tuple[int, int], padding) -> jax.Array:
  """x [B, H, W, C] ⊛ kernel [kh, kw, C, O] -> [B, H', W', O] as patches @ kernel."""
  kh, kw, cin, cout = kernel.shape
  return image_patches(x, (kh, kw), strides, padding) @ kernel.reshape(kh * kw * cin, cout)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def lax_conv_patch_grad(x: jax.Array, kernel: jax.Array, strides: Tuple[int, int], padding
                        ) -> jax.Array:
  """``lax.conv_general_dilated`` whose kernel gradient is computed as
  patchesᵀ @ output-gradient (a matmul) instead of XLA's kernel-gradient
  convolution, which XLA:CPU runs 4-30× slower inside a rolled ``lax.scan``
  (BENCHMARKS.md). Forward and input gradient are the lax convolution's."""
  return lax.conv_general_dilated(x, kernel, strides, padding, dimension_numbers=NHWC)


def _patch_grad_fwd(x, kernel, strides, padding):
  return lax_conv_patch_grad(x, kernel, strides, padding), (x, kernel)


def _patch_grad_bwd(strides, padding, residuals, out_grad):
  x, kernel = residuals
  kh, kw, cin, cout = kernel.shape
  _, input_vjp = jax.vjp(
      lambda x: lax.conv_general_dilated(x, kernel, strides, padding, dimension_numbers=NHWC), x)
  kernel_grad = jnp.einsum('nhwp,nhwo->po', image_patches(x, (kh, kw), strides, padding),
                           out_grad, precision=lax.Precision.HIGHEST)
  kernel_grad = kernel_grad.reshape(kh, kw, cin, cout)
  return input_vjp(out_grad)[0], kernel_grad


lax_conv_patch_grad.defvjp(_patch_grad_fwd, _patch_grad_bwd)


class Conv(nn.Module):
  """A 2-D convolution with ``nn.Conv``'s parameters (kernel [kh, kw, C, O] with
  lecun-normal init, bias zeros, ``param_dtype`` float32 as nn.Conv's, so a seed gives the
  same numbers with and without x64) and names, computed by ``impl`` (CONV_IMPLS)."""
  features: int
  kernel_size: Tuple[int, int]
  strides: Tuple[int, int] = (1, 1)
  padding: Any = 'SAME'
  use_bias: bool = True
  impl: str = 'lax'
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    kernel = self.param('kernel', nn.initializers.lecun_normal(),
                        tuple(self.kernel_size) + (x.shape[-1], self.features),
                        self.param_dtype)
    x, kernel = nn.dtypes.promote_dtype(x, kernel)  # as nn.Conv: compute in the wider type
    padding = self.padding
    if isinstance(padding, int):
      padding = ((padding, padding), (padding, padding))
    strides = tuple(self.strides)
    if self.impl == 'lax':
      y = lax.conv_general_dilated(x, kernel, strides, padding, dimension_numbers=NHWC)
    elif self.impl == 'patches':
      y = patches_conv(x, kernel, strides, padding)
    elif self.impl == 'lax_patch_grad':
      y = lax_conv_patch_grad(x, kernel, strides, padding)
    else:
      raise ValueError(f'config.model.conv: unknown {self.impl!r}; choose from '
                       f'{list(CONV_IMPLS)} or auto')
    if self.use_bias:
      y = y + self.param('bias', nn.initializers.zeros_init(), (self.features,),
                         self.param_dtype)
    return y


def torch_linear_bias_init(fan_in: int):
  """PyTorch ``nn.Linear``'s default bias init: U(−1/√fan_in, 1/√fan_in)."""
  bound = 1.0 / fan_in ** 0.5
  return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound,
                                                                  bound)


class AdaptationMLP(nn.Module):
  """FedTTA's adaptation model g(·; φ): per example, logits [B, C] -> a score [B, 1]
  (ReLU hidden layers of ``hidden`` widths; Ye et al., UPFL 2023 Sec. 4.1). Initialised as
  PyTorch's ``nn.Linear`` (kernel U(±1/√fan_in), the authors' framework): with flax's
  lecun-normal kernels and zero biases, g's gradient at initialisation is ~10× larger
  and the paper's η_inner = 0.5 inner step diverges in the first round."""
  hidden: Sequence[int] = (32, 32, 32)

  @nn.compact
  def __call__(self, logits):
    kernel_init = nn.initializers.variance_scaling(1 / 3, 'fan_in', 'uniform')
    dense = lambda width, x: nn.Dense(width, kernel_init=kernel_init,
                                      bias_init=torch_linear_bias_init(x.shape[-1]))(x)
    x = logits
    for width in self.hidden:
      x = nn.relu(dense(width, x))
    return dense(1, x)


class MLPEncoder(nn.Module):
  hidden: Sequence[int] = (200, 200)

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    x = x.reshape(x.shape[0], -1)
    for width in self.hidden:
      x = nn.relu(nn.Dense(width)(x))
    return x


class BNMLPEncoder(nn.Module):
  """MLP with BatchNorm after every hidden Dense (a cheap BN model for CPU runs)."""
  hidden: Sequence[int] = (200, 200)

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = x.reshape(x.shape[0], -1)
    for width in self.hidden:
      x = nn.Dense(width)(x)
      x = batch_norm(train)(x)
      x = nn.relu(x)
    return x


class ATPCNNEncoder(nn.Module):
  """ATP CNN trunk (the authors' code): 3 conv3x3 (VALID, no bias) + BN + ReLU, two
  max-pools, then Linear 64 + BatchNorm1d + ReLU."""
  channels: Sequence[int] = (32, 64, 64)
  features: int = 64
  conv: str = 'lax'

  @nn.compact
  def __call__(self, x, train: bool = False):
    norm = functools.partial(batch_norm, train)
    for i, width in enumerate(self.channels):
      x = Conv(width, (3, 3), padding='VALID', use_bias=False, impl=self.conv)(x)
      x = nn.relu(norm()(x))
      if i < 2:
        x = nn.max_pool(x, (2, 2), (2, 2))
    x = x.reshape(x.shape[0], -1)
    x = nn.Dense(self.features)(x)
    return nn.relu(norm()(x))


class EvolveCNNEncoder(nn.Module):
  """FedEvolve CNN trunk (FedEvolve paper App. D): conv3x3 layers of ``widths`` and
  ``strides``, each with GroupNorm(8) + ReLU, then the last feature map pooled and, when
  ``features`` > 0, a Linear of that width + ReLU; the representation f_φ / f_ψ.

  The defaults (``evolve_cnn``): widths 64-64-64-64, strides 1-2-2-2, the last [4, 4, 64]
  map flattened into Linear 64. ``pool``: 'flatten' keeps the map's spatial layout;
  'mean' averages it away (global average pooling), which on this 4×4 map leaves
  FedEvolve's prototypes almost indistinguishable: centralised, 2,000 steps, FedEvolve
  reached 38.7 % target accuracy with 'mean' and 84.9 % with 'flatten'
  (fedjax_shift/papers/fedevolve/README.md, RMNIST). ``domainbed_cnn`` is the trunk of
  DomainBed's MNIST CNN (Gulrajani & Lopez-Paz, ICLR 2021): widths 64-128-128-128,
  strides 1-2-1-1, global average pooling, 128 features, no Linear; with one input
  channel it has 370,560 parameters, half of FedEvolve's Table 7 count (741,120 for
  φ and ψ)."""
  widths: Sequence[int] = (64, 64, 64, 64)
  strides: Sequence[int] = (1, 2, 2, 2)
  groups: int = 8
  features: int = 64
  pool: str = 'flatten'
  conv: str = 'lax'
  feature_bias: bool = True     # the Linear's bias (domainbed_cnn's hidden layer: none)

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    if len(self.widths) != len(self.strides):
      raise ValueError(f'config.model: {len(self.widths)} widths but {len(self.strides)} '
                       f'strides')
    for width, stride in zip(self.widths, self.strides):
      x = Conv(width, (3, 3), strides=(stride, stride), padding='SAME', impl=self.conv)(x)
      x = nn.relu(nn.GroupNorm(num_groups=self.groups)(x))
    if self.pool == 'flatten':
      x = x.reshape(x.shape[0], -1)
    elif self.pool == 'mean':
      x = jnp.mean(x, axis=(1, 2))
    else:
      raise ValueError(f"config.model.pool: 'flatten' or 'mean', got {self.pool!r}")
    if not self.features:
      return x
    return nn.relu(nn.Dense(self.features, use_bias=self.feature_bias)(x))


class LeNetEncoder(nn.Module):
  """The UPFL authors' LeNet-5 trunk (their App. G Table 3, CIFAR10_LeNet5_*): two
  conv5x5 (SAME) + ReLU + 2x2 max-pool of ``channels`` widths, flattened, then
  Linear ``features`` (512) + ReLU."""
  channels: Sequence[int] = (16, 32)
  features: int = 512
  conv: str = 'lax'

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    for width in self.channels:
      x = Conv(width, (5, 5), padding='SAME', impl=self.conv)(x)
      x = nn.max_pool(nn.relu(x), (2, 2), (2, 2))
    x = x.reshape(x.shape[0], -1)
    return nn.relu(nn.Dense(self.features)(x))


class ResidualBlock(nn.Module):
  filters: int
  strides: int = 1
  conv: str = 'lax'

  @nn.compact
  def __call__(self, x, train: bool = False):
    norm = functools.partial(batch_norm, train)
    residual = x
    conv = functools.partial(Conv, use_bias=False, impl=self.conv)
    y = conv(self.filters, (3, 3), (self.strides, self.strides), padding=1)(x)
    y = nn.relu(norm()(y))
    y = conv(self.filters, (3, 3), padding=1)(y)
    y = norm()(y)
    if residual.shape != y.shape:
      residual = conv(self.filters, (1, 1), (self.strides, self.strides))(x)
      residual = norm()(residual)
    return nn.relu(y + residual)


RESNET_STEMS = ('cifar', 'imagenet')


class ResNet18Encoder(nn.Module):
  """ResNet-18, BatchNorm, global average pool. ``stem`` 'cifar': a 3x3 stride-1 stem,
  no max-pool; 'imagenet': torchvision's (He et al., CVPR 2016), a 7x7 stride-2 stem
  then a 3x3 stride-2 max-pool, which ImageNet weights need (ATP's Table 1 model:
  torchvision's ImageNet ResNet-18 on 32x32 CIFAR images)."""
  stage_sizes: Sequence[int] = (2, 2, 2, 2)
  width: int = 64
  conv: str = 'lax'
  stem: str = 'cifar'

  @nn.compact
  def __call__(self, x, train: bool = False):
    if self.stem == 'imagenet':
      x = Conv(self.width, (7, 7), (2, 2), padding=3, use_bias=False, impl=self.conv)(x)
      x = nn.relu(batch_norm(train)(x))
      x = nn.max_pool(x, (3, 3), (2, 2), padding=((1, 1), (1, 1)))
    elif self.stem == 'cifar':
      x = Conv(self.width, (3, 3), padding=1, use_bias=False, impl=self.conv)(x)
      x = nn.relu(batch_norm(train)(x))
    else:
      raise ValueError(f'config.model.stem: choose from {list(RESNET_STEMS)}, got '
                       f'{self.stem!r}')
    for stage, num_blocks in enumerate(self.stage_sizes):
      for block in range(num_blocks):
        strides = 2 if stage > 0 and block == 0 else 1
        x = ResidualBlock(self.width * 2 ** stage, strides, self.conv)(x, train)
    return jnp.mean(x, axis=(1, 2))


class WideBasicBlock(nn.Module):
  """Pre-activation wide residual block (BN-ReLU-conv3x3, twice; Zagoruyko &
  Komodakis 2016), a 1x1 projection when the shape changes."""
  filters: int
  strides: int = 1
  conv: str = 'lax'

  @nn.compact
  def __call__(self, x, train: bool = False):
    conv = functools.partial(Conv, use_bias=False, impl=self.conv)
    out = nn.relu(batch_norm(train)(x))
    residual = x
    if x.shape[-1] != self.filters or self.strides != 1:
      residual = conv(self.filters, (1, 1), (self.strides, self.strides))(out)
    y = conv(self.filters, (3, 3), (self.strides, self.strides), padding=1)(out)
    y = nn.relu(batch_norm(train)(y))
    y = conv(self.filters, (3, 3), padding=1)(y)
    return y + residual


class WideResNetEncoder(nn.Module):
  """WRN-depth-widen (FedEvolve's Portraits model): 3 stages of (depth − 4) / 6
  pre-activation blocks of 16·widen, 32·widen, 64·widen filters, BN-ReLU, global
  average pool. WRN-16-4 by default."""
  depth: int = 16
  widen: int = 4
  conv: str = 'lax'

  @nn.compact
  def __call__(self, x, train: bool = False):
    if (self.depth - 4) % 6:
      raise ValueError(f'WideResNet depth must be 6n + 4, got {self.depth}')
    x = Conv(16, (3, 3), padding=1, use_bias=False, impl=self.conv)(x)
    for stage in range(3):
      for block in range((self.depth - 4) // 6):
        strides = 2 if stage > 0 and block == 0 else 1
        x = WideBasicBlock(16 * self.widen * 2 ** stage, strides, self.conv)(x, train)
    x = nn.relu(batch_norm(train)(x))
    return jnp.mean(x, axis=(1, 2))


class Head(nn.Module):
  """A classifier with hidden layers: Dense + ReLU of each ``hidden`` width (params
  'hidden_0', 'hidden_1', …), then the linear layer to the classes, whose 'kernel' and
  'bias' sit at the head's top level as a Dense head's do. A head without the hidden
  layers' parameters (a prototype head put in place of the trained one) is that linear
  layer on the features alone."""
  num_classes: int
  hidden: Sequence[int]

  @nn.compact
  def __call__(self, features):
    present = self.variables.get('params', {})
    x = features
    for index, width in enumerate(self.hidden):
      name = f'hidden_{index}'
      if self.is_initializing() or name in present:
        x = nn.relu(nn.Dense(width, name=name)(x))
    kernel = self.param('kernel', nn.initializers.lecun_normal(),
                        (x.shape[-1], self.num_classes))
    bias = self.param('bias', nn.initializers.zeros_init(), (self.num_classes,))
    return x @ kernel + bias


class Classifier(nn.Module):
  """``head(encoder(x))``; ``features`` returns the encoder output [B, F] (the
  representation). ``head_hidden``: widths of hidden layers in the head (FedEvolve's
  Circle MLP: the classifier 256×64, 64×2 on a 256-wide representation); empty, the
  head is one Dense."""
  encoder: nn.Module
  num_classes: int
  head_hidden: Sequence[int] = ()

  def setup(self):
    self.head = (Head(self.num_classes, tuple(self.head_hidden)) if self.head_hidden
                 else nn.Dense(self.num_classes))

  def __call__(self, x, train: bool = False):
    return self.head(self.encoder(x, train))

  def features(self, x, train: bool = False):
    return self.encoder(x, train)
