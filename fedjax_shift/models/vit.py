"""A Vision Transformer with SSF (scale-and-shift of deep features; Lian et al. 2022,
used by FedIns, Feng et al., ICCV 2023 Sec. 3.2), registered as the model 'vit'.

SSF re-modulates a feature after an operation, y ← γ ⊙ y + β (γ, β of the feature's
width), at these points: the patch embedding, and in each block after LayerNorm 1, the
query / key / value projections, the attention output projection, LayerNorm 2, the two
MLP linears; and after the final LayerNorm. The backbone stays frozen; the SSF factors
are an argument of the forward (``ssf``: {point: (scale, shift)}, each [D] for one SSF
or [B, D] for one per instance), so a pool of them can be mixed per instance without a
per-example loop. ``fold_ssf`` merges one SSF into the weights (re-parameterisation:
a linear y = Wx + b becomes (W·diag γ)x + (γ⊙b + β), a LayerNorm's scale and bias
γ⊙g, γ⊙c + β), so inference costs what the plain ViT costs.

``ViTClassifier`` (encoder / head, as every classifier of the library) reads its SSF
from its variables, so every caller of ``models.apply`` runs the adapted model:

  variables['ssf']       {'scale': tree, 'shift': tree}: one SSF (federated SSF, Sec. 3.2)
  variables['ssf_pool']  {'scale': tree [M, D], 'shift': tree [M, D], 'keys': [M, F],
                          'top_c': [] int, 'per_instance': [] bool}: FedIns' pool (Sec.
                          3.3-3.4); each instance's query (the frozen encoder's CLS
                          feature, no SSF) picks the ``top_c`` keys of highest cosine
                          similarity and the mean of their SSFs (Eq. 9) adapts that
                          instance; per_instance False: one pick per batch from the
                          batch's mean query (the ablation without an instance query)

(a "tree" is the SSF points nested by '/': {'embedding': [D], 'encoderblock_0':
{'query': [D], ...}, ...}, so checkpoints never see a '/' in a key.)

Parameter names follow the common ViT-B/16 ``.npz`` layout (embedding, cls,
Transformer/posembed_input, Transformer/encoderblock_<i>/{LayerNorm_0,
MultiHeadDotProductAttention_1/{query,key,value,out}, LayerNorm_2,
MlpBlock_3/{Dense_0,Dense_1}}, Transformer/encoder_norm): ``load_npz`` reads a user's
checkpoint in it (shapes checked against the config), ``save_npz`` writes one.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

SSF = Dict[str, Tuple[jax.Array, jax.Array]]   # point -> (scale, shift), [D] or [B, D]


def ssf_apply(ssf: Optional[SSF], point: str, y: jax.Array) -> jax.Array:
  """γ ⊙ y + β over the last axis of y [B, ..., D] (identity without an SSF there)."""
  if ssf is None or point not in ssf:
    return y
  scale, shift = ssf[point]
  if scale.ndim == 2:   # one SSF per instance [B, D]: broadcast over the token axes
    middle = (1,) * (y.ndim - 2)
    scale = scale.reshape(scale.shape[:1] + middle + scale.shape[1:])
    shift = shift.reshape(shift.shape[:1] + middle + shift.shape[1:])
  return y * scale + shift


# A block's SSF points in forward order -> the layer whose output each re-modulates.
BLOCK_POINTS = {'LayerNorm_0': 'LayerNorm_0',
                'query': 'MultiHeadDotProductAttention_1_query',
                'key': 'MultiHeadDotProductAttention_1_key',
                'value': 'MultiHeadDotProductAttention_1_value',
                'out': 'MultiHeadDotProductAttention_1_out',
                'LayerNorm_2': 'LayerNorm_2',
                'Dense_0': 'MlpBlock_3_Dense_0', 'Dense_1': 'MlpBlock_3_Dense_1'}


class Block(nn.Module):
  """One pre-norm encoder block; its SSF points are '<block name>/<BLOCK_POINTS key>'."""
  width: int
  heads: int
  mlp_dim: int

  @nn.compact
  def __call__(self, x, ssf=None):
    layer = lambda op, module: lambda y: ssf_apply(ssf, f'{self.name}/{op}', module(
        name=BLOCK_POINTS[op])(y))
    head_dim = self.width // self.heads
    y = layer('LayerNorm_0', nn.LayerNorm)(x)
    attention = {}
    for proj in ('query', 'key', 'value'):
      out = nn.DenseGeneral((self.heads, head_dim), name=BLOCK_POINTS[proj])(y)
      flat = out.reshape(out.shape[:-2] + (self.width,))
      attention[proj] = ssf_apply(ssf, f'{self.name}/{proj}', flat).reshape(out.shape)
    logits = jnp.einsum('bqhd,bkhd->bhqk', attention['query'], attention['key']) / jnp.sqrt(
        head_dim).astype(x.dtype)
    weights = jax.nn.softmax(logits, axis=-1)
    mixed = jnp.einsum('bhqk,bkhd->bqhd', weights, attention['value'])
    x = x + layer('out', lambda name: nn.DenseGeneral(self.width, axis=(-2, -1), name=name))(mixed)
    y = layer('LayerNorm_2', nn.LayerNorm)(x)
    y = nn.gelu(layer('Dense_0', lambda name: nn.Dense(self.mlp_dim, name=name))(y))
    return x + layer('Dense_1', lambda name: nn.Dense(self.width, name=name))(y)


class ViTEncoder(nn.Module):
  """x [B, H, W, C] -> the final CLS feature [B, width]."""
  patch_size: int = 4
  width: int = 64
  depth: int = 2
  heads: int = 4
  mlp_dim: int = 128

  @nn.compact
  def __call__(self, x, ssf: Optional[SSF] = None, train: bool = False):
    del train
    height, width_px = x.shape[1:3]
    if height % self.patch_size or width_px % self.patch_size:
      raise ValueError(f'vit: image size {height}×{width_px} is not divisible by the patch '
                       f'size {self.patch_size}')
    if self.width % self.heads:
      raise ValueError(f'vit: width {self.width} is not divisible by heads {self.heads}')
    y = nn.Conv(self.width, (self.patch_size,) * 2, strides=(self.patch_size,) * 2,
                padding='VALID', name='embedding')(x)
    y = y.reshape(y.shape[0], -1, self.width)
    y = ssf_apply(ssf, 'embedding', y)
    cls = self.param('cls', nn.initializers.zeros, (1, 1, self.width), y.dtype)
    y = jnp.concatenate([jnp.broadcast_to(cls, (y.shape[0], 1, self.width)), y], axis=1)
    pos = self.param('posembed_input', nn.initializers.normal(0.02), (1,) + y.shape[1:],
                     y.dtype)
    y = y + pos
    for i in range(self.depth):
      y = Block(self.width, self.heads, self.mlp_dim, name=f'encoderblock_{i}')(y, ssf)
    y = ssf_apply(ssf, 'encoder_norm', nn.LayerNorm(name='encoder_norm')(y))
    return y[:, 0]


def ssf_points(encoder: ViTEncoder) -> Dict[str, int]:
  """{SSF point: its feature width}, in forward order."""
  points = {'embedding': encoder.width}
  for i in range(encoder.depth):
    points.update({f'encoderblock_{i}/{op}': encoder.mlp_dim if op == 'Dense_0' else encoder.width
                   for op in BLOCK_POINTS})
  points['encoder_norm'] = encoder.width
  return points


def init_ssf(encoder: ViTEncoder, dtype=jnp.float32) -> SSF:
  """The identity SSF (scale 1, shift 0) at every point."""
  return {point: (jnp.ones((width,), dtype), jnp.zeros((width,), dtype))
          for point, width in ssf_points(encoder).items()}


def _fold_dense(layer: dict, scale: jax.Array, shift: jax.Array) -> dict:
  """A Dense / DenseGeneral / Conv whose output (last kernel axes) is scaled then shifted."""
  kernel, bias = layer['kernel'], layer['bias']
  out_shape = bias.shape
  return {'kernel': kernel * scale.reshape(out_shape),
          'bias': bias * scale.reshape(out_shape) + shift.reshape(out_shape)}


def _fold_norm(layer: dict, scale: jax.Array, shift: jax.Array) -> dict:
  return {'scale': layer['scale'] * scale, 'bias': layer['bias'] * scale + shift}


def fold_ssf(params: dict, ssf: SSF) -> dict:
  """Encoder params with one SSF ([D] factors) merged into the weights: the plain
  forward of the result equals the SSF forward of ``params``."""
  out = dict(params)
  for point, (scale, shift) in ssf.items():
    if scale.ndim != 1:
      raise ValueError(f'fold_ssf: the SSF at {point!r} is per instance (shape '
                       f'{scale.shape}); fold one SSF of shape [D]')
    if point == 'embedding':
      out['embedding'] = _fold_dense(out['embedding'], scale, shift)
    elif point == 'encoder_norm':
      out['encoder_norm'] = _fold_norm(out['encoder_norm'], scale, shift)
    else:
      block, op = point.split('/')
      layer = BLOCK_POINTS[op]
      fold = _fold_norm if op.startswith('LayerNorm') else _fold_dense
      out[block] = {**out[block], layer: fold(out[block][layer], scale, shift)}
  return out


def npz_name(path: Tuple[str, ...]) -> str:
  """Our flat parameter path -> its name in the ViT-B/16 ``.npz`` layout."""
  parts = []
  for part in path:
    if part.startswith('MultiHeadDotProductAttention_1_'):
      parts += ['MultiHeadDotProductAttention_1', part.rsplit('_', 1)[1]]
    elif part.startswith('MlpBlock_3_'):
      parts += ['MlpBlock_3', part[len('MlpBlock_3_'):]]
    else:
      parts.append(part)
  if parts[0].startswith('encoderblock_') or parts[0] in ('encoder_norm', 'posembed_input'):
    parts = ['Transformer'] + parts
  if parts[-1] == 'posembed_input':
    parts.append('pos_embedding')
  return '/'.join(parts)


def save_npz(path: str, params: dict) -> None:
  """Encoder params as a ``.npz`` in the ViT-B/16 layout."""
  import numpy as np
  from flax import traverse_util
  flat = traverse_util.flatten_dict(params)
  np.savez(path, **{npz_name(p): np.asarray(v) for p, v in flat.items()})


def load_npz(path: str, encoder: ViTEncoder, example_x: jax.Array) -> dict:
  """Encoder params from a ``.npz`` in the ViT-B/16 layout, checked against the shapes
  ``encoder`` has for ``example_x``: a missing or wrong-shaped parameter is an error
  naming it (a head or other extra arrays in the file are ignored)."""
  import numpy as np
  from flax import traverse_util
  expected = traverse_util.flatten_dict(
      jax.eval_shape(encoder.init, jax.random.key(0), example_x)['params'])
  with np.load(path) as stored:
    return traverse_util.unflatten_dict(checked_params(
        expected, stored, npz_name, path,
        f'this ViT (patch {encoder.patch_size}, width {encoder.width}, depth '
        f'{encoder.depth}, heads {encoder.heads}, mlp {encoder.mlp_dim})'))


def checked_params(expected: dict, stored, name_of, source: str, model) -> dict:
  """{key: array} for every key of ``expected`` (flat {path tuple: ShapeDtypeStruct}),
  read from the mapping ``stored`` under ``name_of(key)`` and cast to the expected
  dtype. A missing name or another shape is an error naming the parameter, ``source``
  (the file) and ``model`` (what needs the parameter: a string, or a function of the
  key that says it)."""
  import numpy as np
  out = {}
  for key, spec in expected.items():
    name = name_of(key)
    needed_by = model(key) if callable(model) else model
    if name not in stored:
      raise ValueError(f'{source}: no parameter {name!r} ({needed_by})')
    value = np.asarray(stored[name])
    if value.shape != spec.shape:
      raise ValueError(f'{source}: parameter {name!r} has shape {value.shape}, {needed_by} '
                       f'needs {spec.shape}')
    out[key] = jnp.asarray(value, spec.dtype)
  return out


def ssf_tree(ssf: SSF) -> dict:
  """{point: (scale, shift)} -> {'scale': tree, 'shift': tree} nested by '/'."""
  return {name: traverse_util.unflatten_dict(
      {tuple(point.split('/')): pair[i] for point, pair in ssf.items()})
      for i, name in enumerate(('scale', 'shift'))}


def tree_ssf(tree: dict) -> SSF:
  """The inverse of ``ssf_tree``."""
  scale = traverse_util.flatten_dict(tree['scale'], sep='/')
  shift = traverse_util.flatten_dict(tree['shift'], sep='/')
  return {point: (scale[point], shift[point]) for point in scale}


def cosine_similarity(queries: jax.Array, keys: jax.Array) -> jax.Array:
  """[B, F] × [M, F] -> [B, M] cosine similarities."""
  normalise = lambda v: v / jnp.maximum(jnp.linalg.norm(v, axis=-1, keepdims=True), 1e-12)
  return normalise(queries) @ normalise(keys).T


def top_c_weights(similarity: jax.Array, top_c: jax.Array) -> jax.Array:
  """[B, M] similarities -> [B, M] weights 1/C on each row's C largest (ties to the
  lower index), 0 elsewhere. C may be traced: the ranks come from a stable sort."""
  ranks = jnp.argsort(jnp.argsort(-similarity, axis=-1, stable=True), axis=-1, stable=True)
  chosen = (ranks < top_c).astype(similarity.dtype)
  return chosen / jnp.maximum(top_c, 1).astype(similarity.dtype)


def choose_keys(pool: dict, queries: jax.Array) -> Tuple[jax.Array, jax.Array]:
  """The top-C choice (Sec. 3.4): queries [B, F] -> (weights [B, M], 1/C on each
  example's chosen keys; similarity [B, M], each query's cosine to every key). With
  ``pool['per_instance']`` False one choice for the batch, from its mean query."""
  similarity = cosine_similarity(queries, pool['keys'])
  per_batch = jnp.broadcast_to(cosine_similarity(queries.mean(0, keepdims=True), pool['keys']),
                               similarity.shape)
  similarity = jnp.where(pool['per_instance'], similarity, per_batch)
  return top_c_weights(jax.lax.stop_gradient(similarity), pool['top_c']), similarity


def select_ssf(pool: dict, queries: jax.Array) -> Tuple[SSF, jax.Array, jax.Array]:
  """FedIns' instance-adaptive SSF (Sec. 3.4, Eq. 9): queries [B, F] -> ({point:
  (scale, shift) [B, D]}, match [B] = Σ of the cosine similarities of the chosen keys,
  the term of the key loss 1 − Σ cos, the top-C weights [B, M])."""
  weights, similarity = choose_keys(pool, queries)
  match = jnp.sum(similarity * (weights > 0), axis=-1)
  mixed = {point: (weights @ scale, weights @ shift)
           for point, (scale, shift) in tree_ssf(pool).items()}
  return mixed, match, weights


class ViTClassifier(nn.Module):
  """``head(encoder(x, ssf))`` with the SSF of the variables (module docstring)."""
  encoder: ViTEncoder
  num_classes: int

  def setup(self):
    self.head = nn.Dense(self.num_classes)

  def __call__(self, x, train: bool = False):
    return self.logits_and_match(x, train)[0]

  def features(self, x, train: bool = False):
    return self.features_and_match(x, train)[0]

  def logits_and_match(self, x, train: bool = False):
    """(logits [B, C], match [B]: Σ cos of the chosen keys, 0 without a pool). With a
    head pool in the pool (its 'head_kernel' [M, F, C] and 'head_bias' [M, C], the
    FedIns authors' code) the logits are the mean of the chosen heads' logits."""
    features, match, weights = self.pooled_forward(x, train)
    if not self.has_variable('ssf_pool', 'head_kernel'):
      return self.head(features), match
    per_head = (jnp.einsum('bf,mfc->bmc', features, self.get_variable('ssf_pool', 'head_kernel'))
                + self.get_variable('ssf_pool', 'head_bias'))
    return jnp.einsum('bm,bmc->bc', weights, per_head), match

  def selection(self, x):
    """``choose_keys`` for x [B, ...]: (weights [B, M], similarity [B, M]), the choice
    ``features_and_match`` makes with the pool."""
    pool = {name: self.get_variable('ssf_pool', name) for name in ('keys', 'top_c',
                                                                    'per_instance')}
    return choose_keys(pool, self.encoder(x, None, False))

  def features_and_match(self, x, train: bool = False):
    return self.pooled_forward(x, train)[:2]

  def pooled_forward(self, x, train: bool = False):
    """(features [B, F], match [B], the top-C weights [B, M] or None without a pool)."""
    if self.has_variable('ssf_pool', 'keys'):
      pool = {name: self.get_variable('ssf_pool', name)
              for name in ('scale', 'shift', 'keys', 'top_c', 'per_instance')}
      query = jax.lax.stop_gradient(self.encoder(x, None, train))   # frozen, no SSF
      ssf, match, weights = select_ssf(pool, query)
      return self.encoder(x, ssf, train), match, weights
    ssf = None
    if self.has_variable('ssf', 'scale'):
      ssf = tree_ssf({name: self.get_variable('ssf', name) for name in ('scale', 'shift')})
    return self.encoder(x, ssf, train), jnp.zeros(x.shape[:1], x.dtype), None
