"""ATP training: learning the per-module adaptation rates α on labelled source
clients (Bao, Wei, Wang & He, NeurIPS 2023, Algorithm 1), inside the compiled round.

  client i, per batch (X, Y):   h ← h(θ_G, X)                    (Eq. 4–5, unlabelled X)
                                θ' ← θ_G − α ⊙ h
                                α ← α − η · s ⊙ ∂CE(f(X; θ'), Y)/∂α
  server:                       α ← (1/C) Σ_i α_i                 (unweighted mean)

with s = 1/sqrt(numel) per module (the authors' default; 'none', 'numel' optional)
and η = 0.1 (SGD). The global model θ_G stays fixed; ATP trains only α. Per round a
source client takes ``atp.local_steps`` steps (the authors' code: 2 steps of batch 20,
one pass over its 40 held-out samples).

Registered as 'atp': its builder needs the pretrained global model θ_G
(``BuildContext.global_variables``), which the 'atp' pipeline trains first.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax

from fedjax_shift.algorithms import base
from fedjax_shift.core.algorithm import ClientOutput, FederatedAlgorithm
from fedjax_shift.core.local import LocalSchedule, local_train
from fedjax_shift.parts import atp_rates as atp_adapter
from fedjax_shift.parts import trees
from fedjax_shift.registry import (NONNEGATIVE_INT, POSITIVE, POSITIVE_INT, one_of,
                                   require)

# config.atp: α training (Algorithm 1; the authors' code for what the paper leaves out).
DEFAULTS = {
    'rounds': 400,                # CNN: 400 rounds (ResNet-18: 200)
    'cohort_size': 60,            # 25 % of the 240 source clients
    'optimizer': 'sgd',
    'learning_rate': 0.1,         # lr_α = 0.1
    'scaling': 'sqrt',            # ∂CE/∂α_i / sqrt(numel_i) ('none', 'numel')
    'batch_size': 20,             # batch 20
    'local_epochs': 1,            # one pass over the client's 40 held-out samples
    'local_steps': 0,             # > 0: fixed α steps per round instead
    # α's gradient through the clamp of adapted variances at 0 (parts/atp_rates.py):
    # 'straight_through' as the authors' code, or 'zero' (the clamp's own derivative).
    'variance_clamp': 'straight_through',
}


RANGES = {
    'rounds': POSITIVE_INT,
    'cohort_size': POSITIVE_INT,       # and <= data.num_clients (the atp pipeline)
    'optimizer': one_of(*base.CLIENT_OPTIMIZERS),
    'learning_rate': POSITIVE,
    'scaling': one_of(*atp_adapter.SCALINGS),
    'batch_size': POSITIVE_INT,
    'local_epochs': NONNEGATIVE_INT,   # 0 with local_steps > 0
    'local_steps': NONNEGATIVE_INT,    # 0: local_epochs
    'variance_clamp': one_of(*atp_adapter.VARIANCE_CLAMPS),
}


def check(hparams: ml_collections.ConfigDict) -> None:
  """config.atp's schedule: epochs or steps (errors name the field)."""
  require(hparams.local_epochs >= 1 or hparams.local_steps >= 1, 'atp.local_epochs',
          'need local_epochs >= 1 or local_steps >= 1')


class ATPServerState(NamedTuple):
  variables: Any      # θ_G, frozen
  alpha: Any          # one scalar per module
  opt_state: Any      # server optimizer over α (plain averaging: SGD lr 1)
  round: jax.Array


def alpha_client(hparams: ml_collections.ConfigDict) -> dict:
  """α training's ``config.client`` fields, from ``config.atp``: its optimizer, rate
  and schedule, no momentum, weight decay, clip or augmentation (Algorithm 1's plain
  SGD on α). The engine builds the local optimizer and schedule from them, as for
  any method, and the round's plan follows them."""
  return {'optimizer': hparams.optimizer, 'learning_rate': hparams.learning_rate,
          'momentum': 0.0, 'weight_decay': 0.0, 'clip_norm': 0.0,
          'batch_size': hparams.batch_size, 'local_epochs': hparams.local_epochs,
          'local_steps': hparams.local_steps, 'augmentation': ()}


def alpha_optimizer(client_optimizer: optax.GradientTransformation, variables, scaling: str,
                    key: str = '') -> optax.GradientTransformation:
  """α's optimizer: the per-module gradient scaling s (``scaling``) chained before
  ``client_optimizer``. ``key``: α sits under it in the optimized tree ({key: α}, as
  learned_rates holds it)."""
  scale = atp_adapter.gradient_scale(variables, scaling)
  if key:
    scale = {key: scale}
  scale_tx = optax.stateless(lambda updates, params: jax.tree.map(jnp.multiply, updates, scale))
  return optax.chain(scale_tx, client_optimizer)


def atp_training(module, global_variables, schedule: LocalSchedule,
                 client_optimizer: optax.GradientTransformation, scaling: str = 'sqrt',
                 variance_clamp: str = 'straight_through') -> FederatedAlgorithm:
  """α-training algorithm around the pretrained ``global_variables``: each client runs
  ``schedule`` with ``client_optimizer`` after α's ``scaling`` (``alpha_optimizer``);
  ``variance_clamp``: α's gradient through the clamp of adapted variances.

  ServerState is ``ATPServerState``; ``global_model`` returns θ_G (α is evaluated
  by the test-time adapters, not by the training loop).
  """
  server_opt = optax.sgd(1.0)

  def init(rng, example_x):
    del rng, example_x
    alpha = atp_adapter.init_alpha(global_variables)
    return ATPServerState(global_variables, alpha, server_opt.init(alpha), jnp.int32(0))

  def client_update(server_state, client_state, data, rng):
    variables = server_state.variables

    def loss_fn(alpha, model_state, x, y, weight, step_rng):
      del step_rng
      h, _ = atp_adapter.update_direction(module, variables, x, weight)
      return atp_adapter.alpha_loss(module, variables, alpha, h, x, y, weight,
                                    variance_clamp), model_state

    optimizer = alpha_optimizer(client_optimizer, variables, scaling)
    alpha, _, _, metrics = local_train(loss_fn, optimizer, server_state.alpha, (), data, rng,
                                       schedule)
    return ClientOutput(trees.tree_sub(alpha, server_state.alpha), metrics), client_state

  def server_update(state: ATPServerState, outputs: ClientOutput, weights) -> ATPServerState:
    mean_delta = trees.weighted_sum(outputs.update, weights)
    updates, opt_state = server_opt.update(jax.tree.map(jnp.negative, mean_delta),
                                           state.opt_state, state.alpha)
    return ATPServerState(state.variables, optax.apply_updates(state.alpha, updates),
                          opt_state, state.round + 1)

  return FederatedAlgorithm(
      init=init, init_client_state=lambda server_state: (),
      client_update=client_update, server_update=server_update,
      personalize=None, global_model=lambda server_state: server_state.variables)


@base.ALGORITHMS.register('atp', defaults=DEFAULTS, ranges=RANGES, check=check,
                          pretrained_model=True, client=alpha_client)
def atp(hparams: ml_collections.ConfigDict, context: base.BuildContext) -> FederatedAlgorithm:
  """The registry's builder: α training around ``context.global_variables``, with the
  engine's schedule and optimizer of ``config.atp`` (registered ``client=alpha_client``)."""
  if context.global_variables is None:
    raise ValueError('atp trains the adaptation rates of a pretrained global model: run '
                     "it in config.pipeline='atp', which pretrains that model first")
  return atp_training(context.module, context.global_variables, context.schedule,
                      context.client_optimizer, hparams.scaling, hparams.variance_clamp)
