"""FedTTA's personalisation of a new client at test time (Ye et al., UPFL 2023 Eq. 11) and
FedTTA++'s entropy early stopping (Sec. 3.3.2, Algorithm 1).

On each test batch X, from the global base model ψ_0 = ψ and adaptation model φ (trained
by ``algorithms/fedtta.py``; read from the 'fedtta_adaptation' collection):

  ψ_e = ψ_{e−1} − η_inner ∇_ψ ‖g(f(X; ψ_{e−1}); φ)‖₂,   e = 1 … E

FedTTA: E = 1. FedTTA++: up to E = 50 steps; H_e is the mean prediction entropy of
f(X; ψ_e) (H_0 before any step). Adaptation stops after step e when H has not gone
below its lowest value for ``patience`` consecutive steps (``patience`` = 0: no early
stopping, all E steps); ``restore_best`` (FedTTA++'s default, Algorithm 1's last line)
then predicts with the lowest-entropy model among ψ_1 … ψ_stop, or, with
``include_initial`` (the authors' released code), among ψ_0 … ψ_stop; else with ψ_e.
FedTTA++'s steps clip the gradient at global norm 10 and add weight decay 1e-4, as
the authors' test loop (``clip_norm``, ``weight_decay``). The E steps are a masked
``lax.scan`` (no data-dependent Python branch; differentiable) or, with ``loop='while'``,
a ``lax.while_loop`` that stops computing at the stop. Predictions are
f(X; ψ_final) on the same batch, in episodic mode from ψ for each batch.

ℓ_per sums over the batch, so its gradient grows like √B. Training fills every batch of
B = ``config.client.batch_size`` by repeating a small client's examples; with
``fill_batch`` = B a test batch of n < B examples weights each by B / n, the expected
count of its repeats in such a batch, so the step is the one training differentiated
through (a training client's ~8 validation digits would otherwise take about a third of
it). A batch of B or more examples is taken as it is; 0 weights every example 1.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections

from fedjax_shift import models
from fedjax_shift.parts import losses
from fedjax_shift.parts.fedtta_step import ADAPTATION, InnerStep, inner_step
from fedjax_shift.core.local import select
from fedjax_shift.core.test_time import ADAPTERS, Adapter, SourceContext
from fedjax_shift.registry import (BOOL, NONNEGATIVE, NONNEGATIVE_INT, POSITIVE_INT, Range,
                                   one_of)


TRAINED_BY = ('fedtta', 'fedtta_prox')   # the methods that train g


class FedTTAState(NamedTuple):
  variables: dict   # {'params': ψ, 'fedtta_adaptation': φ}


def adaptation_module_of(adaptation_params) -> models.AdaptationMLP:
  """g's module from its parameters (hidden widths read off the kernels)."""
  layers = sorted(adaptation_params, key=lambda name: int(name.split('_')[-1]))
  return models.AdaptationMLP(tuple(adaptation_params[name]['kernel'].shape[1]
                                    for name in layers[:-1]))


def model_collections(variables) -> dict:
  """The classifier's collections besides 'params' (e.g. BatchNorm statistics, used in
  eval mode), without g's."""
  return {k: v for k, v in variables.items() if k not in ('params', ADAPTATION)}


LOOPS = ('scan', 'while')


def filled_weight(weight: jax.Array, fill_batch: int) -> jax.Array:
  """weight [B] scaled by max(1, fill_batch / Σ weight): a batch of n < fill_batch
  examples counted as if repeated to fill ``fill_batch`` entries (0: unchanged)."""
  if not fill_batch:
    return weight
  count = jnp.sum(weight)
  return weight * jnp.maximum(1.0, fill_batch / jnp.maximum(count, 1e-12))


class Adaptation(NamedTuple):
  """A new client's test-time adaptation (module docstring): Eq. 11's step repeated up
  to ``max_steps`` times, FedTTA++'s early stopping after ``patience`` steps without a
  lower entropy (0: none)."""
  step: InnerStep
  max_steps: int = 1             # E (FedTTA: 1; FedTTA++: 50)
  patience: int = 0              # 0: no early stopping
  loop: str = 'scan'             # 'scan' (masked, differentiable) | 'while' (stops)
  restore_best: bool = False     # the lowest-entropy model instead of the one at the stop
  # ... with ψ_0 among the candidates (the authors' released code); Algorithm 1 selects
  # among the steps e = 1 … E. A collapsed base is the most confident model, so with ψ_0
  # the rule can keep it.
  include_initial: bool = False
  fill_batch: int = 0            # ℓ_per's weights filled to this batch (0: as they are)


def adaptation(hparams: ml_collections.ConfigDict) -> Adaptation:
  """``config.adapters.<fedtta | fedtta_pp>`` resolved by ``for_method`` as settings."""
  return Adaptation(InnerStep(hparams.inner_learning_rate, hparams.norm_epsilon,
                              hparams.clip_norm, hparams.weight_decay),
                    hparams.max_steps, hparams.patience, hparams.loop, hparams.restore_best,
                    hparams.include_initial, int(hparams.fill_batch))


def adapt(module, variables, x: jax.Array, weight: jax.Array, settings: Adaptation):
  """(ψ, steps run [] int32) for one batch x [B, ...], weight [B] (ℓ_per's weights
  filled to ``settings.fill_batch``, see the module docstring).

  ψ is the model after the last step run, or with ``restore_best`` (and patience > 0)
  the one of lowest entropy among ψ_1 … ψ_stop (ψ_0 … ψ_stop with
  ``include_initial``). ``loop='scan'``: a masked ``lax.scan`` of E steps (steps after
  the stop compute and are discarded; reverse-differentiable). ``'while'``: a
  ``lax.while_loop`` that ends at the stop (vmapped over clients it runs until the last
  client stops; not reverse-differentiable). Both give the same ψ."""
  patience, max_steps = settings.patience, settings.max_steps
  adaptation_params = variables[ADAPTATION]
  adaptation_module = adaptation_module_of(adaptation_params)
  model_state = model_collections(variables)
  norm_weight = filled_weight(weight, settings.fill_batch)

  def entropy(params):
    if patience == 0:   # no early stopping: the entropy is never read (FedTTA's one step)
      return jnp.float32(0.0)
    logits = models.apply(module, {'params': params, **model_state}, x)[0]
    return losses.weighted_entropy(logits, weight)

  def step(carry, _=None):
    params, best, best_value, lowest, waited, stopped, steps = carry
    new_params = inner_step(module, adaptation_module, params, adaptation_params, x,
                            norm_weight, settings.step, model_state)
    value = entropy(new_params)
    improved = value < lowest          # the stopping rule's reference includes H_0
    new_waited = jnp.where(improved, 0, waited + 1)
    new_stopped = (patience > 0) & (new_waited >= patience)
    run = ~stopped
    better = run & (value < best_value)   # the candidates: ψ_1 … (and ψ_0 if included)
    return (select(run, new_params, params), select(better, new_params, best),
            jnp.where(better, value, best_value),
            jnp.where(run, jnp.minimum(value, lowest), lowest),
            jnp.where(run, new_waited, waited), stopped | new_stopped,
            steps + run.astype(jnp.int32)), None

  params = variables['params']
  initial = entropy(params)
  init = (params, params, initial if settings.include_initial else jnp.float32(jnp.inf), initial,
          jnp.int32(0), jnp.bool_(False), jnp.int32(0))
  if settings.loop == 'while':
    final = jax.lax.while_loop(lambda carry: ~carry[5] & (carry[6] < max_steps),
                               lambda carry: step(carry)[0], init)
  else:
    final, _ = jax.lax.scan(step, init, None, length=max_steps)
  params, best, _, _, _, _, steps = final
  return (best if settings.restore_best and patience > 0 else params), steps


def fedtta_adapter(module, settings: Adaptation) -> Adapter:
  def init(variables, rng):
    del rng
    if ADAPTATION not in variables:
      raise ValueError('the fedtta adapters personalise a model trained by fedtta or '
                       'fedtta_prox (its adaptation model g is missing from the variables): '
                       'list only those in config.eval_adapter_algorithms')
    return FedTTAState(variables)

  def step(state, batch):
    params, _ = adapt(module, state.variables, batch.x, batch.weight, settings)
    logits = models.apply(module, {'params': params, **model_collections(state.variables)},
                          batch.x)[0]
    return state, logits

  return Adapter(init, step)


# η_inner and ε of a section left at FROM_TRAINING are the trained method's
# (config.<fedtta | fedtta_prox>.inner_learning_rate, .norm_epsilon): Eq. 11 is the step
# Eq. 5 differentiated through. Another value needs ``override_training=True``.
FROM_TRAINING = -1.0
SHARED_WITH_TRAINING = ('inner_learning_rate', 'norm_epsilon')


def fill_batch_of(hparams, config) -> int:
  """``hparams.fill_batch``, with FROM_TRAINING read as ``config.client.batch_size``."""
  if hparams.fill_batch == FROM_TRAINING:
    return int(config.client.batch_size)
  return int(hparams.fill_batch)


def for_method(name: str, hparams, config, algorithm_name: str,
               method: ml_collections.ConfigDict):
  """``config.adapters.<name>`` for ``algorithm_name``'s models (``method``: its
  section): η_inner and ε at FROM_TRAINING replaced by the method's own; a value that
  differs from the method's is refused unless ``override_training``."""
  out = ml_collections.ConfigDict(hparams.to_dict())
  out.fill_batch = fill_batch_of(hparams, config)
  for field in SHARED_WITH_TRAINING:
    if hparams[field] == FROM_TRAINING:
      out[field] = method[field]
    elif hparams[field] != method[field] and not hparams.override_training:
      raise ValueError(
          f'config.adapters.{name}.{field}={hparams[field]} differs from '
          f'config.{algorithm_name}.{field}={method[field]}: a new client adapts with the '
          f'step {algorithm_name} was trained through (Eq. 11 = Eq. 5). Leave it at '
          f'{FROM_TRAINING} to take training\'s value, or set '
          f'config.adapters.{name}.override_training=True to adapt with '
          f'{hparams[field]} on purpose')
  return out


def or_from_training(declared: Range, meaning: str) -> Range:
  """``declared``'s values and FROM_TRAINING (``meaning``: what it stands for)."""
  def accepts(value) -> bool:
    return declared.accepts(value) or (isinstance(value, (int, float)) and
                                       not isinstance(value, bool) and value == FROM_TRAINING)
  return Range(f'{declared.description}, or {FROM_TRAINING:g} ({meaning})', accepts,
               FROM_TRAINING - 1)


RANGES = {
    'inner_learning_rate': or_from_training(NONNEGATIVE, "the trained method's"),
    'norm_epsilon': or_from_training(NONNEGATIVE, "the trained method's"),
    'fill_batch': or_from_training(NONNEGATIVE_INT, 'config.client.batch_size'),
    # E >= 1: with no step and ψ_0 excluded there is no candidate
    'max_steps': POSITIVE_INT,
    'patience': NONNEGATIVE_INT,   # 0: no early stopping
    'loop': one_of(*LOOPS),
    'restore_best': BOOL, 'include_initial': BOOL, 'override_training': BOOL,
    'clip_norm': NONNEGATIVE,      # 0: no clip
    'weight_decay': NONNEGATIVE,
}


def build(module, hparams, context: SourceContext) -> Adapter:
  """The registry's builder of both adapters, from ``config.adapters.<name>`` as
  ``for_method`` resolves it (η_inner and ε set)."""
  del context
  for field in SHARED_WITH_TRAINING + ('fill_batch',):
    if hparams[field] == FROM_TRAINING:
      raise ValueError(f'adapters.fedtta: {field} is the trained method\'s; resolve the '
                       f'section with for_method first')
  return fedtta_adapter(module, adaptation(hparams))


# The section: the settings' defaults (``Adaptation``, ``InnerStep``), but η_inner, ε and
# the batch ℓ_per's weights fill, which are the trained method's (FROM_TRAINING).
ADAPTERS.register('fedtta', defaults={
    'inner_learning_rate': FROM_TRAINING,   # η_inner: the trained method's (Eq. 11 = Eq. 5)
    'norm_epsilon': FROM_TRAINING,          # ε: the trained method's
    'override_training': False,   # True: adapt with this section's η_inner / ε
    **InnerStep._field_defaults,  # no clip, no decay: Eq. 11 = Eq. 5, the step trained through
    **{field: default for field, default in Adaptation._field_defaults.items()
       if field != 'fill_batch'},
    'fill_batch': int(FROM_TRAINING)},   # config.client.batch_size (module docstring)
    ranges=RANGES, trained_by=TRAINED_BY,
    for_method=functools.partial(for_method, 'fedtta'))(
        build)
ADAPTERS.register('fedtta_pp', variant_of='fedtta', defaults={   # what FedTTA++ changes
    'max_steps': 50,              # FedTTA++: E = 50 (Sec. 3.3.2)
    'patience': 1,                # App. table, MNIST: patience 1
    # 'while' stops computing at the stop (papers/fedtta/README.md, round costs: 50
    # clients, E ≤ 50, ~2 steps run: 0.12 s vs 1.50 s for the masked scan); 'scan' is
    # reverse-differentiable.
    'loop': 'while',
    # Algorithm 1: the lowest-entropy model among the steps run, not the one at the stop
    # (MNIST protocol, η_inner 0.5, patience 1: the model at the stop scored 80.72 % on
    # new clients, the lowest-entropy one 95.56 %; one step: 95.04 %).
    'restore_best': True,
    'clip_norm': 10.0,            # the authors' test loop: clip_grad_norm_(…, 10)
    'weight_decay': 1e-4},        # and SGD(weight_decay=1e-4)
    trained_by=TRAINED_BY,
    for_method=functools.partial(for_method, 'fedtta_pp'))(
        build)
