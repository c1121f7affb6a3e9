"""One experiment over several processes (JAX's distributed runtime), proven on one
machine: two processes × two CPU devices on the loopback address against one process
with four, through launch/train.py as a user runs it."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, 'launch', 'train.py')
# One cohort of 4 over 4 devices; FedAvg and Ditto (a personal model per client).
FLAGS = ['--config=' + os.path.join(ROOT, 'configs', 'default.py') + ':tiny',
         '--config.cohort_size=4', '--config.engine.num_devices=4',
         "--config.algorithms=('fedavg','ditto')", '--compilation_cache=']
# Two processes reduce the cohort's updates over Gloo, one process inside XLA: the same
# sums in another order, so float32 rounding apart (the losses differed by 6e-8).
RTOL, ATOL = 1e-5, 1e-6


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def environment(devices: int) -> dict:
  env = dict(os.environ)
  env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') +
                      f' --xla_force_host_platform_device_count={devices}').strip()
  env['JAX_PLATFORMS'] = 'cpu'
  return env


def start_processes(workdir, *flags, heartbeat: int = 100, flags_of=None,
                    num_processes: int = 2, started=(0, 1)):
  """The processes ``started`` of one run of ``num_processes`` on the loopback address;
  their logs beside it (``flags_of``: {process id: extra flags of that process alone})."""
  port = free_port()
  procs = []
  for process_id in started:
    log = open(f'{workdir}.process{process_id}.log', 'w')
    procs.append(subprocess.Popen(
        [sys.executable, TRAIN, f'--workdir={workdir}', '--distributed',
         f'--coordinator=127.0.0.1:{port}', f'--num_processes={num_processes}',
         f'--process_id={process_id}', f'--heartbeat_timeout={heartbeat}', *FLAGS, *flags,
         *(flags_of or {}).get(process_id, ())],
        env=environment(2), stdout=log, stderr=subprocess.STDOUT))
  return procs


def wait(procs, timeout=600):
  return [proc.wait(timeout=timeout) for proc in procs]


def log_of(workdir, process_id: int) -> str:
  with open(f'{workdir}.process{process_id}.log') as f:
    return f.read()


def one_process(workdir, *flags):
  subprocess.run([sys.executable, TRAIN, f'--workdir={workdir}', *FLAGS, *flags],
                 env=environment(4), check=True, capture_output=True, timeout=600)


def records(workdir, method):
  with open(os.path.join(workdir, method, 'seed_0', 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def results(workdir, method):
  with open(os.path.join(workdir, method, 'seed_0', 'results.json')) as f:
    return json.load(f)


def final_state(workdir, method):
  """The arrays of the last checkpoint but the training seconds, in name order."""
  import jax
  from fedjax_shift import checkpoint
  _, tree = checkpoint.read(os.path.join(workdir, method, 'seed_0', 'checkpoints'))
  del tree['seconds']
  return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


def assert_same_runs(workdir, reference):
  for method in ('fedavg', 'ditto'):
    ours, theirs = final_state(workdir, method), final_state(reference, method)
    assert len(ours) == len(theirs) > 0
    for ours, theirs in zip(ours, theirs):
      np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=ATOL, err_msg=method)
    ours, theirs = records(workdir, method), records(reference, method)
    assert [r['round'] for r in ours] == [r['round'] for r in theirs]
    np.testing.assert_allclose([r['loss'] for r in ours], [r['loss'] for r in theirs],
                               rtol=RTOL, atol=ATOL, err_msg=method)
    a, b = results(workdir, method)['metrics'], results(reference, method)['metrics']
    assert a.keys() == b.keys()
    for name in a:
      np.testing.assert_allclose(a[name], b[name], rtol=RTOL, atol=ATOL,
                                 err_msg=f'{method} {name}')


def test_two_processes_equal_one_process_with_as_many_devices(tmp_path):
  workdir, reference = str(tmp_path / 'two'), str(tmp_path / 'one')
  assert wait(start_processes(workdir)) == [0, 0], log_of(workdir, 0) + log_of(workdir, 1)
  one_process(reference)
  assert_same_runs(workdir, reference)
  # one set of files, written by process 0 alone; process 1 prints no table
  with open(os.path.join(workdir, 'config_history.jsonl')) as f:
    assert len(f.readlines()) == 1
  assert len(records(workdir, 'fedavg')) == 3
  assert results(workdir, 'fedavg')['hardware']['processes'] == 2
  assert '| fedavg |' in log_of(workdir, 0) and '| fedavg |' not in log_of(workdir, 1)
  assert not os.path.exists(os.path.join(workdir, '.lock'))
  # the files of one process's run, nothing more (checkpoints: orbax's own layout)
  def listing(root):
    return sorted(os.path.relpath(os.path.join(directory, name), root)
                  for directory, _, names in os.walk(root) for name in names
                  if 'checkpoints' not in directory and 'tensorboard' not in directory)
  assert listing(workdir) == listing(reference)
  events = lambda root: len([n for d, _, names in os.walk(root) for n in names  # noqa: E731
                             if 'tfevents' in n])
  assert events(workdir) == events(reference) == 2
  # a changed fingerprinted field: process 0 refuses, and process 1 stops naming why
  codes = wait(start_processes(workdir, '--config.client.learning_rate=0.5'))
  assert codes[0] != 0 and codes[1] != 0
  assert 'client.learning_rate' in log_of(workdir, 0)
  assert 'process 0 refused the run' in log_of(workdir, 1)
  assert 'client.learning_rate' in log_of(workdir, 1)




def test_bad_starts_are_refused_on_every_process(tmp_path):
  # another config on process 1: refused on both, before anything is written
  workdir = str(tmp_path / 'configs')
  codes = wait(start_processes(workdir, flags_of={1: ['--config.client.learning_rate=0.5']}))
  assert codes[0] != 0 and codes[1] != 0
  for process_id in (0, 1):
    assert 'processes [1] were started with another config' in log_of(workdir, process_id)
  assert not os.path.exists(os.path.join(workdir, 'config.json'))
  # more devices than the run has: named with both numbers
  workdir = str(tmp_path / 'devices')
  codes = wait(start_processes(workdir, '--config.engine.num_devices=8',
                               '--config.cohort_size=8', '--config.data.num_clients=8'))
  assert codes[0] != 0 and codes[1] != 0
  assert 'set it to 4, got 8' in log_of(workdir, 0) and 'set it to 4, got 8' in log_of(workdir, 1)
  # no coordinator: stops within the stated timeout naming the address
  port = free_port()
  tick = time.time()
  out = subprocess.run([sys.executable, TRAIN, f'--workdir={tmp_path / "alone"}',
                        '--distributed', f'--coordinator=127.0.0.1:{port}',
                        '--num_processes=2', '--process_id=1', '--initialization_timeout=5',
                        *FLAGS], env=environment(2), capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 1 and time.time() - tick < 60      # not SIGABRT's -6
  assert f'joining the run at coordinator 127.0.0.1:{port}' in out.stderr
  assert (f'could not reach the coordinator 127.0.0.1:{port} (process 0) within '
          f'--initialization_timeout=5s') in out.stderr


def test_a_process_that_never_arrives_stops_the_others_within_the_timeout(tmp_path):
  # Before: both processes ended in the runtime's SIGABRT (exit 134) after a C++ stack.
  # Now: each ends (exit 1) within --initialization_timeout and a margin, naming the
  # process count it waited for, nothing written.
  workdir = str(tmp_path / 'three')
  tick = time.time()
  procs = start_processes(workdir, '--initialization_timeout=10', num_processes=3)
  assert wait(procs, timeout=120) == [1, 1]
  assert time.time() - tick < 60
  for process_id in (0, 1):
    text = log_of(workdir, process_id)
    assert (f'process {process_id}: stopped by JAX\'s distributed runtime: the run did not '
            f'gather its --num_processes=3 processes') in text, text[-2000:]
    assert 'within --initialization_timeout=10s' in text
    assert 'Check failure stack trace' not in text
  assert not os.path.exists(workdir)


def wait_for_checkpoint(workdir, deadline):
  """Until fedavg's first checkpoint of ``workdir`` is saved."""
  directory = os.path.join(workdir, 'fedavg', 'seed_0', 'checkpoints')
  while time.time() < deadline:
    if os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory)):
      return
    time.sleep(0.5)
  raise TimeoutError(f'no checkpoint in {directory}')


@pytest.mark.slow
@pytest.mark.parametrize('per_call', [1, 5])
def test_killed_processes_resume_and_a_lost_process_stops_the_other(tmp_path, per_call):
  flags = ('--config.eval_every=12', '--config.checkpoint_every=1',
           f'--config.engine.rounds_per_call={per_call}')
  reference = str(tmp_path / 'one')
  one_process(reference, '--config.rounds=12', *flags)
  # both killed mid-run, then the same command again: the uninterrupted end state
  workdir = str(tmp_path / 'two')
  procs = start_processes(workdir, '--config.rounds=12', *flags)
  wait_for_checkpoint(workdir, time.time() + 300)
  for proc in procs:
    proc.send_signal(signal.SIGKILL)
  wait(procs)
  assert wait(start_processes(workdir, '--config.rounds=12', *flags)) == [0, 0], \
      log_of(workdir, 0)
  assert 'resumed from round' in log_of(workdir, 0)
  assert_same_runs(workdir, reference)
  # process 1 killed alone in a long run: process 0 stops with an error naming it
  lost = str(tmp_path / 'lost')
  procs = start_processes(lost, '--config.rounds=1000', *flags, heartbeat=20)
  wait_for_checkpoint(lost, time.time() + 300)
  procs[1].send_signal(signal.SIGKILL)
  tick = time.time()
  code = procs[0].wait(timeout=120)
  assert code != 0 and time.time() - tick < 120
  # train.py's message names the lost process and the resume command, whether a
  # collective failed first or the runtime's heartbeat check (no C++ stack either way)
  text = log_of(lost, 0)
  assert 'process 1 of this run stopped' in text, text[-2000:]
  assert 'with the same command to resume' in text, text[-2000:]
  assert 'Check failure stack trace' not in text, text[-2000:]


@pytest.mark.slow
def test_a_host_store_over_two_processes_equals_one_process(tmp_path):
  """Each process gathers and moves only its own devices' clients of the cohort."""
  workdir, reference = str(tmp_path / 'two'), str(tmp_path / 'one')
  assert wait(start_processes(workdir, '--config.data.store=host')) == [0, 0], \
      log_of(workdir, 0)
  one_process(reference)
  assert_same_runs(workdir, reference)


def test_a_coordinator_port_held_by_another_program_is_named(tmp_path):
  # Before: process 0 ended in the runtime's SIGABRT (exit 134) with a C++ stack, the
  # port never named. Now: refused before JAX starts, naming the port and its holder.
  with socket.socket() as holder:
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(('127.0.0.1', 0))
    holder.listen()
    port = holder.getsockname()[1]
    out = subprocess.run([sys.executable, TRAIN, f'--workdir={tmp_path / "run"}',
                          '--distributed', f'--coordinator=127.0.0.1:{port}',
                          '--num_processes=2', '--process_id=0', *FLAGS],
                         env=environment(2), capture_output=True, text=True, timeout=120)
  assert out.returncode == 2, out.stderr[-2000:]
  assert f'the coordinator port {port} is in use on this host by pid {os.getpid()}' in out.stderr
  assert 'Check failure stack trace' not in out.stderr
  assert not os.path.exists(tmp_path / 'run')
