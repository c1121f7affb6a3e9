"""FedIns: Instance-adaptive inference for federated learning (Feng et al., ICCV 2023, Algorithm 1).

A frozen pretrained ViT θ; each client trains FI = {K, Δ}: a pool Δ = {δ¹ … δᴹ} of SSF
sets (scale γ and shift β at every SSF point, models/vit.py) with keys K = {k¹ … kᴹ},
and the classification head h (Sec. 3.2: δ = {γ, β, h}; one head shared by the pool, as
the paper's parameter counts imply (``fedins.head_pool``: one head per member, mixed by
the same top-C, as the authors' code): 25 SSF sets of ViT-B/16 are 5.15 M, Table 2's
5.16 M new parameters, and 5.35 M sent with keys and head).

  instance x:  q(x) = frozen CLS feature;  top-C keys by cos(q(x), k)      (Sec. 3.4)
               δ(x) = (1/C) Σ_c δ^{m_c}                                       (Eq. 9)
  client k:    FI_k ← FI_k − η ∇ℓ_k,  ℓ = (1 − λ)·CE + λ·(1 − Σ_c cos(q, k^{m_c}))
               (Eq. 7; λ = 0.1 from the authors' code)
  server:      FI_g ← Σ_k |D_k|/|D| FI_k                                     (Eq. 8)

The selection is batched: similarities [B, M], one stable sort for the ranks, and the
chosen SSFs mixed with a [B, M] weight matrix (no per-example loop); the keys learn only
through the key loss (the choice is not differentiable). Only FI and h are trained and
sent; the backbone stays bit-identical. Evaluation runs the model with the pool in its
variables (``ViTClassifier``): every instance is adapted, and ``vit.fold_ssf`` merges an
instance's δ(x) into θ for plain-ViT inference.

Ablations of Table 2 (registered): ``fedins_ssf`` (federated SSF, Sec. 3.2: one SSF set,
no keys, CE only) and ``fedins_batch_query`` (the SSF pool without the instance query:
one top-C choice per batch, from the batch's mean query).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from fedjax_shift.algorithms import base
from fedjax_shift import models
from fedjax_shift.core.algorithm import ClientOutput, FederatedAlgorithm
from fedjax_shift.core.local import local_train, masked_mean
from fedjax_shift.models import vit
from fedjax_shift.parts import trees
from fedjax_shift.registry import BOOL, NONNEGATIVE, POSITIVE_INT, interval, one_of, require

PyTree = Any
QUERIES = ('instance', 'batch')
KEY_INITS = ('trunc_normal', 'uniform')
DEFAULTS = {
    'pool_size': 25,          # M (Sec. 4.1)
    'top_c': 3,               # C (Sec. 4.1)
    'key_loss_weight': 0.1,   # λ: 0.9·CE + 0.1·(1 − Σ cos) (authors' code)
    'query': 'instance',      # 'instance' | 'batch' (ablation: no instance query)
    'init_std': 0.02,         # γ ~ N(1, σ), β ~ N(0, σ) (SSF's initialisation)
    'key_init': 'trunc_normal',  # keys ~ trunc-normal(0.02) (authors' code); 'uniform':
                                 # U(−1, 1) (L2P's), ~29× slower key learning at width 64
    # One head per pool member, mixed by the same top-C (the authors' code); False: one
    # head shared by the pool (the paper's parameter counts)
    'head_pool': False,
}
RANGES = {
    'pool_size': POSITIVE_INT,
    'top_c': POSITIVE_INT,                               # and <= pool_size (check)
    'key_loss_weight': interval(0, 1, high_open=True),   # 1 would leave no CE term
    'query': one_of(*QUERIES),
    'init_std': NONNEGATIVE,                             # 0: every SSF set the identity
    'key_init': one_of(*KEY_INITS),
    'head_pool': BOOL,
}


def check(section: str):
  def run(hparams: ml_collections.ConfigDict) -> None:
    require(hparams.top_c <= hparams.pool_size, f'{section}.top_c',
            f'must be between 1 and pool_size={hparams.pool_size} (C ≤ M), got {hparams.top_c}')
  return run


def init_pool(encoder: vit.ViTEncoder, hparams: ml_collections.ConfigDict,
              rng: jax.Array, num_classes: int = 0) -> dict:
  """The ``ssf_pool`` collection: γ [M, D] ~ N(1, σ), β [M, D] ~ N(0, σ) at every SSF
  point, keys [M, width] by ``hparams.key_init`` ('trunc_normal': the authors' code's
  trunc_normal_(std=0.02), bounds ±2 absolute; 'uniform': U(−1, 1), L2P's), C and the
  query mode; with ``hparams.head_pool`` one head per member, 'head_kernel'
  [M, width, num_classes] (LeCun normal, as a Dense) and 'head_bias' [M, num_classes]
  (zeros)."""
  size, std = hparams.pool_size, hparams.init_std
  ssf = {}
  for i, (point, width) in enumerate(vit.ssf_points(encoder).items()):
    scale_key, shift_key = jax.random.split(jax.random.fold_in(rng, i))
    ssf[point] = (1.0 + std * jax.random.normal(scale_key, (size, width)),
                  std * jax.random.normal(shift_key, (size, width)))
  key_rng, key_shape = jax.random.fold_in(rng, len(ssf)), (size, encoder.width)
  if hparams.key_init == 'uniform':
    keys = jax.random.uniform(key_rng, key_shape, minval=-1.0, maxval=1.0)
  else:   # timm's trunc_normal_(std=0.02, a=-2, b=2): bounds at ±100 standard deviations
    keys = 0.02 * jax.random.truncated_normal(key_rng, -100.0, 100.0, key_shape)
  pool = {**vit.ssf_tree(ssf), 'keys': keys, 'top_c': jnp.int32(hparams.top_c),
          'per_instance': jnp.bool_(hparams.query == 'instance')}
  if hparams.head_pool:
    head_rng = jax.random.fold_in(rng, len(ssf) + 1)
    pool['head_kernel'] = jax.nn.initializers.lecun_normal(batch_axis=(0,))(
        head_rng, (size, encoder.width, num_classes))
    pool['head_bias'] = jnp.zeros((size, num_classes))
  return pool


HEAD_POOL = ('head_kernel', 'head_bias')


def trainable(variables) -> dict:
  """FI and h: {'head': ... (without a head pool), 'ssf_pool': {'scale', 'shift',
  'keys'} and the head pool's 'head_kernel', 'head_bias' (with one)."""
  pool = variables['ssf_pool']
  names = ('scale', 'shift', 'keys') + tuple(n for n in HEAD_POOL if n in pool)
  heads = {} if 'head_kernel' in pool else {'head': variables['params']['head']}
  return {**heads, 'ssf_pool': {name: pool[name] for name in names}}


def frozen(variables) -> dict:
  """Everything else: the backbone θ, the pool's C and query mode, and the module's
  own head when a head pool replaces it (kept, never trained or sent)."""
  pool = variables['ssf_pool']
  params = variables['params']
  unused = {'head': params['head']} if 'head_kernel' in pool else {}
  return {'encoder': params['encoder'], **unused,
          'selection': {name: pool[name] for name in ('top_c', 'per_instance')}}


def merge(train: dict, fixed: dict) -> dict:
  head = train['head'] if 'head' in train else fixed['head']
  return {'params': {'encoder': fixed['encoder'], 'head': head},
          'ssf_pool': {**train['ssf_pool'], **fixed['selection']}}


def fedins_loss(module, key_loss_weight: float):
  """core.local's LossFn over FI and h: (1 − λ)·CE + λ·(1 − Σ_c cos), masked means."""

  def loss_fn(params, model_state, x, y, weight, rng):
    del rng
    logits, match = module.apply(merge(params, model_state), x, method='logits_and_match')
    ce = masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, y), weight)
    key_loss = masked_mean(1.0 - match, weight)
    return (1.0 - key_loss_weight) * ce + key_loss_weight * key_loss, model_state

  return loss_fn


def build(hparams: ml_collections.ConfigDict, context: base.BuildContext) -> FederatedAlgorithm:
  module, server_opt = context.module, context.server_optimizer
  require(isinstance(module, vit.ViTClassifier), 'model.name',
          f'FedIns trains SSF sets of a ViT: set config.model.name = "vit" (got '
          f'{type(module).__name__})')
  loss_fn = fedins_loss(module, hparams.key_loss_weight)

  def init(rng, example_x):
    model_key, pool_key = jax.random.split(rng)
    variables = models.init(module, model_key, example_x)
    variables = {**variables, 'ssf_pool': init_pool(module.encoder, hparams, pool_key,
                                                    module.num_classes)}
    return base.ServerState(variables, server_opt.init(trainable(variables)), jnp.int32(0))

  def client_update(server_state, client_state, data, rng):
    start = trainable(server_state.variables)
    params, _, _, metrics = local_train(loss_fn, context.client_optimizer, start,
                                        frozen(server_state.variables), data, rng,
                                        context.schedule)
    return ClientOutput(trees.tree_sub(params, start), metrics), client_state

  def server_update(state: base.ServerState, outputs: ClientOutput, weights) -> base.ServerState:
    # Eq. 8 with config.server's optimizer (SGD lr 1: the weighted mean of the FI_k).
    current = trainable(state.variables)
    pseudo_grad = jax.tree.map(jnp.negative, trees.weighted_sum(outputs.update, weights))
    updates, opt_state = server_opt.update(pseudo_grad, state.opt_state, current)
    variables = merge(optax.apply_updates(current, updates), frozen(state.variables))
    return base.ServerState(variables, opt_state, state.round + 1)

  return FederatedAlgorithm(
      init=init, init_client_state=lambda server_state: (), client_update=client_update,
      server_update=server_update, personalize=None,
      global_model=lambda server_state: server_state.variables)


def key_counts(select, variables, split, batch_size: int) -> Tuple[np.ndarray, float, int]:
  """Over every real example of ``split`` (a FederatedData, clients pooled) in batches of
  ``batch_size``: (how often each key was chosen [M], the summed mean cosine of each
  example's chosen keys, the number of examples)."""
  x = np.concatenate([split.x[k, :n] for k, n in enumerate(split.num_examples)])
  counts, cosine = 0, 0.0
  for start in range(0, len(x), batch_size):
    weights, similarity = select(variables, jnp.asarray(x[start:start + batch_size]))
    chosen = np.asarray(weights) > 0
    counts = counts + chosen.sum(0)
    cosine += float((np.asarray(similarity) * chosen).sum() / chosen.sum() * len(chosen))
  return np.asarray(counts), cosine, len(x)


def selection_diagnostics(module) -> Callable[..., Dict[str, float]]:
  """``diagnose(variables, splits, info, batch_size)``: is the selection of ``module``
  (a ViTClassifier with a pool) instance-adaptive? On the pooled 'test' split: the mean
  cosine of the chosen keys ('fedins/test/chosen_cosine', what the key loss raises) and
  how many of the M keys were ever chosen ('fedins/test/keys_used'); where the benchmark
  has domains (``info['domains']``, splits 'test_<domain>'), each domain's purity, the
  share of its choices that go to keys chosen most often by that domain
  ('fedins/test_<domain>/purity'), and their pooled form ('fedins/test/purity': the
  share of all choices on each key's majority domain; 1 when no key is shared)."""
  select = jax.jit(lambda variables, x: module.apply(variables, x, method='selection'))

  def diagnose(variables, splits, info: dict, batch_size: int) -> Dict[str, float]:
    out = {}
    if 'test' in splits and int(splits['test'].num_examples.sum()):
      counts, cosine, size = key_counts(select, variables, splits['test'], batch_size)
      out['fedins/test/chosen_cosine'] = cosine / size
      out['fedins/test/keys_used'] = float((counts > 0).sum())
    domains = [d for d in info.get('domains', ()) if f'test_{d}' in splits
               and int(splits[f'test_{d}'].num_examples.sum())]
    if len(domains) >= 2:
      per_domain = np.stack([key_counts(select, variables, splits[f'test_{d}'], batch_size)[0]
                             for d in domains])                       # [D, M]
      majority = per_domain.argmax(0)
      for index, domain in enumerate(domains):
        out[f'fedins/test_{domain}/purity'] = float(
            per_domain[index, majority == index].sum() / per_domain[index].sum())
      out['fedins/test/purity'] = float(per_domain.max(0).sum() / per_domain.sum())
    return out

  return diagnose


def _register(name: str, **changes) -> None:
  """FedIns, or (``changes``) an ablation of it registered as a variant of 'fedins'."""
  diagnostics = {} if changes.get('pool_size') == 1 else {'diagnostics': selection_diagnostics}
  own = dict(variant_of='fedins', defaults=changes) if changes else \
      dict(defaults=DEFAULTS, ranges=RANGES)
  base.ALGORITHMS.register(name, check=check(name), models=('vit',), **own, **diagnostics)(build)


_register('fedins')
_register('fedins_ssf', pool_size=1, top_c=1, key_loss_weight=0.0)   # Table 2: SSF
_register('fedins_batch_query', query='batch')                        # pool, no instance query
