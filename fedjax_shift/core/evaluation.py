"""Compiled evaluation: global and personalised models on every client's splits.

One jitted function, vmapped over a chunk of clients, evaluates every split the
caller passes; the host loops over fixed-size client chunks (the last one padded),
so a run compiles it once whatever the population.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_shift import models
from fedjax_shift.core.algorithm import ClientData, FederatedAlgorithm
from fedjax_shift.core.round import NO_STEP_LIMIT
from fedjax_shift.core.test_time import client_runner
from fedjax_shift.data.federated import FederatedData
from fedjax_shift.data.store import ClientStore, validate_split

PyTree = Any


def logits_metrics(logits: jax.Array, y: jax.Array, mask: jax.Array) -> Dict[str, jax.Array]:
  """Sums {'correct', 'loss', 'count'} (scalars) of logits [N, C] on labels y [N].

  A real example's label outside [0, C) has no logit (optax reads -1 as class C-1):
  then 'correct' and 'loss' are NaN, never another class's score."""
  weight = mask.astype(jnp.float32)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, y)
  outside = jnp.any(((y < 0) | (y >= logits.shape[-1])) & mask)
  unscorable = jnp.where(outside, jnp.nan, 0.0)
  return {'correct': jnp.sum((jnp.argmax(logits, -1) == y) * weight) + unscorable,
          'loss': jnp.sum(loss * weight) + unscorable, 'count': jnp.sum(weight)}


def split_logits(module, variables, x: jax.Array, batch_size: int) -> jax.Array:
  """Eval-mode logits [N, C] of x [N, ...] in batches of ``batch_size`` (lax.map)."""
  num = x.shape[0]
  batch = min(batch_size, num)
  num_batches = -(-num // batch)
  pad = num_batches * batch - num
  if pad:
    x = jnp.concatenate([x, jnp.zeros((pad,) + x.shape[1:], x.dtype)])
  logits = jax.lax.map(lambda xb: models.apply(module, variables, xb, 'eval')[0],
                       x.reshape((num_batches, batch) + x.shape[1:]))
  return logits.reshape((num_batches * batch,) + logits.shape[2:])[:num]


def split_metrics(module, variables, x, y, mask, batch_size: int) -> Dict[str, jax.Array]:
  """Sums over one client's split: {'correct', 'loss', 'count'} (scalars).

  x: [N, ...]; evaluated in eval mode in batches of ``batch_size`` (lax.map). Called on
  arrays (not inside a jit), inputs that are not finite and labels outside [0, C) are a
  ValueError; traced, such labels make the sums NaN (``logits_metrics``).
  """
  logits = split_logits(module, variables, x, batch_size)
  if not any(isinstance(a, jax.core.Tracer) for a in (x, y, mask)):
    split = FederatedData(*(np.asarray(a)[None] for a in (x, y, mask)),
                          np.asarray(mask).sum(keepdims=True))
    try:
      validate_split(split, logits.shape[-1])
    except ValueError as err:
      raise ValueError(f'split_metrics: {str(err).removeprefix("client 0: ")}') from None
  return logits_metrics(logits, y, mask)


def personalized_variables(algorithm: FederatedAlgorithm, server_state, client_state,
                           train: FederatedData, client_id, key):
  """Client ``client_id``'s personalised model: ``algorithm.personalize`` on its train
  data [N, ...] (no step limit) with key ``fold_in(key, client_id)``."""
  data = ClientData(train.x, train.y, train.mask, train.num_examples, jnp.int32(NO_STEP_LIMIT))
  return algorithm.personalize(server_state, client_state, data,
                               jax.random.fold_in(key, client_id))


class EvalAdapters(NamedTuple):
  """Test-time adaptation inside the evaluation (``build_evaluate``): ``runners`` maps
  a name to an ``AdaptRunner``; ``splits``: prefixes of the split names adapted on
  (e.g. ('test',): every test split); ``models_of``: the models ('global',
  'personalized') an adapter adapts, where it names them (FedTHE's ensemble needs the
  personal head)."""
  runners: Dict[str, 'AdaptRunner']
  splits: Tuple[str, ...]
  models_of: Dict[str, Sequence[str]] = {}


def models_of_client(algorithm: FederatedAlgorithm, server_state, client_state,
                     train: FederatedData, client_id, key) -> Dict[str, PyTree]:
  """{'global': its variables (when the method has one), 'personalized': client
  ``client_id``'s (when the method personalises; computed once per evaluation)}."""
  models = {}
  if algorithm.global_model is not None:
    models['global'] = algorithm.global_model(server_state)
  if algorithm.personalize is not None:
    models['personalized'] = personalized_variables(algorithm, server_state, client_state,
                                                    train, client_id, key)
  return models


def build_evaluate(algorithm: FederatedAlgorithm, module, batch_size: int = 256,
                   global_only: Sequence[str] = (), adapters: Optional[EvalAdapters] = None):
  """Returns jitted ``evaluate_chunk(server_state, client_states_chunk, train_chunk,
  splits_chunk, client_ids, key)`` -> {model: {split: {'correct','loss','count'} [C]}}.

  ``model`` is 'global' (when the method has one) and 'personalized' (when the
  method personalises; not on the ``global_only`` splits, whose client k is not
  training client k: UPFL's new clients). ``train_chunk`` is what ``personalize``
  may train on. With ``adapters``, also '<model>+<adapter>' on the splits they name
  (``adapted_metrics``), from the same personalised models: a client is personalised
  once per evaluation.
  """

  def one_client(server_state, client_state, train: FederatedData,
                 splits: Dict[str, FederatedData], client_id, key):
    models = models_of_client(algorithm, server_state, client_state, train, client_id, key)
    results = {model: {name: split_metrics(module, variables, s.x, s.y, s.mask, batch_size)
                       for name, s in splits.items()
                       if model == 'global' or name not in global_only}
               for model, variables in models.items()}
    if adapters is not None:
      adapt_key = jax.random.fold_in(jax.random.fold_in(key, 1), client_id)
      results.update(adapted_metrics(
          models, {n: s for n, s in splits.items() if n.startswith(tuple(adapters.splits))},
          adapters, global_only, adapt_key))
    return results

  def evaluate_chunk(server_state, client_states, train, splits, client_ids, key):
    return jax.vmap(one_client, (None, 0, 0, 0, 0, None))(
        server_state, client_states, train, splits, client_ids, key)

  return jax.jit(evaluate_chunk)


def build_new_client_evaluate(algorithm: FederatedAlgorithm, module, batch_size: int = 256):
  """FedTTA's PFL baselines (Ye et al., UPFL 2023 Sec. 4.1.2): a personalised method's models
  given to new clients, which have none of their own.

  Returns (``personalized_models``, ``evaluate_chunk``), both jitted:
    personalized_models(server_state, client_states [K], train [K], key) -> every
      training client's personalised variables, stacked [K, ...] (client k's key is
      ``fold_in(key, k)``, as in ``build_evaluate``);
    evaluate_chunk(stacked, has_data [K] bool, split_chunk [C, N, ...], donors [C],
                   client_ids, key) -> {'pfl_sampled': sums [C], 'pfl_ensemble': sums [C]}: new client c predicts
      with training client donors[c]'s model (PFL-Sampled), and with the mean logits
      of every training client that has data (PFL-Ensemble).
  Both hold all K personalised models at once: the ensemble needs every one of them.
  """

  def personalized_models(server_state, client_states, train: FederatedData, key):
    one = lambda client_state, data, client_id: personalized_variables(
        algorithm, server_state, client_state, data, client_id, key)
    return jax.vmap(one)(client_states, train, jnp.arange(train.num_examples.shape[0]))

  def one_client(stacked, has_data, split: FederatedData, donor):
    def add_logits(total, member):
      variables, member_has_data = member
      logits = split_logits(module, variables, split.x, batch_size)
      return total + jnp.where(member_has_data, logits, 0.0), None

    donor_variables = jax.tree.map(lambda leaf: leaf[donor], stacked)
    sampled = split_logits(module, donor_variables, split.x, batch_size)
    total, _ = jax.lax.scan(add_logits, jnp.zeros_like(sampled), (stacked, has_data))
    ensemble = total / jnp.maximum(jnp.sum(has_data), 1)
    return {'pfl_sampled': logits_metrics(sampled, split.y, split.mask),
            'pfl_ensemble': logits_metrics(ensemble, split.y, split.mask)}

  def evaluate_chunk(stacked, has_data, split: FederatedData, donors, client_ids, key):
    del client_ids, key   # (``evaluate_population``'s calling convention)
    return jax.vmap(one_client, (None, None, 0, 0))(stacked, has_data, split, donors)

  return jax.jit(personalized_models), jax.jit(evaluate_chunk)


# A split is padded to the longest split's size when that adds at most this fraction to
# its adapted batches (``adapted_metrics``).
MAX_PADDING = 0.25


def padded_sizes(sizes: Sequence[int], batch_size: int) -> list:
  """The sizes [S] that splits of ``sizes`` examples per client are padded to before
  online or episodic adaptation: the largest size when that adds at most
  ``MAX_PADDING`` of a split's batches, else its own. Splits of one padded size trace
  one adapter program instead of one per size (FedICON's five test splits: 3 → 1)."""
  largest = max(sizes)
  batches = lambda size: -(-size // batch_size)
  return [largest if batches(largest) <= (1 + MAX_PADDING) * batches(size) else size
          for size in sizes]


def pad_client(split: FederatedData, size: int) -> FederatedData:
  """ONE client's ``split`` (x [N, ...], y and mask [N]; traced) with its rows
  zero-padded to ``size`` and ``num_examples`` unchanged, so the padding is never
  scored (``data.federated.pad_examples`` pads a whole [K, N] split on the host)."""
  pad = size - split.x.shape[0]
  if pad == 0:
    return split
  grow = lambda a: jnp.concatenate([a, jnp.zeros((pad,) + a.shape[1:], a.dtype)])
  return split._replace(x=grow(split.x), y=grow(split.y), mask=grow(split.mask))


class AdaptRunner(NamedTuple):
  """A ``core.test_time.client_runner`` ``run`` and its test-time ``mode``."""
  run: Callable
  mode: str
  batch_size: int


def adapted_metrics(models: Dict[str, PyTree], splits: Dict[str, FederatedData],
                    adapters: EvalAdapters, global_only: Sequence[str], adapt_key
                    ) -> Dict[str, Dict[str, Dict[str, jax.Array]]]:
  """Test-time adaptation of one client's ``models`` (``models_of_client``) on its
  ``splits`` (FedEvolve's MEMO(G), MEMO(P), T3A on FedAvg-FT): {'<model>+<name>':
  {split: sums}} for every runner of ``adapters`` and model it adapts (not the
  personalised model on the ``global_only`` splits), with the key ``adapt_key``.

  Online and episodic runs see each split zero-padded to ``padded_sizes``: their
  trailing batches without weight change neither the state nor a score, so the sums
  equal the unpadded run's; transductive runs (whose shuffled order depends on the
  padded size) see each split as it is."""
  results = {}
  for model, variables in models.items():
    for name, runner in adapters.runners.items():
      if model not in adapters.models_of.get(name, (model,)):
        continue
      chosen = {split: s for split, s in splits.items()
                if model == 'global' or split not in global_only}
      if runner.mode != 'transductive' and chosen:
        sizes = padded_sizes([s.x.shape[0] for s in chosen.values()], runner.batch_size)
        chosen = {split: pad_client(s, size)
                  for (split, s), size in zip(chosen.items(), sizes)}
      results[f'{model}+{name}'] = {
          split: {k: v for k, v in runner.run(variables, s.x, s.y, s.num_examples,
                                              adapt_key).items() if k != 'predictions'}
          for split, s in chosen.items()}
  return results


def take_chunk(tree, client_ids: np.ndarray):
  """Clients ``client_ids`` of a per-client pytree: numpy leaves are gathered on the
  host (the data), device arrays on the device (client states), a ``ClientStore`` as a
  padded FederatedData of those clients (its largest client's N: one shape for every
  chunk)."""
  device_ids = jnp.asarray(client_ids)

  def take(leaf):
    if isinstance(leaf, ClientStore):
      return leaf.take(client_ids)
    return leaf[client_ids] if isinstance(leaf, np.ndarray) else leaf[device_ids]

  return jax.tree.map(take, tree, is_leaf=lambda node: isinstance(node, ClientStore))


def evaluate_population(evaluate_chunk, shared: tuple, per_client: tuple, num_clients: int,
                        key, chunk_size: int):
  """Runs ``evaluate_chunk(*shared, *per_client_chunk, client_ids [C], key)`` over all
  K = ``num_clients`` clients in chunks of C = ``chunk_size`` (every leaf of
  ``per_client`` has a leading K axis; ``shared`` is passed whole).

  Returns the outputs' per-client numpy leaves concatenated to [K]. The last chunk is
  padded by repeating client 0 and the padding dropped, so ``evaluate_chunk``
  compiles once whatever K.
  """
  chunk_size = min(chunk_size or num_clients, num_clients)
  pieces = []
  for start in range(0, num_clients, chunk_size):
    ids = np.arange(start, min(start + chunk_size, num_clients))
    real = len(ids)
    ids = np.concatenate([ids, np.zeros(chunk_size - real, ids.dtype)])
    out = evaluate_chunk(*shared, *take_chunk(per_client, ids),
                         jnp.asarray(ids, jnp.int32), key)
    pieces.append(jax.tree.map(lambda a, r=real: np.asarray(a)[:r], out))
  return jax.tree.map(lambda *xs: np.concatenate(xs), *pieces)


def evaluate_models(evaluate_chunk, server_state, client_states, train: FederatedData,
                    splits: Dict[str, FederatedData], key, chunk_size: int
                    ) -> Dict[str, Dict[str, Dict[str, np.ndarray]]]:
  """``build_evaluate``'s function over the population:
  per-client numpy sums {model: {split: {'correct','loss','count'} [K]}}."""
  return evaluate_population(evaluate_chunk, (server_state,), (client_states, train, splits),
                             train.num_clients, key, chunk_size)


def build_adapter_evaluate(make_adapter: Callable[[Any], Any], batch_size: int, mode: str,
                           stream_rate: float = 0.0):
  """One adapter on clients that share the model variables (a pipeline's target
  clients). Returns jitted ``evaluate_chunk(rates, variables, data [C, N, ...],
  client_ids [C], key)`` -> {'correct', 'loss', 'count'} [C] and 'predictions' [C, N].

  ``make_adapter(rates)`` builds the Adapter inside the compiled function, so the
  rates it learns (ATP's α) are an argument, not constants: one compilation per
  adapter, mode and shape serves every α. Client k's key is ``fold_in(key, k)``.
  ``stream_rate``: the time-limited online stream of ``test_time.client_runner``.
  """

  def evaluate_chunk(rates, variables, data: FederatedData, client_ids, key):
    run_one = client_runner(make_adapter(rates), batch_size, mode, stream_rate)
    keys = jax.vmap(jax.random.fold_in, (None, 0))(key, client_ids)
    return jax.vmap(run_one, (None, 0, 0, 0, 0))(variables, data.x, data.y, data.num_examples,
                                                 keys)

  return jax.jit(evaluate_chunk)


def client_accuracy(sums: Dict[str, np.ndarray]) -> np.ndarray:
  """Per-client accuracy [K] from sums (NaN for clients without examples)."""
  count = np.asarray(sums['count'])
  return np.where(count > 0, np.asarray(sums['correct']) / np.maximum(count, 1), np.nan)


def summarize(per_client: Dict[str, Dict[str, Dict[str, np.ndarray]]],
              client_groups: Dict[str, Sequence[int]] | None = None) -> Dict[str, float]:
  """Flat metrics '<model>/<split>/accuracy' (over all examples),
  '<model>/<split>/client_accuracy' (mean over clients with data) and '/loss' (and
  '/adapted_batches', the fraction of batches that changed the model, for an adapter
  that says: ``Adapter.took_step``); with
  ``client_groups`` ({name: client indices}, e.g. the clients of one domain) the same
  over each group's clients as '<model>/<split>_<name>/…'."""
  flat = {}
  for model, splits in per_client.items():
    for split, sums in splits.items():
      flat.update(_pooled(f'{model}/{split}', sums))
      for name, ids in (client_groups or {}).items():
        ids = np.asarray(ids, np.int64)
        flat.update(_pooled(f'{model}/{split}_{name}',
                            {k: np.asarray(v)[ids] for k, v in sums.items()}))
  return flat


def _pooled(prefix: str, sums: Dict[str, np.ndarray]) -> Dict[str, float]:
  count = sums['count']
  total = max(float(count.sum()), 1e-12)
  has = count > 0
  pooled = {f'{prefix}/accuracy': float(sums['correct'].sum() / total),
            f'{prefix}/loss': float(sums['loss'].sum() / total),
            f'{prefix}/client_accuracy': (float(np.mean(sums['correct'][has] / count[has]))
                                          if has.any() else float('nan'))}
  if 'adapted_batches' in sums:   # an adapter that skips batches it cannot use (SAR)
    pooled[f'{prefix}/adapted_batches'] = float(
        np.sum(sums['adapted_batches']) / max(float(np.sum(sums['batches'])), 1.0))
  return pooled
