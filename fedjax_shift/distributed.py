"""One experiment over several processes (``jax.distributed.initialize()``: a TPU pod
slice, a SLURM job over GPU nodes, plain hosts, or processes on one machine).

Every process runs the same pipeline on the same config: it builds the same data and
the same programs, and the compiled round runs over the global mesh of every process's
devices. Process 0 alone touches the workdir's files (the lock, run.json,
metrics.jsonl, results, tables, plots, TensorBoard files) and prints progress; every
process takes part in saving and restoring checkpoints, as orbax requires. Decisions
that can refuse a run (the lock, the fingerprints) are taken by process 0 and reach
every process before anything is written (``agree``), so that no process trains while
another refused.

With one process every function here is the single-process behaviour.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional

import jax
import numpy as np

# Bytes of process 0's message that ``agree`` carries to the others.
MESSAGE_BYTES = 4096


def is_primary() -> bool:
  """Whether this process writes the workdir's files (process 0)."""
  return jax.process_index() == 0


def agree(error: Optional[str]) -> Optional[str]:
  """Process 0's ``error`` (None: it went on), on every process. Every process must
  call it at the same point; with one process it returns ``error``."""
  if jax.process_count() == 1:
    return error
  from jax.experimental import multihost_utils
  text = (error or '').encode()[:MESSAGE_BYTES - 1]
  buffer = np.zeros(MESSAGE_BYTES, np.uint8)
  if error is not None:
    buffer[0] = 1
    buffer[1:1 + len(text)] = np.frombuffer(text, np.uint8)
  buffer = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
  if not buffer[0]:
    return None
  return bytes(buffer[1:]).rstrip(b'\0').decode(errors='replace')


class PrimaryDecided(RuntimeError):
  """Process 0 raised while taking a decision the other processes follow."""


def primary_decides(decide: Callable[[], Any], what: str) -> Any:
  """``decide()`` evaluated on process 0 alone, its value (JSON; under MESSAGE_BYTES)
  returned on every process, or its error raised on every process (the others' naming
  ``what``). For decisions read from the workdir's files, which process 0 writes and
  the others could read half-written: every process then takes the same path to the
  collectives that follow. Every process must call it at the same point; with one
  process it returns ``decide()``."""
  if jax.process_count() == 1:
    return decide()
  if not is_primary():
    reply = json.loads(agree(None) or '{}')
    if 'error' in reply:
      raise PrimaryDecided(f'process 0 stopped at {what}: {reply["error"]}')
    return reply.get('value')
  try:
    value = decide()
  except Exception as err:
    agree(json.dumps({'error': f'{type(err).__name__}: {err}'[:MESSAGE_BYTES // 2]}))
    raise
  message = json.dumps({'value': value})
  if len(message.encode()) >= MESSAGE_BYTES:
    raise ValueError(f'{what}: a decision of {len(message)} bytes, more than the '
                     f'{MESSAGE_BYTES} process 0 can send')   # not raised in the others: a bug
  agree(message)
  return value


def require_in_step(what: str) -> None:
  """Raises RuntimeError naming ``what`` on every process when the processes reached
  this call at different points (``what`` differs, e.g. another run directory): a
  run whose processes took different paths stops here, before a collective that
  would wait for the others until a timeout. Every process must call it."""
  differing = differing_processes(what)
  if differing:
    from jax.experimental import multihost_utils
    names = multihost_utils.process_allgather(np.frombuffer(
        what.encode()[:256].ljust(256, b'\0'), np.uint8))
    where = {i: bytes(np.asarray(names)[i]).rstrip(b'\0').decode(errors='replace')
             for i in range(np.asarray(names).shape[0])}
    raise RuntimeError(f'the processes of this run are out of step: process 0 is at '
                       f'{where[0]!r}, ' + ', '.join(f'process {i} at {where[i]!r}'
                                                       for i in differing) +
                       '; every process must run the same command on the same workdir')


def open_output(path: str, mode: str = 'w'):
  """``open(path, mode)`` on process 0; elsewhere a sink (the workdir has one writer)."""
  return open(path if is_primary() else os.devnull, mode)


def differing_processes(text: str) -> list:
  """The processes whose ``text`` (e.g. their config) differs from process 0's, on
  every process ([] with one process). Every process must call it at the same point."""
  if jax.process_count() == 1:
    return []
  import hashlib
  from jax.experimental import multihost_utils
  digest = np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint8)
  every = np.asarray(multihost_utils.process_allgather(digest))   # [processes, 32]
  return [i for i in range(every.shape[0]) if not np.array_equal(every[i], every[0])]


def coordination_client():
  """The coordination service's client that ``jax.distributed.initialize()`` made, or
  None (not initialized, or a jax that keeps it elsewhere). jax has no public accessor
  (``jax.distributed`` offers initialize, is_initialized and shutdown), so this reads
  ``jax._src.distributed.global_state.client``, the one private name the library uses;
  tests/test_distributed.py checks it, and its ``get_live_nodes``, on the installed jax."""
  try:
    from jax._src import distributed as jax_distributed
  except ImportError:
    return None
  client = getattr(getattr(jax_distributed, 'global_state', None), 'client', None)
  return client if hasattr(client, 'get_live_nodes') else None


def lost_processes(wait_seconds: float) -> list:
  """The processes the coordination service no longer hears from, waiting up to
  ``wait_seconds`` for it to notice ([] if none was noticed, with one process, or
  where this jax gives no ``coordination_client``)."""
  client = coordination_client()
  if jax.process_count() == 1 or client is None:
    return []
  import time
  everyone = list(range(jax.process_count()))
  deadline = time.time() + wait_seconds
  while True:
    try:
      live = set(client.get_live_nodes(everyone))
    except Exception:   # the service itself is gone: process 0's host
      return [0] if jax.process_index() else []
    lost = [i for i in everyone if i not in live]
    if lost or time.time() > deadline:
      return lost
    time.sleep(1.0)


def wait_for_coordinator(address: str, timeout_seconds: float) -> Optional[str]:
  """Waits up to ``timeout_seconds`` for ``address`` ('host:port', process 0's
  coordinator) to accept a TCP connection; None when it did, else the last error."""
  import socket
  import time
  host, _, port = address.rpartition(':')
  deadline = time.time() + timeout_seconds
  while True:
    try:
      with socket.create_connection((host.strip('[]'), int(port)), timeout=5):
        return None
    except (OSError, ValueError) as err:
      if time.time() >= deadline:
        return f'{type(err).__name__}: {err}'
    time.sleep(0.5)


def runtime_abort_begins(line: str) -> bool:
  """Whether ``line`` begins the end JAX's distributed runtime gives a process: its
  absl F-line (or the C++ stack after it), or a collective's C++ exception that nothing
  catches (Gloo's, when a peer's connection breaks mid-message); then SIGABRT and
  Python's dump of its threads."""
  import re
  return ('Check failure stack trace' in line or 'Terminating process because' in line
          or line.startswith(('terminate called after throwing', PYTHON_ABORT_DUMP))
          or bool(re.match(r'F\d{4} .*(coordination|distributed|heartbeat|[Bb]arrier)', line)))


# The line Python's faulthandler prints on SIGABRT before each thread's stack: the
# stacks after it say where Python waited, nothing of the cause.
PYTHON_ABORT_DUMP = 'Fatal Python error: Aborted'


def runtime_stop_cause(text: str, process_id: Optional[int], num_processes: Optional[int],
                       coordinator: Optional[str], heartbeat_seconds: int,
                       initialization_seconds: int) -> str:
  """Why JAX's distributed runtime aborted process ``process_id`` of a run, from the
  last lines ``text`` it printed: the processes it lost (the coordination service lists
  their task ids after 'stopped sending heartbeats):' or as 'task:N'), that the run never
  gathered its processes (the registration timed out), or that the coordinator went
  away."""
  import re
  listed = re.findall(r'stopped sending heartbeats\):\s*((?:\d+\s*)+)', text)
  tasks = sorted(({int(t) for group in listed for t in group.split()} |
                  {int(t) for t in re.findall(r'task[:_/ ]+(\d+)', text)}) - {process_id})
  if 'RegisterTask' in text:
    return (f'the run did not gather its --num_processes={num_processes} processes at '
            f'coordinator {coordinator} within --initialization_timeout='
            f'{initialization_seconds}s (start every process with the same --coordinator '
            f'and --num_processes, and a distinct --process_id below {num_processes})')
  if 'heartbeat' in text.lower() and tasks:
    return (f'process {", ".join(map(str, tasks))} of this run stopped answering (no '
            f'heartbeat for --heartbeat_timeout={heartbeat_seconds}s): killed, crashed or '
            f'cut off from the network')
  gloo = re.search(r"instance of 'gloo::[^']*'\s*what\(\):\s*([^\n]*)", text)
  if gloo:   # a peer's connection broke inside a collective; with two, the peer is known
    peer = (f'process {1 - process_id} of this run' if num_processes == 2
            and process_id in (0, 1) else 'another process of this run')
    return (f'a collective with the other processes failed in Gloo '
            f'({" ".join(gloo.group(1).split())[:300]}): {peer} stopped (its log says '
            f'why), or the network between the processes failed')
  if process_id and ('UNAVAILABLE' in text or 'Socket closed' in text):
    return (f'the coordinator {coordinator} (process 0) went away: process 0 stopped or '
            f'its host cannot be reached')
  lines = text.splitlines()
  first = next((i for i, line in enumerate(lines) if runtime_abort_begins(line)), 0)
  return ('JAX\'s distributed runtime reported a fatal error of the run (another process '
          'stopped, or the network between them failed): ' +
          ' '.join(' '.join(lines[first:]).split())[:400])


def port_holder(port: int) -> Optional[str]:
  """'pid P (command)' of the process listening on TCP ``port`` on this host (Linux's
  /proc, the processes this user may read), or None when it cannot be told."""
  listening = set()
  for table in ('/proc/net/tcp', '/proc/net/tcp6'):
    try:
      with open(table) as f:
        rows = f.read().splitlines()[1:]
    except OSError:
      continue
    for row in rows:
      fields = row.split()
      if len(fields) > 9 and fields[3] == '0A' and int(fields[1].rsplit(':', 1)[1], 16) == port:
        listening.add(fields[9])   # the socket's inode
  for pid in (p for p in os.listdir('/proc') if p.isdigit()) if listening else ():
    try:
      for fd in os.listdir(f'/proc/{pid}/fd'):
        target = os.readlink(f'/proc/{pid}/fd/{fd}')
        if target.startswith('socket:[') and target[8:-1] in listening:
          with open(f'/proc/{pid}/cmdline', 'rb') as f:
            command = f.read().replace(b'\0', b' ').decode(errors='replace').strip()
          return f'pid {pid} ({command[:120]})'
    except OSError:
      continue
  return None


def coordinator_port_problem(address: str) -> Optional[str]:
  """Why process 0 cannot serve the coordinator at ``address`` ('host:port') on this
  host: the port is held by another program (named where this user can see it); None
  when it can be bound."""
  import socket
  host, _, port = address.rpartition(':')
  try:
    number = int(port)
  except ValueError:
    return f'--coordinator={address}: the port {port!r} is not a number'
  with socket.socket(socket.AF_INET6 if ':' in host.strip('[]') else socket.AF_INET) as probe:
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as a server binds
    try:
      probe.bind(('', number))
    except OSError as err:
      holder = port_holder(number)
      return (f'the coordinator port {number} is in use on this host'
              f'{" by " + holder if holder else ""} ({err.strerror}): stop that program or '
              f'pass another port in --coordinator on every process')
  return None
