"""The test-time engine: an Adapter run as a jitted ``lax.scan`` over a target
client's test batches, ``vmap``ped over target clients.

A client's N test examples (padded to the split's N_max) are read in stored order in
batches of B: batch s takes positions s·B … s·B+B−1, wrapped inside the client's own
n examples, so a batch only ever holds real examples (BatchNorm statistics never see
padding); positions ≥ n carry weight 0 and are not scored. A batch with no weight at
all (past the end of a small client's data) leaves the adapter state unchanged.

Modes: 'episodic' resets the state to ``init`` before every batch; 'online' carries it;
'transductive' first adapts on the client's whole test split for ``adapter.epochs``
passes (each pass over a fresh shuffle of its n examples, the state carried), then
predicts every batch with the adapted state (``adapter.predict``, no update): FedICON's
Eq. 2, which minimises Eq. 7 over the local test set before predicting.
An online run may be time-limited (``stream_rate``, Alfarra et al., ICML 2024): the
adapter adapts on every ⌈C⌉-th batch and predicts the others with its current model.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_shift.core.local import select
from fedjax_shift.data.federated import FederatedData
from fedjax_shift.data.store import FirstUseCheck
from fedjax_shift.registry import Registry

AdaptState = Any
Variables = Any
MODES = ('episodic', 'online', 'transductive')


class AdaptBatch(NamedTuple):
  """x: [B, ...] inputs; weight: [B] 1 for examples to score, 0 for wrapped repeats."""
  x: jax.Array
  weight: jax.Array


class Adapter(NamedTuple):
  """A test-time method.

  Attributes:
    init: (model variables, rng) -> AdaptState.
    step: (AdaptState, AdaptBatch) -> (AdaptState, logits [B, C]); the logits are the
      ones the method predicts with (before or after its update, as configured).
    predict: (AdaptState, AdaptBatch) -> logits [B, C] without an update; None for an
      adapter that cannot run the 'transductive' mode.
    epochs: passes over the test split in the 'transductive' mode.
    took_step: (AdaptState after a step) -> [] bool, whether that batch changed the
      model (SAR on a batch whose filter keeps no example: False); the runner then counts
      'adapted_batches' of its 'batches'. None: the adapter does not say.
    stream_floor: (config field, examples) pairs: a test stream (a client's examples
      online; one batch episodic) shorter than that many examples is refused before
      compiling (NOTE's memory, a memory adapter's first update).
  """
  init: Callable[[Variables, jax.Array], AdaptState]
  step: Callable[[AdaptState, AdaptBatch], Tuple[AdaptState, jax.Array]]
  predict: Optional[Callable[[AdaptState, AdaptBatch], jax.Array]] = None
  epochs: int = 1
  took_step: Optional[Callable[[AdaptState], jax.Array]] = None
  stream_floor: Tuple[Tuple[str, int], ...] = ()


class SourceContext(NamedTuple):
  """What adapters may use besides the test batches.

  Attributes:
    variables: the global model θ_G (None where no source side exists).
    num_classes: C.
    batch_size: the test-time batch size B.
    source_x, source_y: labelled source held-out examples [M, ...], [M] (or None).
    alpha: ATP's learned rates (None before α training).
    input_shape: one example's shape (adapters that pick a layer by position read the
      model's layer order with it); () where unknown.
  """
  variables: Any
  num_classes: int
  batch_size: int
  source_x: Optional[np.ndarray] = None
  source_y: Optional[np.ndarray] = None
  alpha: Optional[Any] = None
  input_shape: tuple = ()


# name -> build(module, hparams: config.adapters.<name>, context: SourceContext) -> Adapter;
# each adapter file registers itself with its paper's defaults, and optionally
# ``trained_by`` (the methods whose models it can adapt: FedTTA's g, FedICON's projection)
# and ``adapts_models`` (which of their models in config.eval_adapters: FedTHE's
# ensemble only the personalised one).
ADAPTERS: Registry = Registry('adapter')


def class_count(module, context: SourceContext) -> int:
  """C, for ``register_constructor(from_context={'num_classes': class_count})``."""
  del module
  return context.num_classes


def test_batch_size(module, context: SourceContext) -> int:
  """B, for ``register_constructor(from_context={'batch_size': test_batch_size})``."""
  del module
  return context.batch_size


def example_shape(module, context: SourceContext) -> tuple:
  """One example's shape, for an adapter that stores test examples (RoTTA's and NOTE's
  memories): ``register_constructor(from_context={'example_shape': example_shape})``."""
  del module
  if not context.input_shape:
    raise ValueError('this adapter keeps test examples in a memory and needs their shape: '
                     'give SourceContext(input_shape=...)')
  return tuple(context.input_shape)


def whole_context(module, context: SourceContext) -> SourceContext:
  """The source context itself, for a constructor that reads several of its fields."""
  del module
  return context


def settings_type(default) -> bool:
  """Whether a constructor parameter's default is a NamedTuple of settings (its fields
  are the section's, ``register_constructor``)."""
  return isinstance(default, tuple) and hasattr(default, '_fields')


def constructor_defaults(constructor: Callable, from_context=()) -> Dict[str, Any]:
  """{field: default} of ``constructor(module, ...)``'s config section: its parameters
  after ``module`` but those the source context gives (``from_context``) and the
  keyword-only ones (the Python API's), a NamedTuple default's fields in its place."""
  out = {}
  for p in tuple(inspect.signature(constructor).parameters.values())[1:]:
    if p.name in from_context or p.kind is inspect.Parameter.KEYWORD_ONLY:
      continue
    out.update(p.default._asdict() if settings_type(p.default) else {p.name: p.default})
  return out


def register_constructor(name: str, from_context: Optional[Dict[str, Callable]] = None,
                         **registration) -> Callable:
  """Decorator: registers the adapter constructor ``constructor(module, **fields)``
  under ``name``, its config fields (``config.adapters.<name>``) and their defaults
  read from its parameters after ``module``, so each default is written once, in the
  signature; a parameter whose default is a NamedTuple of settings gives its fields
  (built from the section's). ``from_context``: {parameter: f(module, context)} for the
  parameters the source context gives (C, a confusion matrix), not fields;
  keyword-only parameters are the Python API's alone (left at their defaults).
  ``registration``: the rest of ``ADAPTERS.register``'s arguments (ranges, check,
  meta). The constructor is returned unchanged."""
  from_context = dict(from_context or {})

  def decorator(constructor: Callable[..., Adapter]) -> Callable[..., Adapter]:
    parameters = tuple(inspect.signature(constructor).parameters.values())[1:]
    unknown = sorted(set(from_context) - {p.name for p in parameters})
    fields = tuple(p for p in parameters if p.name not in from_context and
                   p.kind is not inspect.Parameter.KEYWORD_ONLY)
    missing = [p.name for p in fields if p.default is inspect.Parameter.empty]
    if unknown or missing:
      raise ValueError(f'adapter {name!r}: from_context names {unknown}, not parameters of '
                       f'{constructor.__name__}' if unknown else
                       f'adapter {name!r}: constructor parameters {missing} have no default '
                       f'(each config field needs one)')

    def argument(p, hparams):
      if settings_type(p.default):
        return type(p.default)(**{field: hparams[field] for field in p.default._fields})
      return hparams[p.name]

    def build(module, hparams, context: SourceContext) -> Adapter:
      given = {parameter: f(module, context) for parameter, f in from_context.items()}
      return constructor(module, **given, **{p.name: argument(p, hparams) for p in fields})

    build.__doc__ = f'The registry\'s builder: {constructor.__name__} from config.adapters.{name}.'
    ADAPTERS.register(name, defaults=constructor_defaults(constructor, from_context),
                      constructor=constructor, from_context=tuple(from_context),
                      **registration)(build)
    return constructor
  return decorator


def client_batches(x: jax.Array, num_examples: jax.Array, batch_size: int) -> AdaptBatch:
  """[T, B, ...] batches of one client (T = ceil(N_max / B)), see the module docstring."""
  num_pad = x.shape[0]
  num_batches = -(-num_pad // batch_size)
  positions = jnp.arange(num_batches * batch_size).reshape(num_batches, batch_size)
  idx = positions % jnp.maximum(num_examples, 1)
  weight = (positions < num_examples).astype(jnp.float32)
  return AdaptBatch(x[idx], weight), idx


def weighted_step(adapter: Adapter, state: AdaptState, start: AdaptState, batch: AdaptBatch):
  """(state after ``adapter.step`` from ``start``, logits); a batch with no weight
  leaves ``state`` unchanged."""
  new_state, logits = adapter.step(start, batch)
  return select(jnp.sum(batch.weight) > 0, new_state, state), logits


def shuffled_order(rng: jax.Array, num_pad: int, num_examples: jax.Array) -> jax.Array:
  """[N_max] positions: a random permutation of the client's n real examples first,
  then its padding rows (so ``client_batches`` of the reordered x wraps inside real ones)."""
  keys = jnp.where(jnp.arange(num_pad) < num_examples, jax.random.uniform(rng, (num_pad,)),
                   2.0 + jnp.arange(num_pad))
  return jnp.argsort(keys)


def transductive_adapt(adapter: Adapter, batch_size: int, state: AdaptState, x: jax.Array,
                       num_examples: jax.Array, rng: jax.Array) -> AdaptState:
  """``adapter.epochs`` passes of ``adapter.step`` over one client's test split x
  [N_max, ...] (n real examples), pass e in the order ``shuffled_order(fold_in(rng, e))``;
  a batch with no weight leaves the state unchanged. Returns the adapted state."""

  def one_pass(state, epoch):
    order = shuffled_order(jax.random.fold_in(rng, epoch), x.shape[0], num_examples)
    batches, _ = client_batches(x[order], num_examples, batch_size)

    return jax.lax.scan(lambda state, batch: (weighted_step(adapter, state, state, batch)[0],
                                              None), state, batches)[0], None

  return jax.lax.scan(one_pass, state, jnp.arange(adapter.epochs))[0]


def check_mode(adapter: Adapter, mode: str) -> None:
  """A known mode, and 'transductive' only for an adapter with ``predict``."""
  if mode not in MODES:
    raise ValueError(f'unknown test-time mode {mode!r}; choose from {list(MODES)}')
  if mode == 'transductive':
    if adapter.predict is None:
      raise ValueError("test-time mode 'transductive': this adapter cannot run it (it has "
                       "no prediction without an update); use 'episodic' or 'online'")
    if adapter.epochs < 1:
      raise ValueError(f"test-time mode 'transductive': epochs must be >= 1, got "
                       f'{adapter.epochs}')


def mode_problem(name: str, mode: str) -> Optional[str]:
  """Why registered adapter ``name`` cannot run test-time mode ``mode`` (None if it can):
  an unknown mode, or 'transductive' for an adapter not registered ``transductive=True``.
  Config checks call this before anything trains."""
  if mode not in MODES:
    return f'unknown mode {mode!r} for {name}; choose from {list(MODES)}'
  if mode == 'transductive' and not ADAPTERS.meta(name).get('transductive'):
    runs = [a for a in ADAPTERS.names() if ADAPTERS.meta(a).get('transductive')]
    return (f"{name} cannot run the 'transductive' mode (adapters that can: {runs}); use "
            f"'episodic' or 'online'")
  return None


def rate_problem(mode: str, stream_rate: float) -> Optional[str]:
  """Why ``stream_rate`` is no time-limited stream in ``mode`` (None: 0, off, or a
  rate >= 1 in the 'online' mode)."""
  if not stream_rate:
    return None
  if not stream_rate >= 1.0:
    return (f'must be 0 (off) or >= 1 (batches the stream reveals during one adapted '
            f'batch), got {stream_rate}')
  if mode != 'online':
    return f"a time-limited stream is an online evaluation; mode {mode!r} cannot run it"
  return None


def stream_problem(name: str, mode: str, stream_rate: float) -> Optional[str]:
  """Why registered adapter ``name`` cannot run a time-limited stream of
  ``stream_rate`` in ``mode`` (None if it can: no stream, or an adapter registered
  ``streams=True``, whose ``predict`` serves the batches it has no time for). Config
  checks call this before anything compiles."""
  problem = rate_problem(mode, stream_rate)
  if problem is None and stream_rate and not ADAPTERS.meta(name).get('streams'):
    runs = [a for a in ADAPTERS.names() if ADAPTERS.meta(a).get('streams')]
    problem = (f'{name} cannot predict without adapting, which the batches it has no '
               f'time for need (adapters that can: {runs})')
  return problem


def stream_period(adapter: Adapter, mode: str, stream_rate: float) -> int:
  """How many batches the stream reveals per adapted batch: ⌈``stream_rate``⌉ (0: every
  batch adapts). Raises for a rate ``rate_problem`` refuses or an adapter without
  ``predict``."""
  problem = rate_problem(mode, stream_rate)
  if problem is not None:
    raise ValueError(f'stream_rate: {problem}')
  if not stream_rate:
    return 1
  if adapter.predict is None:
    raise ValueError('stream_rate: this adapter cannot predict without adapting, which the '
                     'batches it has no time for need')
  return int(np.ceil(stream_rate))


def check_stream(adapter: Adapter, mode: str, batch_size: int, num_examples: int) -> None:
  """Refuses a stream shorter than ``adapter.stream_floor`` asks: a client's (padded)
  ``num_examples`` online, one batch of ``batch_size`` episodic (the state is reset)."""
  if mode == 'transductive':
    return
  length, what = ((batch_size, f'an episodic stream is one batch of {batch_size}')
                  if mode == 'episodic' else
                  (num_examples, f'the largest target client holds {num_examples} test examples'))
  for field, examples in adapter.stream_floor:
    if length < examples:
      raise ValueError(f'{field} = {examples} is longer than the test stream ({what}): the '
                       f'method would never adapt; lower it or lengthen the stream')


def client_runner(adapter: Adapter, batch_size: int, mode: str = 'episodic',
                  stream_rate: float = 0.0):
  """``run_one(variables, x [N, ...], y [N], num_examples [], rng)`` -> the sums
  {'correct', 'loss', 'count'} and 'predictions' [N] of ONE client (unjitted, for
  vmapping with shared or per-client variables); with ``adapter.took_step``, also
  'adapted_batches' of its 'batches' (those holding an example to score).

  ``stream_rate`` C (online only; 0: off): the time-limited evaluation of Alfarra et al.
  (ICML 2024): the stream reveals a batch per forward pass of the model, and an adapter
  whose step costs C of them adapts on every ⌈C⌉-th batch (the first of each group); the
  batches it has no time for are predicted by its current model (``adapter.predict``)."""
  check_mode(adapter, mode)
  period = stream_period(adapter, mode, stream_rate)
  if batch_size < 1:
    raise ValueError(f'test-time batch_size must be >= 1, got {batch_size}')

  def one_client(variables, x, y, num_examples, rng):
    check_stream(adapter, mode, batch_size, x.shape[0])
    batches, idx = client_batches(x, num_examples, batch_size)
    if mode == 'transductive':
      init_rng, order_rng = jax.random.split(rng)
      adapted = transductive_adapt(adapter, batch_size, adapter.init(variables, init_rng), x,
                                   num_examples, order_rng)
      logits = jax.lax.map(lambda batch: adapter.predict(adapted, batch), batches)
    else:
      initial = adapter.init(variables, rng)

      def adapt(state, batch):
        new_state, logits = weighted_step(adapter, state,
                                          initial if mode == 'episodic' else state, batch)
        stepped = (jnp.sum(batch.weight) > 0) & (adapter.took_step(new_state) if
                                                 adapter.took_step else True)
        return new_state, (logits, stepped)

      def body(state, indexed):
        index, batch = indexed
        if period == 1:
          return adapt(state, batch)
        # the batch index is shared by every client, so under vmap this stays a branch
        return jax.lax.cond(index % period == 0, adapt,
                            lambda state, batch: (state, (adapter.predict(state, batch),
                                                          jnp.bool_(False))), state, batch)

      _, (logits, stepped) = jax.lax.scan(body, initial,
                                          (jnp.arange(batches.weight.shape[0]), batches))
    labels = y[idx]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
    weight = batches.weight
    flat_pred = jnp.argmax(logits, -1).reshape(-1)[:x.shape[0]]
    predictions = jnp.where(jnp.arange(x.shape[0]) < num_examples, flat_pred, -1)
    sums = {'correct': jnp.sum(correct * weight), 'loss': jnp.sum(loss * weight),
            'count': jnp.sum(weight), 'predictions': predictions}
    if adapter.took_step is not None and mode != 'transductive':
      sums.update(adapted_batches=jnp.sum(stepped.astype(jnp.float32)),
                  batches=jnp.sum((jnp.sum(weight, -1) > 0).astype(jnp.float32)))
    return sums

  return one_client


def build_test_time(adapter: Adapter, batch_size: int, mode: str = 'episodic',
                    stream_rate: float = 0.0):
  """Returns jitted ``run(variables, data: FederatedData [K, N, ...], rng)`` ->
  {'correct', 'loss', 'count'} each [K] (sums over each client's scored examples)
  and 'predictions' [K, N] (argmax, −1 where padded).

  ``variables`` are shared by every client (the global model); client k's adapter
  key is ``fold_in(rng, client_ids[k])`` (``client_ids`` defaults to 0..K−1; pass the
  population ids when running a subset so every client keeps its key).

  ``stream_rate``: the time-limited online stream of ``client_runner``.

  Each ``data`` is checked the first time it is seen (``store.FirstUseCheck``): inputs
  that are not finite and labels outside [0, C) of the adapter's logits are a ValueError.
  """
  one_client = client_runner(adapter, batch_size, mode, stream_rate)

  def run(variables, data: FederatedData, rng, client_ids=None) -> Dict[str, jax.Array]:
    if client_ids is None:
      client_ids = jnp.arange(data.x.shape[0])
    keys = jax.vmap(jax.random.fold_in, (None, 0))(rng, client_ids)
    return jax.vmap(one_client, (None, 0, 0, 0, 0))(variables, data.x, data.y,
                                                    data.num_examples, keys)

  def num_classes(data: FederatedData, variables, rng, *_) -> int:
    batch = AdaptBatch(jnp.zeros((batch_size,) + tuple(data.x.shape[2:]), jnp.float32),
                       jnp.ones((batch_size,), jnp.float32))
    logits = jax.eval_shape(lambda v, key: adapter.step(adapter.init(v, key), batch)[1],
                            variables, rng)
    return logits.shape[-1]

  check = FirstUseCheck(num_classes, 'the data of the test-time run')
  compiled = jax.jit(run)

  @functools.wraps(run)
  def checked_run(variables, data: FederatedData, rng, client_ids=None):
    check(data, variables, rng)
    return compiled(variables, data, rng, client_ids)

  return checked_run
