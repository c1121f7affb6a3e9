"""Building blocks shared by model-averaging methods (FedAvg family).

Server state, the supervised masked cross-entropy, the client optimizer and the
server step (the weighted mean of client deltas fed to an optax server optimizer:
plain averaging, FedAvgM or FedAdam; Reddi et al. 2021, Alg. 2).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import ml_collections
import optax

from fedjax_shift import models
from fedjax_shift.core.algorithm import ClientData, ClientOutput, FederatedAlgorithm
from fedjax_shift.core.local import LocalSchedule, local_train, masked_mean
from fedjax_shift.data import augment
from fedjax_shift.parts.trees import tree_sub, weighted_sum
from fedjax_shift.registry import Registry, require

PyTree = Any
SERVER_OPTIMIZERS = ('sgd', 'fedavgm', 'fedadam')
CLIENT_OPTIMIZERS = ('sgd', 'adam')


class ServerState(NamedTuple):
  variables: PyTree   # global model {'params', ['batch_stats']}
  opt_state: PyTree   # server optimizer state over params
  round: jax.Array    # [] int32, rounds applied


class BuildContext(NamedTuple):
  """What the engine prepares for an algorithm builder (besides its own config
  section ``config.<name>``).

  Attributes:
    module: the Flax classifier (encoder / head).
    client_optimizer: the local optimizer from ``config.client``.
    server_optimizer: the server optimizer from ``config.server`` (SGD lr 1 = FedAvg).
    schedule: local steps per round (batch size, epochs or steps, padded N, unroll).
    client_learning_rate: η of ``config.client`` (q-FFL's Lipschitz estimate 1/η).
    info: the ``BUILD_INFO`` fields of the benchmark's ``Benchmark.info`` that it
      has (evolving shifts: 'num_domains', 'domain_size'); {} when it has none.
    cohort_fraction: |S|/N, the cohort size over the training split's K clients
      (SCAFFOLD's server control-variate step); 1 when the caller does not say.
    num_clients: N, the training split's K clients (AFL's λ over them); 0 when the
      caller does not say.
    example_shape: one input's shape (ODPFL-HN's generated classifier); () when the
      caller does not say.
    global_variables: a pretrained global model that the method trains around
      (ATP's α); None when the caller has none.
  """
  module: Any
  client_optimizer: optax.GradientTransformation
  server_optimizer: optax.GradientTransformation
  schedule: LocalSchedule
  client_learning_rate: float
  info: dict
  cohort_fraction: float = 1.0
  num_clients: int = 0
  example_shape: tuple = ()
  global_variables: Any = None


# name -> builder(hparams: its config.<name> section, context: BuildContext)
#           -> FederatedAlgorithm; each method file registers itself with its defaults
# Meta: layout='domains' (trains on the evolving benchmarks' domain-major data);
# batch_norm=False (cannot take a model with BatchNorm statistics); pretrains=True (its
# server state is one global model ``ServerState.variables`` that another stage can
# start from); pretrained_model=True (trains around a pretrained global model,
# ``BuildContext.global_variables``); models=(...) (the models it needs); client=f (its
# local optimizer and schedule are f(its section), config.client fields, not shared).
ALGORITHMS: Registry = Registry('algorithm')


def traced(value) -> bool:
  """Whether a hyperparameter is a JAX tracer: a swept value traced on the run axis
  (pipelines/sweep.py) instead of a Python number."""
  return isinstance(value, jax.core.Tracer)


def present(value) -> bool:
  """Whether an optional term is built: a nonzero number, or a traced one (whose zero
  adds exactly nothing)."""
  return traced(value) or bool(value)


def number(value):
  """A hyperparameter as a Python float, or the tracer it is."""
  return value if traced(value) else float(value)


def client_overrides(config: ml_collections.ConfigDict, name: str) -> dict:
  """Method ``name``'s entry of ``config.client_overrides``: {field of config.client:
  value} that it trains with instead of the shared one (e.g. a paper's per-method tuned
  rate; batch 1 for a release that steps once per image), each value of its field's type
  (a swept value traced as it is); {} when the section does not name the method."""
  overrides = config.client_overrides
  if name not in overrides:
    return {}
  out = {}
  for field, value in overrides[name].items():
    shared = config.client[field]
    out[field] = (value if traced(value) or isinstance(shared, tuple) or
                  isinstance(value, bool) else type(shared)(value))
  return out


def method_client(config: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
  """``config.client`` as method ``name`` trains with it: the shared fields with its
  ``config.client_overrides.<name>`` in their place, or, for a method registered with
  ``client=f``, ``f(its section)`` (ATP's α: ``config.atp``'s optimizer and schedule);
  name '': the shared fields."""
  own = ALGORITHMS.meta(name).get('client') if name in ALGORITHMS else None
  fields = own(ALGORITHMS.section(name, config)) if own else client_overrides(config, name)
  return ml_collections.ConfigDict({**config.client.to_dict(), **fields})


def client_optimizer(client: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """config.client: optimizer ('sgd'|'adam'), learning_rate, momentum, weight_decay, and
  clip_norm (the gradient's global norm clipped first, as torch's clip_grad_norm_
  before an SGD step whose weight decay is added after it)."""
  c = client
  if c.optimizer == 'sgd':
    opt = optax.sgd(c.learning_rate, momentum=c.momentum if present(c.momentum) else None)
  elif c.optimizer == 'adam':
    opt = optax.adam(c.learning_rate)
  else:
    raise ValueError(f'config.client.optimizer: unknown {c.optimizer!r}; choose from '
                     f'{list(CLIENT_OPTIMIZERS)}')
  if present(c.weight_decay):
    opt = optax.chain(optax.add_decayed_weights(c.weight_decay), opt)
  if present(c.clip_norm):
    opt = optax.chain(clip_by_global_norm(c.clip_norm), opt)
  return opt


def clip_by_global_norm(max_norm) -> optax.GradientTransformation:
  """optax.clip_by_global_norm where ``max_norm`` may be traced (a swept value): a zero
  ``max_norm`` leaves the gradient as it is (no clip) instead of zeroing it."""
  def clip(updates, params=None):
    del params
    norm = optax.tree_utils.tree_norm(updates)
    scale = jnp.where((max_norm > 0) & (norm > max_norm),
                      max_norm / jnp.maximum(norm, jnp.finfo(jnp.float32).tiny), 1.0)
    return jax.tree.map(lambda u: (u * scale).astype(u.dtype), updates)
  return optax.stateless(clip)


def server_optimizer(server: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """config.server: optimizer 'sgd' (lr 1 = FedAvg), 'fedavgm' (momentum), 'fedadam'."""
  s = server
  if s.optimizer == 'sgd':
    return optax.sgd(s.learning_rate)
  if s.optimizer == 'fedavgm':
    return optax.sgd(s.learning_rate, momentum=s.momentum)
  if s.optimizer == 'fedadam':
    return optax.adam(s.learning_rate, b1=s.beta1, b2=s.beta2, eps=s.adam_eps)
  raise ValueError(f'config.server.optimizer: unknown {s.optimizer!r}; choose from '
                   f'{list(SERVER_OPTIMIZERS)}')


def check_client(client: ml_collections.ConfigDict, where: str = 'client') -> None:
  """A client section (``config.client``, or a method's with its overrides) as
  ``config.<where>``: optimizer, rate, batch, local schedule, augmentation, optimizer
  constants."""
  require(client.optimizer in CLIENT_OPTIMIZERS, f'{where}.optimizer',
          f'unknown {client.optimizer!r}; choose from {list(CLIENT_OPTIMIZERS)}')
  require(client.learning_rate > 0, f'{where}.learning_rate',
          f'must be > 0, got {client.learning_rate}')
  require(client.batch_size >= 1, f'{where}.batch_size', f'must be >= 1, got {client.batch_size}')
  require(client.local_epochs >= 1 or client.local_steps >= 1, f'{where}.local_epochs',
          'need local_epochs >= 1 or local_steps >= 1')
  require(client.local_steps >= 0, f'{where}.local_steps',
          f'must be >= 0, got {client.local_steps}')
  augment.check_view_names(client.augmentation, f'{where}.augmentation')
  # Optimizer constants: a momentum of 1 or more never forgets (the steps grow without
  # bound), a negative weight decay grows the weights.
  if not traced(client.momentum):
    require(0.0 <= client.momentum < 1.0, f'{where}.momentum',
            f'must be in [0, 1), got {client.momentum}')
  if not traced(client.weight_decay):
    require(client.weight_decay >= 0.0, f'{where}.weight_decay',
            f'must be >= 0, got {client.weight_decay}')
  if not traced(client.clip_norm):
    require(client.clip_norm >= 0.0, f'{where}.clip_norm',
            f'must be >= 0 (0: no clip), got {client.clip_norm}')


def check_client_overrides(config: ml_collections.ConfigDict) -> None:
  """``config.client_overrides``: each entry names a registered method and fields of
  ``config.client`` with values of their types, and the client it gives the method
  passes ``check_client`` (errors name ``config.client_overrides.<method>.<field>``)."""
  for name in config.client_overrides.keys():
    ALGORITHMS.get(name, 'config.client_overrides')
    where = f'client_overrides.{name}'
    section = config.client_overrides[name]
    require(isinstance(section, (ml_collections.ConfigDict, dict)), where,
            f'is a section of config.client fields, e.g. {{\'learning_rate\': 0.3}}, got '
            f'{section!r}')
    for field, value in section.items():
      require(field in config.client, f'{where}.{field}',
              f'unknown field; config.client has {sorted(config.client.keys())}')
      shared = config.client[field]
      if traced(value):
        continue
      if isinstance(shared, tuple):
        fits = isinstance(value, (tuple, list))
      elif isinstance(shared, (int, float)) and not isinstance(shared, bool):
        fits = isinstance(value, (int, float)) and not isinstance(value, bool) and (
            isinstance(shared, float) or float(value).is_integer())
      else:
        fits = isinstance(value, type(shared))
      require(fits, f'{where}.{field}',
              f'must be of config.client.{field}\'s type ({type(shared).__name__}), got {value!r}')
    check_client(method_client(config, name), where)


def check_training(config: ml_collections.ConfigDict) -> None:
  """The client and server sections (optimizers, rates, local schedule) and each
  method's client overrides."""
  check_client(config.client)
  server_optimizer(config.server)
  require(config.server.learning_rate > 0, 'server.learning_rate',
          f'must be > 0, got {config.server.learning_rate}')
  # Adam's βs of 1 or more never forget; a negative ε divides by ~0.
  for field, value in {'server.momentum': config.server.momentum,
                       'server.beta1': config.server.beta1,
                       'server.beta2': config.server.beta2}.items():
    if not traced(value):
      require(0.0 <= value < 1.0, field, f'must be in [0, 1), got {value}')
  if not traced(config.server.adam_eps):
    require(config.server.adam_eps >= 0.0, 'server.adam_eps',
            f'must be >= 0, got {config.server.adam_eps}')
  check_client_overrides(config)


# The Benchmark.info fields a builder may read. Only these reach BuildContext.info,
# so a built method depends on the data only through them, the padded N and the
# example shape: the federated pipeline reuses a built method (and its compiled round)
# across seeds whose values agree. Add a field here when a builder needs one.
BUILD_INFO = ('num_domains', 'domain_size')


def build_info(info: Optional[dict]) -> dict:
  return {key: info[key] for key in BUILD_INFO if key in (info or {})}


def method_schedule(config: ml_collections.ConfigDict, name: str, max_examples: int
                    ) -> LocalSchedule:
  """Method ``name``'s local schedule (``config.client`` with its overrides;
  ``config.client`` alone when ``name`` is '') for clients padded to ``max_examples``."""
  return client_schedule(method_client(config, name), config.engine.unroll, max_examples)


def client_schedule(client: ml_collections.ConfigDict, unroll, max_examples: int
                    ) -> LocalSchedule:
  """The local schedule of a client section (``method_client``) for clients padded to
  ``max_examples``, local steps unrolled as ``unroll`` (``config.engine.unroll``)."""
  return LocalSchedule(batch_size=client.batch_size, num_epochs=client.local_epochs,
                       num_steps=client.local_steps, max_examples=max_examples,
                       unroll=unroll, augmentation=tuple(client.augmentation))


def build_context(config: ml_collections.ConfigDict, module, max_examples: int,
                  info: Optional[dict] = None, num_clients: Optional[int] = None,
                  example_shape: tuple = (), global_variables=None,
                  name: str = '') -> BuildContext:
  """The engine's part of a builder's input, from ``config.client`` (with method
  ``name``'s ``config.client_overrides``), ``config.server``,
  ``config.engine.unroll`` and ``config.cohort_size`` over ``num_clients`` (the
  training split's K; None: a cohort fraction of 1)."""
  c = method_client(config, name)
  schedule = client_schedule(c, config.engine.unroll, max_examples)
  fraction = min(1.0, config.cohort_size / num_clients) if num_clients else 1.0
  return BuildContext(module, client_optimizer(c), server_optimizer(config.server), schedule,
                      number(c.learning_rate), build_info(info), fraction, num_clients or 0,
                      tuple(example_shape), global_variables)


def build(name: str, config: ml_collections.ConfigDict, module, max_examples: int,
          info: Optional[dict] = None, num_clients: Optional[int] = None,
          example_shape: tuple = (), global_variables=None, check: bool = True):
  """The registered algorithm ``name`` with its section ``config.<name>`` (a variant's
  over its method's, ``Registry.section``), checked first (unknown fields, the declared
  ranges, the method's registered ``check``; ``check=False``: a config whose swept
  numbers are tracers, checked as numbers before)."""
  builder = ALGORITHMS.get(name, 'config.algorithms')
  section = ALGORITHMS.section(name, config)   # a variant's over its method's
  if check:
    ALGORITHMS.check(name, section, f'config.{name}')
  algorithm = builder(section, build_context(config, module, max_examples, info, num_clients,
                                             example_shape, global_variables, name))
  return algorithm._replace(num_classes=getattr(module, 'num_classes', None))


def epochs_schedule(schedule: LocalSchedule, epochs: int) -> LocalSchedule:
  """``schedule`` running ``epochs`` full epochs (fine-tuning, head epochs)."""
  return schedule._replace(num_epochs=epochs, num_steps=0)


def cross_entropy_loss(module, extra_loss: Optional[Callable[[PyTree], jax.Array]] = None,
                       logit_adjustment: Optional[jax.Array] = None):
  """LossFn: masked mean CE in train mode (+ ``extra_loss(params)``), new batch stats.
  ``logit_adjustment`` [C] is added to the logits inside the loss (e.g. the balanced
  softmax's log class counts)."""

  def loss_fn(params, model_state, x, y, weight, rng):
    del rng
    logits, variables = models.apply(module, {'params': params, **model_state}, x, 'train')
    if logit_adjustment is not None:
      logits = logits + logit_adjustment
    loss = masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, y), weight)
    if extra_loss is not None:
      loss = loss + extra_loss(params)
    return loss, {k: v for k, v in variables.items() if k != 'params'}

  return loss_fn


def split_variables(variables):
  """{'params': p, **rest} -> (p, rest)."""
  return variables['params'], {k: v for k, v in variables.items() if k != 'params'}


def init_server(module, server_opt: optax.GradientTransformation):
  def init(rng, example_x):
    variables = models.init(module, rng, example_x)
    return ServerState(variables, server_opt.init(variables['params']), jnp.int32(0))
  return init


def train_variables(context: BuildContext, variables, data: ClientData, rng, extra_loss=None,
                    schedule: Optional[LocalSchedule] = None,
                    logit_adjustment: Optional[jax.Array] = None):
  """Local training (``context.client_optimizer``, ``schedule`` or the context's) from
  ``variables`` on ``data`` (``cross_entropy_loss``'s options); returns (new variables,
  metrics)."""
  params, model_state = split_variables(variables)
  params, model_state, _, metrics = local_train(
      cross_entropy_loss(context.module, extra_loss, logit_adjustment),
      context.client_optimizer, params,
      model_state, data, rng, schedule or context.schedule)
  return {'params': params, **model_state}, metrics


def average_server_update(server_opt: optax.GradientTransformation, scale: float = 1.0,
                          mean_delta: Optional[Callable] = None):
  """ServerState update from client deltas Δ_c = w_c − w: the pseudo-gradient
  −scale·Σ p_c Δ_c goes through ``server_opt`` (``scale``: SCAFFOLD's η_g);
  non-trainable state (BN running statistics) becomes the weighted mean directly.
  ``mean_delta(state, outputs, weights)`` -> Σ p_c Δ_c shaped like the variables, for
  clients that upload something the server turns into Δ_c (default: the weighted mean
  of ``outputs.update``, which then is Δ_c itself)."""

  def server_update(state: ServerState, outputs: ClientOutput, weights) -> ServerState:
    mean = (mean_delta(state, outputs, weights) if mean_delta is not None
            else weighted_sum(outputs.update, weights))
    params, rest = split_variables(state.variables)
    delta_params, delta_rest = split_variables(mean)
    pseudo_grad = jax.tree.map(lambda d: -scale * d, delta_params)
    updates, opt_state = server_opt.update(pseudo_grad, state.opt_state, params)
    params = optax.apply_updates(params, updates)
    rest = jax.tree.map(jnp.add, rest, delta_rest)
    return ServerState({'params': params, **rest}, opt_state, state.round + 1)

  return server_update


def params_averaging(init: Callable, loss_fn: Callable, client_opt: optax.GradientTransformation,
                     context: BuildContext, global_model: Callable):
  """A method without client state whose clients train the server's 'params' with
  ``loss_fn`` (core.local's signature) and ``client_opt`` and send the delta, averaged
  by ``average_server_update`` (FedSR, FedADG). ``init`` builds the ServerState."""

  def client_update(server_state, client_state, data, rng):
    params = server_state.variables['params']
    new_params, _, _, metrics = local_train(loss_fn, client_opt, params, {}, data, rng,
                                            context.schedule)
    return ClientOutput({'params': tree_sub(new_params, params)}, metrics), client_state

  return FederatedAlgorithm(
      init=init, init_client_state=lambda state: (), client_update=client_update,
      server_update=average_server_update(context.server_optimizer), personalize=None,
      global_model=global_model)


def send_only(delta, is_sent: Callable) -> dict:
  """The part of a client's delta it uploads: a flat {path: leaf} dict of the paths
  with ``is_sent(path)`` (FedBN, FedRep keep the rest on the client)."""
  from flax import traverse_util
  return {p: v for p, v in traverse_util.flatten_dict(delta).items() if is_sent(p)}


def received_update(sent: dict, template, cohort_size: int):
  """The stacked uploads [C, ...] back in the shape of ``template`` (the server
  variables), zeros where nothing was sent."""
  from flax import traverse_util
  flat = {p: sent[p] if p in sent else jnp.zeros((cohort_size,) + leaf.shape, leaf.dtype)
          for p, leaf in traverse_util.flatten_dict(template).items()}
  return traverse_util.unflatten_dict(flat)


def partial_server_update(server_opt: optax.GradientTransformation):
  """``average_server_update`` for clients that upload only part of the model
  (their ``ClientOutput.update`` is a ``send_only`` dict)."""
  def mean_delta(state: ServerState, outputs: ClientOutput, weights):
    return weighted_sum(received_update(outputs.update, state.variables, weights.shape[0]),
                        weights)

  return average_server_update(server_opt, mean_delta=mean_delta)
