"""The decisions several processes of one run take together (fedjax_shift/distributed.py),
with the collectives replaced by what two processes would exchange: process 0 decides
what it reads from the workdir and the others follow; processes out of step stop naming
where each is."""
import json

import numpy as np
import pytest

from fedjax_shift import distributed


@pytest.fixture
def two_processes(monkeypatch):
  """This process as ``index`` of two; ``sent`` holds process 0's broadcast buffers,
  ``gathered`` what each process contributes to an allgather (the other's fixed)."""
  from jax.experimental import multihost_utils
  state = {'index': 0, 'sent': [], 'other': None}
  monkeypatch.setattr(distributed.jax, 'process_count', lambda: 2)
  monkeypatch.setattr(distributed.jax, 'process_index', lambda: state['index'])

  def broadcast(buffer):
    if state['index'] == 0:
      state['sent'].append(np.array(buffer))
      return buffer
    return state['sent'][-1]

  def allgather(mine):
    other = state['other'](mine) if state['other'] else mine
    return np.stack([mine, other] if state['index'] == 0 else [other, mine])
  monkeypatch.setattr(multihost_utils, 'broadcast_one_to_all', broadcast)
  monkeypatch.setattr(multihost_utils, 'process_allgather', allgather)
  return state


def test_process_0_decides_and_the_others_follow_without_reading(two_processes):
  read = []
  assert distributed.primary_decides(lambda: read.append(0) or {'round': 4}, 'x') == \
      {'round': 4}
  two_processes['index'] = 1    # process 1: takes process 0's value, reads nothing
  assert distributed.primary_decides(lambda: read.append(1) or {'round': 0}, 'x') == \
      {'round': 4}
  assert read == [0]


def test_process_0s_error_stops_every_process_naming_the_decision(two_processes):
  def refuse():
    raise ValueError('run.json holds another configuration')
  with pytest.raises(ValueError, match='another configuration'):
    distributed.primary_decides(refuse, 'the check of W/run.json')
  assert json.loads(bytes(two_processes['sent'][-1][1:]).rstrip(b'\0'))['error'] == \
      'ValueError: run.json holds another configuration'
  two_processes['index'] = 1
  with pytest.raises(distributed.PrimaryDecided, match=r'process 0 stopped at the check of '
                                                      r'W/run.json: ValueError: run.json'):
    distributed.primary_decides(lambda: None, 'the check of W/run.json')


def test_processes_out_of_step_stop_naming_where_each_is(two_processes):
  distributed.require_in_step('fedavg seed 0')   # both at one place: nothing happens
  two_processes['other'] = lambda mine: (
      np.frombuffer(b'ditto seed 0'.ljust(256, b'\0'), np.uint8) if mine.size == 256 else
      np.zeros_like(mine))
  with pytest.raises(RuntimeError, match=r"out of step: process 0 is at 'fedavg seed 0', "
                                         r"process 1 at 'ditto seed 0'"):
    distributed.require_in_step('fedavg seed 0')


def test_a_coordinator_that_never_answers_is_named_within_the_timeout():
  import socket
  import time
  with socket.socket() as s:   # a port nothing listens on
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  tick = time.time()
  problem = distributed.wait_for_coordinator(f'127.0.0.1:{port}', 1.0)
  assert 'Connection refused' in problem and time.time() - tick < 10
  with socket.socket() as server:
    server.bind(('127.0.0.1', 0))
    server.listen()
    assert distributed.wait_for_coordinator(f'127.0.0.1:{server.getsockname()[1]}', 1.0) is None


# The lines JAX 0.10's distributed runtime printed before aborting a process (CPU,
# two processes on the loopback address), cut to what names the cause.
LOST_PROCESS = """E1202 10:56:24.847866   17255 coordination_service.cc:1549] [1167] Use error polling to propagate the following error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):
1
The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, eviction) to debug further. [type.googleapis.com/tensorflow.CoordinationServiceError='']
E1202 10:56:24.848641   17266 coordination_service_agent.cc:289] Polled an error from coordination service (this can be an error from this or another task).
F1202 10:56:24.849001   17266 client.h:80] Terminating process because the JAX distributed service detected fatal errors.
"""
NOT_GATHERED = """F1202 08:07:01.466161   21899 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died; see the other task logs for more details. absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded

RPC: /xla.coordination.CoordinationService/RegisterTask
*** Check failure stack trace: ***
"""
# A peer killed inside a collective: Gloo's exception, uncaught, then Python's dump.
GLOO_ABORT = """[Gloo] Rank 0 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3
terminate called after throwing an instance of 'gloo::EnforceNotMet'
  what():  [enforce fail at external/gloo/gloo/transport/tcp/pair.cc:459] op.preamble.length <= op.nbytes. 160 vs 4. Received data size doesn't match expected size. Is there a distributed collective mismatch in your code?
Fatal Python error: Aborted
"""


def test_the_runtimes_abort_is_summarised_by_its_cause():
  cause = lambda text, process: distributed.runtime_stop_cause(  # noqa: E731
      text, process, 3, '127.0.0.1:1234', 10, 15)
  assert cause(LOST_PROCESS, 0).startswith(
      'process 1 of this run stopped answering (no heartbeat for --heartbeat_timeout=10s)')
  assert cause(NOT_GATHERED, 1).startswith(
      'the run did not gather its --num_processes=3 processes at coordinator 127.0.0.1:1234 '
      'within --initialization_timeout=15s')
  two = lambda text, process: distributed.runtime_stop_cause(  # noqa: E731
      text, process, 2, '127.0.0.1:1234', 10, 15)
  assert two(GLOO_ABORT, 0) == (
      'a collective with the other processes failed in Gloo ([enforce fail at external/gloo/'
      'gloo/transport/tcp/pair.cc:459] op.preamble.length <= op.nbytes. 160 vs 4. Received '
      'data size doesn\'t match expected size. Is there a distributed collective mismatch in '
      'your code?): process 1 of this run stopped (its log says why), or the network between '
      'the processes failed')
  assert 'another process of this run stopped' in cause(GLOO_ABORT, 0)   # one of two peers
  # anything else: the runtime's own words from its first fatal line, not what came before
  other = 'I1202 starting\nF1202 10:56:24.849001 1 client.h:80] Terminating process because X\n'
  assert cause(other, 0).endswith('failed): F1202 10:56:24.849001 1 client.h:80] '
                                  'Terminating process because X')
  begins = [distributed.runtime_abort_begins(line) for line in GLOO_ABORT.splitlines()]
  assert begins == [False, True, False, True]
  begins = [distributed.runtime_abort_begins(line) for line in LOST_PROCESS.splitlines()]
  assert begins == [False, False, False, False, True]   # its error lines are still shown
  assert distributed.runtime_abort_begins('*** Check failure stack trace: ***')
  assert not distributed.runtime_abort_begins('2026-12-02 10:56:04,764 fedavg seed 0: 6 clients')


def test_the_coordination_client_is_where_this_jax_keeps_it(two_processes, monkeypatch):
  """The one private jax name the library reads (no public accessor exists): on the
  installed jax the client of ``jax.distributed.initialize()`` is
  ``jax._src.distributed.global_state.client`` (None before initialize) and its class
  answers ``get_live_nodes``; a client that says process 1 is gone is named."""
  import jax
  from jax._src import distributed as jax_distributed
  from jax._src.lib import _jax
  assert set(dir(jax.distributed)) >= {'initialize', 'is_initialized', 'shutdown'}
  assert jax_distributed.global_state.client is None
  assert distributed.coordination_client() is None
  assert hasattr(_jax.DistributedRuntimeClient, 'get_live_nodes')

  class Client:
    def get_live_nodes(self, everyone):
      return [0]
  monkeypatch.setattr(jax_distributed.global_state, 'client', Client())
  assert distributed.lost_processes(wait_seconds=0) == [1]
  monkeypatch.setattr(jax_distributed.global_state, 'client', None)
  assert distributed.lost_processes(wait_seconds=0) == []   # nothing to ask: none named
