"""Adaptation rates as differentiable inputs (issue 18, first part): an adapter built
from traced rates, and the K-step test-time objective differentiated through the
``lax.scan`` of ``core.test_time.client_runner``.

Tent with one learning rate per BatchNorm layer (scale and bias of a layer share it),
parameterised in log space so every rate stays positive: rate_l = exp(log_rate_l). Its
step is Adam's direction times −rate_l, so with every log-rate at log(η) it is Tent with
Adam(η) (tests/test_learned_rates.py).

The objective of a client's K consecutive test batches (online: the adapted state carries
over) is the mean cross-entropy of the adapter's predictions; ``jax.grad`` of it w.r.t.
the rates runs backward through all K steps. ``remat=True`` wraps the adapter step in
``jax.checkpoint`` so the backward pass recomputes each step's activations instead of
storing them (same gradient).

``rates_training`` trains rates federatedly on source clients' held-out data, one
compiled call per round through the engine. Not yet in the registry or a pipeline: the
learned-rates rows of the test-time pipeline, the other adapters' rates and ATP-online
through K batches are still to build.
"""
from __future__ import annotations

from typing import Dict, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from fedjax_shift import models
from fedjax_shift.adapters.tent import tent
from fedjax_shift.algorithms import base
from fedjax_shift.core.algorithm import ClientOutput, FederatedAlgorithm
from fedjax_shift.core.test_time import Adapter, client_runner

LogRates = Dict[str, jax.Array]   # BatchNorm layer path 'encoder/BatchNorm_0' -> [] log-rate


def layer_of(path) -> str:
  """The BatchNorm layer a flat parameter path belongs to ('encoder/BatchNorm_0')."""
  return '/'.join(str(part) for part in path[:-1])


def init_log_rates(variables, learning_rate: float) -> LogRates:
  """log(``learning_rate``) for every BatchNorm layer of ``variables``."""
  flat = traverse_util.flatten_dict(variables['params'])
  layers = sorted({layer_of(p) for p in flat if models.is_batch_norm_path(p)})
  if not layers:
    raise ValueError('learned Tent rates need a model with BatchNorm; this model has none')
  return {layer: jnp.log(jnp.asarray(learning_rate, jnp.float32)) for layer in layers}


def per_layer_adam(log_rates: LogRates) -> optax.GradientTransformation:
  """Adam's direction scaled by −exp(log_rate) of each parameter's layer; updates are
  the flat {path: leaf} dicts of ``common.gradient_adapter``."""
  def scale(updates, params=None):
    del params
    return {path: -jnp.exp(log_rates[layer_of(path)]).astype(u.dtype) * u
            for path, u in updates.items()}
  return optax.chain(optax.scale_by_adam(), optax.stateless(scale))


def rated_tent(module, log_rates: LogRates, predict: str = 'before') -> Adapter:
  """Tent whose BatchNorm layers adapt at the rates exp(``log_rates``)."""
  return tent(module, predict=predict, optimizer=per_layer_adam(log_rates))


def k_step_loss(adapter: Adapter, batch_size: int, variables, x: jax.Array, y: jax.Array,
                num_examples: jax.Array, rng: jax.Array, remat: bool = False) -> jax.Array:
  """Mean cross-entropy of ``adapter``'s predictions over one client's test stream x
  [N, ...] (K = ceil(N / B) online batches), differentiable in whatever the adapter was
  built from. ``remat``: recompute each step in the backward pass."""
  if remat:
    adapter = Adapter(adapter.init, jax.checkpoint(adapter.step))
  sums = client_runner(adapter, batch_size, 'online')(variables, x, y, num_examples, rng)
  return sums['loss'] / jnp.maximum(sums['count'], 1.0)


def client_stream(x: jax.Array, mask: jax.Array, num_examples: jax.Array, num_batches: int,
                  batch_size: int, rng: jax.Array):
  """K = ``num_batches`` consecutive test batches from one client's labelled held-out
  data x [N, ...]: its real examples in a random order (``rng``), wrapped when it has
  fewer than K·B. Returns (indices [K·B], scored count [])."""
  order = jnp.argsort(jnp.where(mask, jax.random.uniform(rng, mask.shape), 2.0))
  length = num_batches * batch_size
  positions = jnp.arange(length) % jnp.maximum(num_examples, 1)
  return order[positions], jnp.minimum(num_examples, length)


def rates_training(make_adapter, init_rates, variables, batch_size: int, num_batches: int,
                   learning_rate: float, local_steps: int = 1, remat: bool = False):
  """The federated training of an adapter's rates (ATP's α training generalised):
  client i takes ``local_steps`` SGD steps on the K-step objective of streams drawn from
  its held-out data, rates ← rates − η ∇ k_step_loss; the server takes the round's
  weighted mean of the rates (``config.weighting='uniform'``: the unweighted mean).
  ``make_adapter(rates) -> Adapter``; ``variables`` (the trained model) stay fixed.
  Returns a ``FederatedAlgorithm`` whose server state is ``RatesState``."""
  if num_batches < 1:
    raise ValueError(f'learned rates: the number of test batches K must be >= 1, got '
                     f'{num_batches}')
  if local_steps < 1:
    raise ValueError(f'learned rates: local_steps must be >= 1, got {local_steps}')

  def loss(rates, data, rng):
    indices, count = client_stream(data.x, data.mask, data.num_examples, num_batches,
                                   batch_size, rng)
    return k_step_loss(make_adapter(rates), batch_size, variables, data.x[indices],
                       data.y[indices], count, jax.random.fold_in(rng, 1), remat)

  def client_update(state, client_state, data, rng):
    rates = state.rates
    for step in range(local_steps):
      grads = jax.grad(loss)(rates, data, jax.random.fold_in(rng, step))
      grads = jax.tree.map(lambda g: jnp.where(data.num_examples > 0, g, 0.0), grads)
      rates = jax.tree.map(lambda r, g: r - learning_rate * g, rates, grads)
    return ClientOutput(base.tree_sub(rates, state.rates), {}), client_state

  def server_update(state, outputs, weights):
    mean_delta = base.weighted_sum(outputs.update, weights)
    return RatesState(jax.tree.map(jnp.add, state.rates, mean_delta), state.round + 1)

  return FederatedAlgorithm(
      init=lambda rng, example_x: RatesState(init_rates, jnp.int32(0)),
      init_client_state=lambda state: (), client_update=client_update,
      server_update=server_update, personalize=None, global_model=lambda state: variables)


class RatesState(NamedTuple):
  rates: dict          # the learned rates (e.g. Tent's per-layer log-rates)
  round: jax.Array
