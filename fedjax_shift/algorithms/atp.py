"""ATP training: learning the per-module adaptation rates α on labelled source
clients (atp.txt, Algorithm 1), inside the compiled round.

  client i, per batch (X, Y):   h ← h(θ_G, X)                    (Eq. 4–5, unlabelled X)
                                θ' ← θ_G − α ⊙ h
                                α ← α − η · s ⊙ ∂CE(f(X; θ'), Y)/∂α
  server:                       α ← (1/C) Σ_i α_i                 (unweighted mean)

with s = 1/sqrt(numel) per module (the authors' default; 'none', 'numel' optional)
and η = 0.1 (SGD). The global model θ_G stays fixed; ATP trains only α. Per round a
source client takes ``atp.local_steps`` steps (REFERENCE.md: 2 steps of batch 20,
one pass over its 40 held-out samples).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax

from fedjax_shift.adapters import atp as atp_adapter
from fedjax_shift.algorithms import base
from fedjax_shift.core.algorithm import ClientOutput, FederatedAlgorithm
from fedjax_shift.core.local import LocalSchedule, local_train

OPTIMIZERS = ('sgd', 'adam')


class ATPServerState(NamedTuple):
  variables: Any      # θ_G, frozen
  alpha: Any          # one scalar per module
  opt_state: Any      # server optimizer over α (plain averaging: SGD lr 1)
  round: jax.Array


def alpha_optimizer(atp_config: ml_collections.ConfigDict, variables, key: str = ''
                    ) -> optax.GradientTransformation:
  """The client's α optimizer: per-module gradient scaling, then SGD/Adam. ``key``:
  α sits under it in the optimized tree ({key: α}, as learned_rates holds it)."""
  scale = atp_adapter.gradient_scale(variables, atp_config.scaling)
  if key:
    scale = {key: scale}
  scale_tx = optax.stateless(lambda updates, params: jax.tree.map(jnp.multiply, updates, scale))
  if atp_config.optimizer == 'sgd':
    inner = optax.sgd(atp_config.learning_rate)
  elif atp_config.optimizer == 'adam':
    inner = optax.adam(atp_config.learning_rate)
  else:
    raise ValueError(f'atp.optimizer: unknown {atp_config.optimizer!r}; choose from {OPTIMIZERS}')
  return optax.chain(scale_tx, inner)


def atp_training(atp_config: ml_collections.ConfigDict, module, max_examples: int,
                 global_variables, unroll: int = 1) -> FederatedAlgorithm:
  """α-training algorithm around the pretrained ``global_variables``, from the
  ``config.atp`` section (optimizer, learning_rate, scaling, batch_size,
  local_epochs, local_steps).

  ServerState is ``ATPServerState``; ``global_model`` returns θ_G (α is evaluated
  by the test-time adapters, not by the training loop).
  """
  schedule = LocalSchedule(batch_size=atp_config.batch_size, num_epochs=atp_config.local_epochs,
                           num_steps=atp_config.local_steps, max_examples=max_examples,
                           unroll=unroll)
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
                                    atp_config.variance_clamp), model_state

    alpha, _, _, metrics = local_train(loss_fn, alpha_optimizer(atp_config, variables),
                                       server_state.alpha, (), data, rng, schedule)
    return ClientOutput(base.tree_sub(alpha, server_state.alpha), metrics), client_state

  def server_update(state: ATPServerState, outputs: ClientOutput, weights) -> ATPServerState:
    mean_delta = base.weighted_sum(outputs.update, weights)
    updates, opt_state = server_opt.update(jax.tree.map(jnp.negative, mean_delta),
                                           state.opt_state, state.alpha)
    return ATPServerState(state.variables, optax.apply_updates(state.alpha, updates),
                          opt_state, state.round + 1)

  return FederatedAlgorithm(
      init=init, init_client_state=lambda server_state: (),
      client_update=client_update, server_update=server_update,
      personalize=None, global_model=lambda server_state: server_state.variables)
