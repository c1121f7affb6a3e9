"""Learned adaptation rates: any registered adapter's rates trained by
gradient through its test-time ``lax.scan``, federatedly, like ATP's α.

An adapter declares what it can learn when it registers,
``ADAPTERS.register(..., learnable={'learning_rate': 'log_per_bn_layer'})``, one
parameterisation per hyperparameter, so a learned rate stays in range:

  'log'               one positive scalar r = exp(u); u starts at log(configured value)
                      (step sizes: EATA, SHOT, MEMO; BN-Adapt's prior strength N)
  'log_per_bn_layer'  one positive scalar per BatchNorm layer, r_l = exp(u_l) (Tent's
                      Adam rate: a layer's scale and bias share it)
  'alpha'             ATP's per-module α, unconstrained, starting at 0 (Algorithm 1)

The objective of one source client (``k_step_loss``): a stream of K consecutive test
batches of B drawn from its labelled held-out data, the adapter run over them by
``core.test_time.client_runner`` (online: the adapted state carries over; episodic:
each batch from the source model), the mean cross-entropy of the adapter's
predictions; ``jax.grad`` runs backward through all K steps. ``remat=True`` wraps the
adapter step in ``jax.checkpoint``: the backward pass recomputes each step's
activations instead of storing K steps of them (same gradient).

``rates_training`` is the federated training (ATP Algorithm 1 generalised): per round a
client takes ``local_steps`` steps on streams drawn from its held-out data (its
examples in a random order, cycled: a stream of K·B may revisit examples, all of them
scored), the server takes the unweighted mean of the clients' rates. With ATP's α,
K = 1 and the episodic mode it is ATP's α training (tests/test_learned_rates.py).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import traverse_util

from fedjax_shift import models
from fedjax_shift.adapters.common import layer_of
from fedjax_shift.core.algorithm import ClientOutput, FederatedAlgorithm
from fedjax_shift.core.local import LocalSchedule, local_train
from fedjax_shift.core.test_time import ADAPTERS, MODES, Adapter, SourceContext, client_runner
from fedjax_shift.parts import atp_rates as atp_lib
from fedjax_shift.parts.trees import tree_sub, weighted_sum

Rates = Dict[str, Any]     # learned hyperparameter name -> its unconstrained tree


class HParams(dict):
  """An adapter's hyperparameters with some replaced by traced rates: attribute access
  like the ``config.adapters.<name>`` ConfigDict the builders read."""

  def __getattr__(self, name):
    try:
      return self[name]
    except KeyError:
      raise AttributeError(name) from None


def learnable(adapter: str) -> Dict[str, str]:
  """{hyperparameter: parameterisation} the adapter registered as learnable."""
  return dict(ADAPTERS.meta(adapter).get('learnable', {}))


def check_learned(adapter: str, names: Sequence[str], hparams, mode: str, num_batches: int,
                  field: str) -> None:
  """Raises ValueError naming ``field`` (e.g. 'config.learned.rates.tent_learned') when
  ``names`` cannot be learned for this adapter, mode and K."""
  ADAPTERS.get(adapter, field)
  available = learnable(adapter)
  if not available:
    with_rates = [n for n in ADAPTERS.names() if learnable(n)]
    raise ValueError(f'{field}: the {adapter} adapter has nothing to learn; adapters with '
                     f'learnable rates: {with_rates}')
  if not names:
    raise ValueError(f'{field}: name at least one of {adapter}\'s learnable rates '
                     f'{sorted(available)}')
  unknown = [n for n in names if n not in available]
  if unknown:
    raise ValueError(f'{field}: {adapter} has no learnable rate {unknown}; it has '
                     f'{sorted(available)}')
  if 'alpha' in names and len(names) > 1:
    raise ValueError(f'{field}: ATP\'s α is trained with config.atp\'s optimizer; learn it '
                     f'alone, got {list(names)}')
  if num_batches < 1:
    raise ValueError(f'{field} (K, the number of test batches): must be >= 1, got '
                     f'{num_batches}')
  if mode not in MODES:
    raise ValueError(f'{field}: unknown test-time mode {mode!r}; choose from {list(MODES)}')
  step_sizes = [n for n in names if available[n] != 'alpha']
  if step_sizes and hparams.get('predict') == 'before' and (mode == 'episodic' or
                                                             num_batches < 2):
    raise ValueError(f'{field}: {adapter} predicts before its update (predict=\'before\'), '
                     f'so its {step_sizes} change predictions only from the second online '
                     f'batch on; use the online mode with K >= 2 (got {mode}, K = '
                     f'{num_batches})')


def batch_norm_layers(variables) -> list:
  """The BatchNorm layers of ``variables`` ('encoder/BatchNorm_0', …)."""
  flat = traverse_util.flatten_dict(variables['params'])
  return sorted({layer_of(p) for p in flat if models.is_batch_norm_path(p)})


def init_rates(adapter: str, names: Sequence[str], hparams, variables) -> Rates:
  """The unconstrained starting point of each learned name: the configured value
  (log space) or α = 0."""
  out = {}
  for name in names:
    kind = learnable(adapter)[name]
    if kind == 'alpha':
      out[name] = atp_lib.init_alpha(variables)
      continue
    value = float(hparams[name])
    if not value > 0:
      raise ValueError(f'config.adapters.{adapter}.{name}: a learned rate starts from its '
                       f'configured value in log space, which must be > 0; got {value}')
    start = jnp.log(jnp.float32(value))
    if kind == 'log':
      out[name] = start
    else:
      layers = batch_norm_layers(variables)
      if not layers:
        raise ValueError(f'learned {adapter}.{name}: one rate per BatchNorm layer needs a '
                         f'model with BatchNorm; this model has none')
      out[name] = {layer: start for layer in layers}
  return out


def constrained(adapter: str, rates: Rates) -> Rates:
  """The rates themselves: exp of the log-space ones, α as it is."""
  kinds = learnable(adapter)
  return {name: tree if kinds[name] == 'alpha' else jax.tree.map(jnp.exp, tree)
          for name, tree in rates.items()}


def flat_values(adapter: str, rates: Rates) -> Dict[str, float]:
  """{'learning_rate/encoder/BatchNorm_0': 0.0012, 'alpha/params/…': …} for json and plots."""
  out = {}
  for name, tree in constrained(adapter, rates).items():
    if learnable(adapter)[name] == 'alpha':
      items = zip(atp_lib.module_names(tree), jax.tree.leaves(tree))
    elif isinstance(tree, dict):
      items = sorted(tree.items())
    else:
      items = [('', tree)]
    for module, value in items:
      out[f'{name}/{module}' if module else name] = float(np.asarray(value))
  return out


def rated_adapter(adapter: str, module, hparams: ml_collections.ConfigDict,
                  context: SourceContext, rates: Rates) -> Adapter:
  """The registered ``adapter`` built with its learned hyperparameters replaced by
  ``rates`` (traced or concrete); α goes to the context as ATP reads it."""
  fields = HParams(hparams.to_dict() if hasattr(hparams, 'to_dict') else hparams)
  for name, value in constrained(adapter, rates).items():
    if name == 'alpha':
      context = context._replace(alpha=value)
    else:
      fields[name] = value
  return ADAPTERS.get(adapter)(module, fields, context)


def k_step_loss(adapter: Adapter, batch_size: int, variables, x: jax.Array, y: jax.Array,
                num_examples: jax.Array, rng: jax.Array, mode: str = 'online',
                remat: bool = False) -> jax.Array:
  """Mean cross-entropy of ``adapter``'s predictions over one client's test stream
  x [N, ...] (K = ceil(N / B) batches in ``mode``), differentiable in whatever the
  adapter was built from. ``remat``: recompute each step in the backward pass."""
  if remat:
    adapter = adapter._replace(step=jax.checkpoint(adapter.step))
  sums = client_runner(adapter, batch_size, mode)(variables, x, y, num_examples, rng)
  return sums['loss'] / jnp.maximum(sums['count'], 1.0)


class RatesState(NamedTuple):
  rates: Any           # the learned rates, unconstrained (log space / α)
  opt_state: Any       # server optimizer: plain averaging (SGD lr 1 on the mean delta)
  round: jax.Array


def rates_schedule(batch_size: int, num_batches: int, local_steps: int, max_examples: int,
                   unroll: Any = 1) -> LocalSchedule:
  """The local schedule of rates training: ``local_steps`` fixed steps, each on a
  stream of K·B (K = ``num_batches`` test batches of B = ``batch_size``), over clients
  padded to ``max_examples``: a client's examples in a random order, cycled."""
  if num_batches < 1:
    raise ValueError(f'learned rates: the number of test batches K must be >= 1, got '
                     f'{num_batches}')
  if local_steps < 1:
    raise ValueError(f'learned rates: local_steps must be >= 1, got {local_steps}')
  return LocalSchedule(batch_size=num_batches * batch_size, num_epochs=1,
                       num_steps=local_steps, max_examples=max_examples, unroll=unroll)


def rates_training(make_adapter: Callable[[Rates], Adapter], initial: Rates, variables,
                   optimizer: optax.GradientTransformation, schedule: LocalSchedule,
                   batch_size: int, mode: str, remat: bool = False) -> FederatedAlgorithm:
  """The federated training of an adapter's rates. Client i: ``schedule``'s steps of
  ``optimizer`` on the K-step objective (K test batches of ``batch_size``) of streams
  of K·B from its held-out data (``rates_schedule``); server: the unweighted mean of
  the clients' rates (run it with ``config.weighting='uniform'``).
  ``make_adapter(rates) -> Adapter``; ``variables`` (the trained model) stay fixed.
  Server state: ``RatesState``."""
  server_opt = optax.sgd(1.0)

  def loss_fn(rates, model_state, x, y, weight, rng):
    del weight   # fixed steps: every example of the stream is scored
    loss = k_step_loss(make_adapter(rates), batch_size, variables, x, y,
                       jnp.int32(x.shape[0]), rng, mode, remat)
    return loss, model_state

  def client_update(state, client_state, data, rng):
    rates, _, _, metrics = local_train(loss_fn, optimizer, state.rates, (), data, rng, schedule)
    return ClientOutput(tree_sub(rates, state.rates), metrics), client_state

  def server_update(state, outputs, weights):
    mean_delta = weighted_sum(outputs.update, weights)
    updates, opt_state = server_opt.update(jax.tree.map(jnp.negative, mean_delta),
                                           state.opt_state, state.rates)
    return RatesState(optax.apply_updates(state.rates, updates), opt_state, state.round + 1)

  return FederatedAlgorithm(
      init=lambda rng, example_x: RatesState(initial, server_opt.init(initial), jnp.int32(0)),
      init_client_state=lambda state: (), client_update=client_update,
      server_update=server_update, personalize=None, global_model=lambda state: variables)
