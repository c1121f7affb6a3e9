"""The training-method protocol: a FederatedAlgorithm is a value of pure functions.

Toy example (a 'model' that is one number, each client moves it to its mean)::

    >>> import jax, jax.numpy as jnp
    >>> from fedjax_shift.core import algorithm as alg
    >>> def client_update(server, client_state, data, rng):
    ...   mean = jnp.sum(data.x * data.mask) / jnp.maximum(data.num_examples, 1)
    ...   return alg.ClientOutput(mean - server, {}), client_state
    >>> def server_update(server, outputs, weights):
    ...   return server + jnp.sum(weights * outputs.update)
    >>> toy = alg.FederatedAlgorithm(
    ...     init=lambda rng, x: jnp.float32(0.), init_client_state=lambda s: (),
    ...     client_update=client_update, server_update=server_update,
    ...     personalize=lambda s, c, d, r: s, global_model=lambda s: s)

After one round over clients holding {1, 1} and {4}, weighted by examples, the
server holds (1 + 1 + 4) / 3 = 2.0 (see tests/test_engine.py).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, NamedTuple, Optional

import jax

PyTree = Any
ServerState = Any
ClientState = Any
Variables = Any


class ClientData(NamedTuple):
  """One client's data as ``client_update`` sees it (inside vmap: no client axis).

  Attributes:
    x: [N, ...] inputs, zeros where padded.
    y: [N] int32 labels.
    mask: [N] bool, True for real examples.
    num_examples: [] int32.
    step_budget: [] int32, the most local steps this client may run this round
      (stragglers run fewer; set by the engine).
  """
  x: jax.Array
  y: jax.Array
  mask: jax.Array
  num_examples: jax.Array
  step_budget: jax.Array


class ClientOutput(NamedTuple):
  """What a client sends back: ``update`` (aggregated by the server with the
  round's weights) and scalar ``metrics`` (averaged for logging)."""
  update: PyTree
  metrics: Dict[str, jax.Array]


class FederatedAlgorithm(NamedTuple):
  """A training method.

  Attributes:
    init: (rng, example_x [B, ...]) -> ServerState.
    init_client_state: (ServerState) -> ClientState of ONE client; the engine
      stacks it to [K_total, ...] and gathers/scatters by cohort index. Use ()
      for stateless methods.
    client_update: (ServerState, ClientState, ClientData, rng) ->
      (ClientOutput, ClientState). Written for one client, pure; the engine vmaps it.
    server_update: (ServerState, ClientOutput stacked [C, ...], weights [C]) ->
      ServerState. ``weights`` sum to 1 (or are all 0 when no sampled client has data).
    personalize: (ServerState, ClientState, ClientData, rng) -> Variables, the
      model this client evaluates with as its personalised model, or None when
      the method has no personalised model (FedAvg, FedProx).
    global_model: (ServerState) -> Variables, or None when the method has no
      global model (Local, FedBN): then only personalised results are reported.
    num_classes: C, the labels the model predicts (``algorithms.build`` sets it from
      the module): the compiled round refuses data with labels outside [0, C).
      None: labels are not range-checked.
  """
  init: Callable[[jax.Array, jax.Array], ServerState]
  init_client_state: Callable[[ServerState], ClientState]
  client_update: Callable[..., tuple]
  server_update: Callable[..., ServerState]
  personalize: Optional[Callable[..., Variables]]
  global_model: Optional[Callable[[ServerState], Variables]]
  num_classes: Optional[int] = None
