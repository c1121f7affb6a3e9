"""SAR: Towards Stable Test-Time Adaptation in Dynamic Wild World. Niu et al., ICLR 2023,
Eq. 2–5 and Algorithm 1.

Entropy minimisation of the normalisation layers' affine parameters (BatchNorm on the
test batch's statistics, as Tent; GroupNorm and LayerNorm too), made stable by
  * reliable-sample filtering: only examples with entropy E < E0 = 0.4·ln C count  (Eq. 2)
  * sharpness awareness (SAM, ρ = 0.05): the gradient g of the filtered entropy moves
    the parameters to θ + ε, ε = ρ·g / ‖g‖ (Eq. 4); at θ + ε the entropy is filtered
    again (the first filter's examples with E < E0) and its gradient steps the
    parameters from θ with SGD (Eq. 5)
  * model recovery: e_m ← 0.9·e_m + 0.1·(the second filtered entropy), and when
    e_m < 0.2 the parameters return to the source model's.
As the authors' code (github.com/mr-eggplant/SAR): SGD with momentum 0.9 at 0.00025 for
ResNets at batch 64 (their lr for batches under 32 is 0.00025·2B/64), predictions the
logits before the batch's update, the moving average and the SGD momentum kept across a
recovery (their reset reloads the model and SAM's own state, not its base SGD's
momentum buffers), every normalisation layer adapted (theirs leaves out a ResNet's
layer4 and a ViT's last blocks, which this library's models do not have by those names).
A batch whose filters keep no example takes no step (the parameters and the momentum
stay as they were; the authors' SGD would still move by its momentum there) and is
counted out of ``adapted_batches``; the moving average is not updated by it.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_shift import models
from fedjax_shift.adapters import common
from fedjax_shift.core.local import masked_mean, select
from fedjax_shift.core.test_time import Adapter, SourceContext, register_constructor, whole_context
from fedjax_shift.parts import losses
from fedjax_shift.registry import BOOL, OPEN_FRACTION, POSITIVE, interval


def is_norm_path(path) -> bool:
  """A flat parameter path inside a BatchNorm, GroupNorm or LayerNorm layer."""
  return any(kind in str(part) for part in path for kind in ('BatchNorm', 'GroupNorm',
                                                             'LayerNorm'))


class SARState(NamedTuple):
  variables: dict
  opt_state: optax.OptState
  loss_average: jax.Array   # [] e_m, NaN before the first adapted batch
  stepped: jax.Array        # [] bool: the last batch changed the model
  source: dict              # the source variables, for recovery


def sharpness_step(objective, selected, rho: float):
  """SAM's two gradients (Foret et al., ICLR 2021, as SAR's code: ε = ρ·g/(‖g‖ + 1e-12))
  of ``objective(params, first_aux) -> (loss, aux)``, called at θ with None and at θ + ε
  with the first call's aux: (the first (loss, aux), the gradient at θ + ε, the second
  (loss, aux))."""
  (loss, aux), grads = jax.value_and_grad(objective, has_aux=True)(selected, None)
  norm = optax.tree_utils.tree_norm(grads)
  perturbed = jax.tree.map(lambda p, g: p + rho * g / (norm + 1e-12), selected, grads)
  (loss2, aux2), grads2 = jax.value_and_grad(objective, has_aux=True)(perturbed, aux)
  return (loss, aux), grads2, (loss2, aux2)


def learning_rate_for(base: float, batch_size: int) -> float:
  """The authors' ResNet rate: ``base`` at batches of 32 and more, base·2B/64 below."""
  return base if batch_size >= 32 else base * 2 * batch_size / 64


@register_constructor(
    'sar', from_context={'source': whole_context},
    ranges={'learning_rate': POSITIVE, 'momentum': interval(0, 1, high_open=True),
            'entropy_margin': OPEN_FRACTION, 'rho': POSITIVE,
            'reset_threshold': interval(0), 'average_rate': interval(0, 1, high_open=True),
            'scale_with_batch': BOOL},
    learnable={'learning_rate': 'log'}, streams=True)
def sar(module, source: SourceContext, learning_rate: float = 0.00025, momentum: float = 0.9,
        entropy_margin: float = 0.4, rho: float = 0.05, reset_threshold: float = 0.2,
        average_rate: float = 0.9, scale_with_batch: bool = True) -> Adapter:
  """SAR on ``source``'s test batch B and C classes: SGD at ``learning_rate`` (the
  authors' 0.00025; ``scale_with_batch``: their 0.00025·2B/64 under B = 32) with
  ``momentum`` 0.9; E0 = ``entropy_margin``·ln C (0.4); SAM radius ``rho`` 0.05; recovery
  when the moving average (rate ``average_rate`` 0.9) falls under ``reset_threshold``
  0.2 (0: never)."""
  if scale_with_batch:
    learning_rate = learning_rate_for(learning_rate, source.batch_size)
  margin = entropy_margin * float(np.log(source.num_classes))
  optimizer = optax.sgd(learning_rate, momentum=momentum or None)
  field = 'sar (normalisation affine parameters)'

  def forward(variables, x):
    return models.apply(module, variables, x, 'batch_stats')[0]

  def init(variables, rng):
    del rng
    selected, _ = common.split_params(variables['params'], is_norm_path, field)
    opt_state = optimizer.init(selected)
    return SARState(variables, opt_state, jnp.float32(jnp.nan), jnp.bool_(False), variables)

  def step(state: SARState, batch):
    selected, rest = common.split_params(state.variables['params'], is_norm_path, field)

    def objective(selected, first):
      logits = forward({**state.variables, 'params': common.join_params(selected, rest)},
                       batch.x)
      ents = losses.entropy(logits)
      keep = (ents < margin) & (batch.weight > 0)
      if first is not None:   # Eq. 5: of the first filter's examples
        keep = keep & first[0]
      return masked_mean(ents, keep.astype(jnp.float32)), (keep, logits)

    (_, (first, logits)), grads, (second_loss, (second, _)) = sharpness_step(
        objective, selected, rho)
    updates, opt_state = optimizer.update(grads, state.opt_state, selected)
    go = jnp.any(second)
    keep_old = lambda new, old: jnp.where(go, new, old)
    selected = jax.tree.map(keep_old, optax.apply_updates(selected, updates), selected)
    opt_state = jax.tree.map(keep_old, opt_state, state.opt_state)
    average = jnp.where(jnp.isnan(state.loss_average), second_loss,
                        average_rate * state.loss_average + (1 - average_rate) * second_loss)
    average = jax.lax.stop_gradient(jnp.where(go, average, state.loss_average))
    variables = {**state.variables, 'params': common.join_params(selected, rest)}
    variables = select(average < reset_threshold, state.source, variables)
    del first
    return SARState(variables, opt_state, average, go, state.source), logits

  return Adapter(init, step, lambda state, batch: forward(state.variables, batch.x),
                 took_step=lambda state: state.stepped)
