"""FedTHE's test-time head ensemble (Jiang & Lin, ICLR 2023; the authors' THE_worker)
and FedTHE+ (the ensemble followed by MEMO-style fine-tuning), on models trained by
``algorithms/fedthe.py``.

Per test batch, for every sample i with encoder feature f_i, global-head logits g_i
and personal-head logits p_i:

  history  h_i = α f_i + (1 − α) h_{i−1} over the test stream (α = 0.1), h_0 = f_0;
           ``history='official'`` (the authors' code): a later batch's first row takes
           the previous batch's last h unchanged, its own f unused; 'continuous': every
           row enters the average
  feature  r_i = β f_i + (1 − β) h_i (β = 0.1, the authors' THE_beta)
  ensemble ŷ_i = e_i g_i + (1 − e_i) p_i, (e_i, 1 − e_i) = softmax(w_i), w_i = log(½, ½)
  loss     mean_i  s_i H(softmax ŷ_i) + (1 − s_i)(e_i ‖r_i − f_G‖ + (1 − e_i) ‖r_i − f_k‖)
           with s_i = cos(softmax g_i, softmax p_i) (no gradient)

``steps`` Adam steps (lr 0.1: 10× the round's lr in the authors' code) on w, stopping
once its gradient norm is below 1e-5; the prediction is ŷ with the learned e. Run it
in mode 'online' so the history carries over batches (the weights w restart at every
batch, as in the authors' code). ``initial_global_weight`` sets e before the steps; with
``steps = 0`` the prediction is that fixed mixture (1: the global head, 0: the personal
head).

FedTHE+ (``tune_steps`` > 0): then, per sample with its e fixed, ``tune_steps`` SGD
steps (lr 0.0005) on the marginal entropy of ŷ over ``num_augmentations`` = 16
augmentations, tuning the encoder and both heads, restarting from the trained model for
every sample; the sample is predicted with its tuned model.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_shift import models
from fedjax_shift.parts.losses import entropy
from fedjax_shift.adapters.memo import marginal_entropy
from fedjax_shift.parts.fedthe_extras import EXTRA
from fedjax_shift.core.local import masked_mean
from fedjax_shift.core.test_time import ADAPTERS, Adapter, register_constructor
from fedjax_shift.data.augment import augment_many
from fedjax_shift.registry import FRACTION, NONNEGATIVE_INT, POSITIVE, POSITIVE_INT, one_of

GRADIENT_TOLERANCE = 1e-5   # authors' code: stop when ‖∇w‖ < 1e-5


class EnsembleState(NamedTuple):
  variables: dict
  history: jax.Array       # [F] h of the last test sample seen
  has_history: jax.Array   # [] bool
  rng: jax.Array


def ensemble_logits(global_logits, personal_logits, global_weight):
  """ŷ = e g + (1 − e) p. global_weight: [B] (or scalar) e."""
  weight = jnp.asarray(global_weight)[..., None]
  return weight * global_logits + (1.0 - weight) * personal_logits


def two_heads(module, variables, x):
  """(features [B, F], global-head logits [B, C], personal-head logits [B, C])."""
  features = models.features(module, variables, x)
  return (features, models.head({'params': {'head': variables[EXTRA]['global_head']}}, features),
          models.head(variables, features))


HISTORY_RULES = ('official', 'continuous')


def check_history(rule: str, section: str = 'config.adapters.fedthe') -> None:
  """A ValueError naming ``<section>.history`` (or the function) unless ``rule`` is in HISTORY_RULES."""
  if rule not in HISTORY_RULES:
    raise ValueError(f'{section}.history: choose from {list(HISTORY_RULES)}, got {rule!r}')


def feature_history(features, weight, history, has_history, alpha: float,
                    rule: str = 'official'):
  """h over the batch (rows with weight 0 leave it unchanged): ([B, F], last h, has).
  ``rule`` (HISTORY_RULES): 'official' starts a batch that follows another from the
  previous last h without its first row's feature (the authors' THE_worker); the
  'continuous' EMA takes every row."""
  check_history(rule)

  def body(carry, row):
    last, has, started = carry
    feature, real = row
    new = jnp.where(has, alpha * feature + (1.0 - alpha) * last, feature)
    if rule == 'official':   # the batch's first row carries the previous batch's h over
      new = jnp.where(has & ~started, last, new)
    new = jnp.where(real > 0, new, last)
    return (new, has | (real > 0), started | (real > 0)), new

  (last, has, _), per_row = jax.lax.scan(body, (history, has_history, jnp.asarray(False)),
                                         (features, weight))
  return per_row, last, has


RANGES = {
    'learning_rate': POSITIVE,
    'steps': NONNEGATIVE_INT,                # 0: the fixed initial_global_weight mixture
    'alpha': FRACTION, 'beta': FRACTION,
    'initial_global_weight': FRACTION,       # 1: the global head, 0: the personal head
    'history': one_of(*HISTORY_RULES),
    'tune_steps': NONNEGATIVE_INT,           # 0: no FedTHE+ tuning
    'tune_learning_rate': POSITIVE, 'num_augmentations': POSITIVE_INT,
}


@register_constructor('fedthe', ranges=RANGES, trained_by=('fedthe',),
                      adapts_models=('personalized',))
def fedthe_adapter(module, learning_rate: float = 0.1, steps: int = 20, alpha: float = 0.1,
                   beta: float = 0.1, initial_global_weight: float = 0.5,
                   history: str = 'official', tune_steps: int = 0,
                   tune_learning_rate: float = 0.0005, num_augmentations: int = 16) -> Adapter:
  """FedTHE's two-head ensemble, the authors' code's values: ``steps`` (THE_steps = 20)
  Adam steps of ``learning_rate`` (0.1: 10 × the round's 0.01) on the per-sample head
  weights from ``initial_global_weight`` (0.5: softmax of (1, 1)); feature history EMA
  ``alpha`` (THE_alpha 0.1), mixing ``beta`` (THE_beta 0.1, parameters.py), rule
  ``history`` (HISTORY_RULES); then FedTHE+'s tuning of each sample, ``tune_steps``
  marginal-entropy SGD steps (0: FedTHE, none) of ``tune_learning_rate`` (0.0005) over
  ``num_augmentations`` (16) views."""
  check_history(history, 'fedthe_adapter')
  if steps < 0 or tune_steps < 0:
    raise ValueError(f'fedthe_adapter: steps and tune_steps must be >= 0, got {steps}, '
                     f'{tune_steps}')
  if not 0.0 <= initial_global_weight <= 1.0:
    raise ValueError(f'fedthe_adapter: initial_global_weight must be in [0, 1], got '
                     f'{initial_global_weight}')
  opt = optax.adam(learning_rate)
  initial = jnp.log(jnp.array([initial_global_weight, 1.0 - initial_global_weight]))

  def init(variables, rng):
    if EXTRA not in variables:
      raise ValueError('the fedthe adapter needs a model trained by fedthe (it has no '
                       'global head, client feature and global feature)')
    width = variables[EXTRA]['local_feature'].shape[-1]
    return EnsembleState(variables, jnp.zeros((width,)), jnp.asarray(False), rng)

  def learn_weights(features, g, p, history, weight, extra):
    rep = beta * features + (1.0 - beta) * history
    global_gap = jnp.linalg.norm(rep - extra['global_feature'], axis=-1)
    local_gap = jnp.linalg.norm(rep - extra['local_feature'], axis=-1)
    g_prob, p_prob = jax.nn.softmax(g), jax.nn.softmax(p)
    sim = jnp.sum(g_prob * p_prob, -1) / jnp.maximum(
        jnp.linalg.norm(g_prob, axis=-1) * jnp.linalg.norm(p_prob, axis=-1), 1e-6)

    def loss_fn(w):
      e = jax.nn.softmax(w)
      mixed = ensemble_logits(g, p, e[:, 0])
      per_sample = sim * entropy(mixed) + (1.0 - sim) * (e[:, 0] * global_gap +
                                                        e[:, 1] * local_gap)
      return masked_mean(per_sample, weight)

    def body(carry, _):
      w, opt_state, done = carry
      grads = jax.grad(loss_fn)(w)
      done = done | (jnp.linalg.norm(grads) < GRADIENT_TOLERANCE)   # grads: [B, 2]
      updates, new_opt_state = opt.update(grads, opt_state, w)
      new_w = optax.apply_updates(w, updates)
      keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(done, b, a), new, old)
      return (keep(new_w, w), keep(new_opt_state, opt_state), done), None

    w = jnp.broadcast_to(initial, (features.shape[0], 2))
    if steps:
      (w, _, _), _ = jax.lax.scan(body, (w, opt.init(w), jnp.asarray(False)), None,
                                  length=steps)
    return jax.nn.softmax(w)[:, 0]

  def tune_one(variables, x, global_weight, key):
    """FedTHE+: the sample's prediction after ``tune_steps`` marginal-entropy steps."""
    tuned = {'params': variables['params'], 'global_head': variables[EXTRA]['global_head']}
    rest = {k: v for k, v in variables.items() if k != 'params'}

    def assemble(tuned):
      return {**rest, 'params': tuned['params'],
              EXTRA: {**variables[EXTRA], 'global_head': tuned['global_head']}}

    for index in range(tune_steps):
      views = augment_many(jax.random.fold_in(key, index), x, num_augmentations)
      loss = lambda t: marginal_entropy(ensemble_logits(*two_heads(module, assemble(t), views)[1:],
                                                        global_weight))
      grads = jax.grad(loss)(tuned)
      tuned = jax.tree.map(lambda a, b: a - tune_learning_rate * b, tuned, grads)
    _, g, p = two_heads(module, assemble(tuned), x[None])
    return ensemble_logits(g, p, global_weight)[0]

  def step(state: EnsembleState, batch):
    rng, tune_key = jax.random.split(state.rng)
    variables = state.variables
    features, g, p = two_heads(module, variables, batch.x)
    per_row, last, has_history = feature_history(features, batch.weight, state.history,
                                                 state.has_history, alpha, history)
    global_weight = learn_weights(features, g, p, per_row, batch.weight, variables[EXTRA])
    if tune_steps:
      keys = jax.random.split(tune_key, batch.x.shape[0])
      logits = jax.vmap(tune_one, (None, 0, 0, 0))(variables, batch.x, global_weight, keys)
    else:
      logits = ensemble_logits(g, p, global_weight)
    return EnsembleState(variables, last, has_history, rng), logits

  return Adapter(init, step)


# FedTHE+ is FedTHE followed by the tuning: _test_time_tune's num_steps = 3 in the
# authors' code.
ADAPTERS.register('fedthe_plus', variant_of='fedthe', defaults={'tune_steps': 3},
                  trained_by=('fedthe',), adapts_models=('personalized',))(
                      ADAPTERS.get('fedthe'))
