"""Runs that never report a wrong result: resuming checks the config, one writer per
workdir, damaged checkpoints fall back, metrics history is never dropped silently,
and bad data or hyperparameters are errors naming the field, client or file."""
import glob
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import ml_collections
import numpy as np
import pytest

from fedjax_shift import pipelines
from fedjax_shift import config as config_lib
from fedjax_shift.benchmarks import build_benchmark
from fedjax_shift.checkpoint import CheckpointMismatchError, Checkpointer
from fedjax_shift.data.federated import stack_clients, validate
from fedjax_shift.metrics import MetricsWriter, read_metrics, without_timing
from fedjax_shift.pipelines.single_run import RunInputs, train_and_evaluate
from fedjax_shift.pipelines.workdir import RunMismatchError, WorkdirBusyError, WorkdirLock
from helpers import override, tiny_config, write_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join('fedavg', 'seed_0')


def quick(**overrides):
  """A 4-round tiny run checkpointed every round, keeping 2."""
  return tiny_config(**{'rounds': 4, 'checkpoint_every': 1, 'eval_every': 2, **overrides})


def files_of(workdir):
  """{relative path: bytes} of every file under ``workdir``."""
  out = {}
  for directory, _, files in os.walk(workdir):
    for name in files:
      path = os.path.join(directory, name)
      with open(path, 'rb') as f:
        out[os.path.relpath(path, workdir)] = f.read()
  return out


def metrics_of(workdir):
  return without_timing(read_metrics(os.path.join(workdir, RUN, 'metrics.jsonl')))


def test_resume_with_another_config_is_refused_and_touches_nothing(tmp_path):
  pipelines.run(quick(), str(tmp_path))
  before = files_of(tmp_path)
  with pytest.raises(RunMismatchError, match=r'client.learning_rate: 0.05 → 0.5'):
    pipelines.run(quick(**{'client.learning_rate': 0.5, 'rounds': 8}), str(tmp_path))
  with pytest.raises(RunMismatchError, match=r'model.hidden: \[32\] → \[64\]'):
    pipelines.run(quick(**{'model.hidden': (64,)}), str(tmp_path))
  assert files_of(tmp_path) == before  # config.json included: it still names the old run


def test_client_overrides_are_compared_by_the_values_they_train_with(tmp_path):
  # Before: an override equal to the shared rate was refused ('fedavg.client_learning_rate:
  # 0.0 → 0.05', the same training), and a removed one read '0.3 → 0.0' (a rate of zero).
  pipelines.run(quick(), str(tmp_path))
  shared = quick().client.learning_rate
  same = quick(client_overrides=ml_collections.ConfigDict(
      {'fedavg': {'learning_rate': shared}}))
  pipelines.run(same, str(tmp_path))                      # resumes: nothing changed
  other = quick(client_overrides=ml_collections.ConfigDict({'fedavg': {'learning_rate': 0.3}}))
  with pytest.raises(RunMismatchError) as raised:
    pipelines.run(other, str(tmp_path))
  assert (f'client_overrides.fedavg.learning_rate: {shared} (none: the shared '
          f'client.learning_rate) → 0.3') in str(raised.value)
  assert 'client_learning_rate' not in str(raised.value)
  trained = tmp_path / 'trained_with_override'
  pipelines.run(other, str(trained))
  with pytest.raises(RunMismatchError, match=r'client_overrides.fedavg.learning_rate: 0.3 → '
                     rf'{shared} \(none: the shared client.learning_rate\)'):
    pipelines.run(quick(), str(trained))
  # The shared rate does not train a method that overrides it.
  pipelines.run(override(other.copy_and_resolve_references(), **{'client.learning_rate': 0.7}),
                str(trained))


def test_other_benchmarks_fields_do_not_fingerprint_a_run(tmp_path):
  """A run recorded by an older library whose config had other fields for other
  benchmarks (or a newer one that adds a benchmark, e.g. upfl's
  data.new_client_fraction) still resumes; its own benchmark's fields still count."""
  pipelines.run(quick(), str(tmp_path))
  path = os.path.join(tmp_path, RUN, 'run.json')
  with open(path) as f:
    recorded = json.load(f)
  assert 'data.new_client_fraction' not in recorded['fields']    # upfl's field
  assert 'data.num_clients' in recorded['fields']
  recorded['fields']['data.new_client_fraction'] = '0.3'
  recorded['fields']['data.rotation_step'] = '8.0'               # an evolving field
  with open(path, 'w') as f:
    json.dump(recorded, f)
  pipelines.run(quick(), str(tmp_path))    # resumes, nothing refused
  recorded['fields']['data.num_clients'] = '99'
  with open(path, 'w') as f:
    json.dump(recorded, f)
  with pytest.raises(RunMismatchError, match=r'data.num_clients: 99 → '):
    pipelines.run(quick(), str(tmp_path))


def test_raising_rounds_needs_resume_extend_and_matches_a_fresh_run(tmp_path):
  pipelines.run(quick(), str(tmp_path / 'run'))
  with pytest.raises(RunMismatchError, match='--config.resume=extend'):
    pipelines.run(quick(rounds=6), str(tmp_path / 'run'))
  extended = pipelines.run(quick(rounds=6, resume='extend'), str(tmp_path / 'run'))
  fresh = pipelines.run(quick(rounds=6), str(tmp_path / 'fresh'))
  assert metrics_of(tmp_path / 'run') == metrics_of(tmp_path / 'fresh')
  assert extended.records['results'][0]['metrics'] == fresh.records['results'][0]['metrics']
  history = json.load(open(tmp_path / 'run' / RUN / 'run.json'))['history']
  assert [h['event'] for h in history] == ['created', 'extended']


def test_lowering_rounds_evaluates_that_checkpoint_or_refuses(tmp_path):
  pipelines.run(quick(), str(tmp_path / 'run'))  # keeps the checkpoints of rounds 3 and 4
  metrics_before = metrics_of(tmp_path / 'run')
  three = pipelines.run(quick(rounds=3), str(tmp_path / 'run'))
  fresh = pipelines.run(quick(rounds=3), str(tmp_path / 'fresh'))
  assert three.records['results'][0]['rounds'] == 3
  assert three.records['results'][0]['metrics'] == fresh.records['results'][0]['metrics']
  assert metrics_of(tmp_path / 'run') == metrics_before  # nothing dropped
  with pytest.raises(RunMismatchError, match=r'kept checkpoints of rounds \[3, 4\]'):
    pipelines.run(quick(rounds=2), str(tmp_path / 'run'))


def test_checkpoint_of_other_shapes_is_an_error_naming_them(tmp_path):
  checkpointer = Checkpointer(str(tmp_path), 1, 2)
  checkpointer.save(1, {'w': np.zeros((32, 3))}, force=True)
  with pytest.raises(CheckpointMismatchError, match=r'shape \(32, 3\) where this run.s '
                                                    r'state has \(64, 3\)'):
    checkpointer.restore({'w': np.zeros((64, 3))})
  checkpointer.close()


@pytest.mark.parametrize('field, value, pattern', [
    ('seeds', (0, 0), r'config.seeds: names 0 more than once'),
    ('seeds', (-1,), r'config.seeds: seeds are integers in \[0, 2\*\*32\), got \[-1\]'),
    ('seeds', (0, 1.5), r'config.seeds: seeds are integers in \[0, 2\*\*32\), got \[1.5\]'),
    ('seeds', (2 ** 32,), r'config.seeds: .*got \[4294967296\]'),   # its keys: seed 0's
    ('seeds', (2 ** 64,), r'config.seeds: .*got \[18446744073709551616\]'),
    ('algorithms', ('fedavg', 'fedavg'), r"config.algorithms: names 'fedavg' more than once"),
    ('eval_adapters', ('tent:online', 'tent:online'),
     r"config.eval_adapters: names \('tent', 'online'\) more than once"),
    ('engine.eval_batch_size', 0, r'config.engine.eval_batch_size: must be >= 1'),
    ('keep_checkpoints', 0, r'config.keep_checkpoints: must be >= 1'),
    ('keep_checkpoints', -1, r'config.keep_checkpoints: must be >= 1'),
    ('client.learning_rate', float('inf'), r'config.client.learning_rate: must be a finite'),
    ('client.momentum', float('nan'), r'config.client.momentum: must be a finite'),
    ('fedprox.mu', float('inf'), r'config.fedprox.mu: must be a finite'),
    ('resume', 'always', r"config.resume: unknown 'always'"),
])
def test_bad_run_fields_are_errors_before_any_work(field, value, pattern, tmp_path):
  with pytest.raises(ValueError, match=pattern):
    pipelines.run(tiny_config(**{field: value}), str(tmp_path))
  assert not os.path.exists(tmp_path / 'config.json')


def test_infinite_dirichlet_alpha_stays_allowed():
  config_lib.validate(tiny_config(**{'data.dirichlet_alpha': float('inf')}))


def test_empty_training_split_is_an_error(tmp_path):
  config = tiny_config(**{'data.split_fractions': ml_collections.ConfigDict(
      {'train': 0.0, 'val': 0.5, 'test': 0.5})})
  with pytest.raises(ValueError, match='train split holds no examples'):
    pipelines.run(config, str(tmp_path))


@pytest.mark.parametrize('layout', ['store', 'padded'])
def test_a_given_benchmark_is_validated(tmp_path, layout):
  config = tiny_config()
  bench = build_benchmark(config.data, 0)
  train = bench.splits['train']
  if layout == 'padded':   # a user's own FederatedData
    train = train.padded()
    doubled = train._replace(num_examples=train.num_examples * 2)
    y = np.array(train.y)
    y[1, 0] = 12
    bad = train._replace(y=y)
    count_message = "client 0 in split 'train': num_examples="
  else:
    doubled = train.replace(num_examples=train.num_examples * 2)
    y = np.array(train.y)
    y[train.offsets[1]] = 12   # client 1's first example
    bad = train.replace(y=y)
    count_message = "client 0 in split 'train': offsets give"
  with pytest.raises(ValueError, match=count_message):
    train_and_evaluate(config, str(tmp_path / 'a'), 'fedavg', 0,
                       RunInputs(bench=bench._replace(splits={**bench.splits, 'train': doubled})))
  with pytest.raises(ValueError, match=r"client 1 in split 'train': label 12 outside"):
    train_and_evaluate(config, str(tmp_path / 'b'), 'fedavg', 0,
                       RunInputs(bench=bench._replace(splits={**bench.splits, 'train': bad})))


def test_federated_data_edge_cases_name_the_client():
  with pytest.raises(ValueError, match='all 2 clients are empty'):
    stack_clients([np.zeros((0, 4)), np.zeros((0, 4))], [np.zeros(0, int), np.zeros(0, int)])
  with pytest.raises(ValueError, match=r'client 1: examples of shape \(5,\), the others \(4,\)'):
    stack_clients([np.zeros((2, 4)), np.zeros((2, 5))], [np.zeros(2, int), np.zeros(2, int)])
  with pytest.raises(ValueError, match='client 0: label 1.5 is not an integer'):
    stack_clients([np.zeros((2, 4))], [np.array([0.0, 1.5])])
  data = stack_clients([np.zeros((2, 4)), np.zeros((3, 4))], [np.zeros(2, int), np.ones(3, int)])
  with pytest.raises(ValueError, match=r'num_examples has shape \(3,\), need one count per '
                                       r'client \(2,\)'):
    validate(data._replace(num_examples=np.array([2, 3, 0])), 2)
  with pytest.raises(ValueError, match=r'client 1: label 0.5 is not an integer'):
    validate(data._replace(y=np.where(data.mask, 0.5, 0.0) * np.array([[0], [1]])), 2)
  validate(data._replace(y=data.y.astype(np.float32)), 2)  # whole-number floats are labels


def test_a_live_lock_stops_a_second_run_before_it_writes(tmp_path):
  sleeper = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
  try:
    with open(tmp_path / '.lock', 'w') as f:
      json.dump({'host': os.uname().nodename, 'pid': sleeper.pid, 'started': 'then'}, f)
    with pytest.raises(WorkdirBusyError, match=f'in use by a live run: pid {sleeper.pid}'):
      pipelines.run(tiny_config(), str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ['.lock']
  finally:
    sleeper.kill()
    sleeper.wait()


def test_a_stale_lock_is_taken_over_with_a_warning(tmp_path, caplog):
  dead = subprocess.Popen([sys.executable, '-c', 'pass'])
  dead.wait()
  with open(tmp_path / '.lock', 'w') as f:
    json.dump({'host': os.uname().nodename, 'pid': dead.pid, 'started': 'then'}, f)
  with caplog.at_level(logging.WARNING, logger='fedjax_shift'):
    pipelines.run(tiny_config(), str(tmp_path))
  assert f'taking over the lock of a dead run (pid {dead.pid}' in caplog.text
  assert not os.path.exists(tmp_path / '.lock')  # released at the end


def race_for_locks(barrier, workdirs, stale_pid, held):
  """One racing process: per workdir, waits at ``barrier`` with the other racers,
  tries to take the workdir's lock (a dead run's lock of ``stale_pid`` in it when
  given), and puts in ``held`` whether it holds the lock while the other tries."""
  for workdir in workdirs:
    if stale_pid is not None and barrier.wait() == 0:
      with open(os.path.join(workdir, '.lock'), 'w') as f:
        json.dump({'host': os.uname().nodename, 'pid': stale_pid, 'started': 'then'}, f)
    lock = WorkdirLock(workdir)
    barrier.wait()
    try:
      lock.acquire()
    except WorkdirBusyError:
      pass
    held.put((workdir, lock.held))
    barrier.wait()     # both have tried before the holder lets go
    lock.release()


@pytest.mark.parametrize('racers', [2, 4])
@pytest.mark.parametrize('stale', [False, True], ids=['free', 'dead_holder'])
def test_processes_released_together_never_both_hold_the_lock(tmp_path, stale, racers):
  # 100 trials of two processes, 300 of four, released by one barrier onto one workdir
  # (empty, or holding a dead run's lock): exactly one of them holds the lock each time
  # (four taking over a dead run's lock with a rename and a put-back left two holding
  # it in about one of 200 trials).
  import multiprocessing
  context = multiprocessing.get_context('spawn')
  workdirs = [str(tmp_path / f'trial_{i}') for i in range(100 * (racers - 1))]
  for workdir in workdirs:
    os.makedirs(workdir)
  stale_pid = None
  if stale:
    dead = subprocess.Popen([sys.executable, '-c', 'pass'])
    dead.wait()
    stale_pid = dead.pid
  barrier, held = context.Barrier(racers), context.Queue()
  count = racers
  racers = [context.Process(target=race_for_locks, args=(barrier, workdirs, stale_pid, held))
            for _ in range(count)]
  for racer in racers:
    racer.start()
  holders = {}
  for _ in range(count * len(workdirs)):
    workdir, took = held.get(timeout=120)
    holders[workdir] = holders.get(workdir, 0) + took
  for racer in racers:
    racer.join(timeout=60)
  assert [racer.exitcode for racer in racers] == [0] * count
  assert sorted(holders) == sorted(workdirs)
  assert {workdir: count for workdir, count in holders.items() if count != 1} == {}
  assert all(os.listdir(workdir) == [] for workdir in workdirs)   # released, no drafts


def test_lock_held_on_another_host_names_it(tmp_path):
  with open(tmp_path / '.lock', 'w') as f:
    json.dump({'host': 'elsewhere', 'pid': 1, 'started': 'then'}, f)
  with pytest.raises(WorkdirBusyError, match='pid 1 on host elsewhere.*delete'):
    WorkdirLock(str(tmp_path)).acquire()


def test_malformed_metrics_line_is_an_error_and_a_cut_last_line_is_dropped(tmp_path, caplog):
  pipelines.run(quick(), str(tmp_path))
  path = tmp_path / RUN / 'metrics.jsonl'
  lines = path.read_text().splitlines()
  path.write_text('\n'.join(lines[:1] + ['{"round": 2, "lo'] + lines[2:]) + '\n')
  damaged = path.read_text()
  with pytest.raises(ValueError, match=r'metrics.jsonl, line 2: not a JSON record.*2 more'):
    pipelines.run(quick(rounds=6, resume='extend'), str(tmp_path))
  assert path.read_text() == damaged  # nothing deleted
  path.write_text('\n'.join(lines) + '\n{"round": 5, "lo')  # a write cut by a kill
  with caplog.at_level(logging.WARNING, logger='fedjax_shift'):
    pipelines.run(quick(rounds=6, resume='extend'), str(tmp_path))
  assert 'dropping its last line 5, cut short' in caplog.text
  assert [r['round'] for r in read_metrics(str(path))] == [1, 2, 3, 4, 5, 6]


def test_records_after_the_checkpoint_are_kept_aside_when_recomputed(tmp_path, caplog):
  (tmp_path / 'metrics.jsonl').write_text(
      ''.join(json.dumps({'round': r, 'loss': 1.0}) + '\n' for r in range(1, 6)))
  with caplog.at_level(logging.WARNING, logger='fedjax_shift'):
    MetricsWriter(str(tmp_path), 3)
  assert 'records of rounds 4–5 come after the checkpoint of round 3' in caplog.text
  assert [r['round'] for r in read_metrics(str(tmp_path / 'metrics.jsonl'))] == [1, 2, 3]
  assert len(read_metrics(str(tmp_path / 'metrics.jsonl.before_resume_3'))) == 5


def corrupt(step_dir, kind, rng):
  """Damages one orbax checkpoint folder the way a crash or a bad disk would."""
  default = os.path.join(step_dir, 'default')
  if kind == 'delete_default':
    shutil.rmtree(default)
  elif kind == 'delete_manifest':
    for directory, _, files in os.walk(default):
      for name in files:
        if name == 'manifest.ocdbt':
          os.remove(os.path.join(directory, name))
  elif kind == 'truncate_data':
    for directory, _, files in os.walk(default):
      if os.path.basename(directory) == 'd':
        for name in files:
          path = os.path.join(directory, name)
          size = os.path.getsize(path)
          with open(path, 'r+b') as f:
            f.truncate(int(rng.integers(0, max(size // 2, 1))))
  else:
    raise ValueError(kind)


def test_reading_a_damaged_checkpoint_says_damaged_and_changes_nothing(tmp_path):
  from fedjax_shift import checkpoint
  pipelines.run(quick(rounds=4, keep_checkpoints=3), str(tmp_path / 'run'))
  run_dir = tmp_path / 'run' / RUN
  corrupt(str(run_dir / 'checkpoints' / '4'), 'truncate_data', np.random.default_rng(0))
  before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob('*'))
  with pytest.raises(checkpoint.DamagedCheckpoint, match=r'checkpoints/4 is damaged'):
    pipelines.load_run(str(tmp_path / 'run'), 'fedavg', seed=0)
  with pytest.raises(checkpoint.DamagedCheckpoint, match=r'checkpoints/4 is damaged'):
    checkpoint.read(str(run_dir / 'checkpoints'))
  # a reader reads: nothing moved to corrupt_checkpoints/, nothing written
  assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob('*')) == before
  with pytest.raises(FileNotFoundError, match=r'did you mean .*/checkpoints\?'):
    checkpoint.read(str(run_dir))   # the run's directory, not its checkpoints/


@pytest.mark.parametrize('kind', ['delete_default', 'delete_manifest', 'truncate_data'])
def test_damaged_newest_checkpoint_falls_back_and_reproduces_the_run(kind, tmp_path, caplog):
  straight = pipelines.run(quick(rounds=6, keep_checkpoints=3), str(tmp_path / 'straight'))
  pipelines.run(quick(rounds=4, keep_checkpoints=3), str(tmp_path / 'run'))
  corrupt(str(tmp_path / 'run' / RUN / 'checkpoints' / '4'), kind, np.random.default_rng(0))
  with caplog.at_level(logging.WARNING, logger='fedjax_shift'):
    resumed = pipelines.run(quick(rounds=6, keep_checkpoints=3, resume='extend'),
                            str(tmp_path / 'run'))
  assert 'the checkpoint of round 4' in caplog.text and 'unreadable' in caplog.text
  moved = os.listdir(tmp_path / 'run' / RUN / 'corrupt_checkpoints')
  assert len(moved) == 1 and moved[0].startswith('4-')
  assert metrics_of(tmp_path / 'run') == metrics_of(tmp_path / 'straight')
  assert resumed.records['results'][0]['metrics'] == straight.records['results'][0]['metrics']


def test_divergence_in_round_one_says_no_checkpoint_was_saved(tmp_path):
  config = tiny_config(**{'client.learning_rate': 1e30})
  with pytest.raises(FloatingPointError, match='in round 1; no checkpoint was saved before it'):
    pipelines.run(config, str(tmp_path))


def test_report_errors_name_the_file_and_exit_nonzero(tmp_path):
  report = os.path.join(ROOT, 'launch', 'report.py')
  empty = subprocess.run([sys.executable, report, '--workdirs='], capture_output=True,
                         text=True, cwd=ROOT)
  assert empty.returncode != 0 and 'no workdirs' in empty.stderr
  (tmp_path / 'config.json').write_text(json.dumps({'pipeline': 'atp',
                                                    'data': {'benchmark': 'atp_shift'}}))
  (tmp_path / 'results.json').write_text('{"table1": {')
  cut = subprocess.run([sys.executable, report, '--kind=atp', f'--workdirs={tmp_path}'],
                       capture_output=True,
                       text=True, cwd=ROOT)
  assert cut.returncode != 0 and str(tmp_path / 'results.json') in cut.stderr


# Fault injection: SIGKILL (or SIGTERM / SIGUSR1) a run at a random round, damage its
# newest checkpoint in a random way (or not), resume; every metrics.jsonl of the workdir
# must equal an uninterrupted run's. Three pipelines: federated (FedAvg), atp
# (pretraining then α training, two run directories) and hetero (HeteroFedTTA's groups).
ROUNDS = 30
PIPELINE_RUNS = {
    'federated': ('fedavg.py:tiny', [f'--config.rounds={ROUNDS}', '--config.eval_every=3',
                                     '--config.checkpoint_every=2', '--config.keep_checkpoints=3',
                                     '--config.data.num_clients=10', '--config.cohort_size=4']),
    'atp': ('atp.py:digits_hybrid,tiny', ['--config.rounds=10', '--config.atp.rounds=10',
                                          '--config.eval_every=5', '--config.checkpoint_every=2',
                                          '--config.keep_checkpoints=3']),
    'hetero': ('hetero_fedtta.py:tiny', ['--config.rounds=12', '--config.eval_every=4',
                                         '--config.checkpoint_every=2',
                                         '--config.keep_checkpoints=3']),
}


def _launch(workdir, pipeline='federated'):
  config, flags = PIPELINE_RUNS[pipeline]
  return [sys.executable, os.path.join(ROOT, 'launch', 'train.py'),
          '--config=' + os.path.join(ROOT, 'configs', config), f'--workdir={workdir}'] + flags


def all_metrics(workdir):
  """{run directory: its metrics.jsonl records without timing fields} of a workdir."""
  paths = glob.glob(os.path.join(workdir, '**', 'metrics.jsonl'), recursive=True)
  return {os.path.relpath(os.path.dirname(p), workdir): without_timing(read_metrics(p))
          for p in sorted(paths)}


_UNINTERRUPTED = {}


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
  """pipeline -> every metrics.jsonl of one uninterrupted run (computed once)."""
  def get(pipeline='federated'):
    if pipeline not in _UNINTERRUPTED:
      workdir = tmp_path_factory.mktemp(f'straight_{pipeline}')
      subprocess.run(_launch(workdir, pipeline), check=True, capture_output=True, cwd=ROOT)
      _UNINTERRUPTED[pipeline] = all_metrics(str(workdir))
    return _UNINTERRUPTED[pipeline]
  return get


def kill_corrupt_resume(workdir, trial: int, sig=signal.SIGKILL, pipeline='federated'):
  """One trial; returns (kill after how many records, corruption kind, resumed metrics).
  With SIGTERM (or SIGUSR1) the run must stop itself after checkpointing its round,
  exit 143 and say so."""
  rng = np.random.default_rng(trial)
  total = sum(len(records) for records in _UNINTERRUPTED.get(pipeline, {}).values())
  kill_after = int(rng.integers(3, (total or ROUNDS) - 2))
  kind = ['none', 'delete_default', 'delete_manifest', 'truncate_data'][trial % 4]
  proc = subprocess.Popen(_launch(workdir, pipeline), cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 600
  while time.time() < deadline and proc.poll() is None:
    try:
      if sum(len(r) for r in all_metrics(workdir).values()) >= kill_after:
        break
    except ValueError:
      pass
    time.sleep(0.02 + 0.03 * random.Random(trial).random())
  proc.send_signal(sig)
  _, stderr = proc.communicate()
  if sig == signal.SIGKILL:   # it was killed mid-run, not signalled after it finished
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, stderr[-2000:])
  # The run being trained when the signal came: the newest metrics.jsonl.
  newest = max(glob.glob(os.path.join(workdir, '**', 'metrics.jsonl'), recursive=True),
               key=os.path.getmtime)
  run_dir = os.path.dirname(newest)
  checkpoints = os.path.join(run_dir, 'checkpoints')
  steps = sorted(int(p) for p in os.listdir(checkpoints) if p.isdigit()) \
      if os.path.isdir(checkpoints) else []
  if sig != signal.SIGKILL and proc.returncode != 0:   # it had not finished: it stopped itself
    # After the round it was training, with a checkpoint; or at once when that round's
    # predecessor was just checkpointed (nothing trained waited to be saved).
    assert proc.returncode == 143, stderr[-2000:]
    name = signal.Signals(sig).name
    assert (f'{name} received: stopped after round {steps[-1]}' in stderr or
            f'{name} received while no trained round was waiting' in stderr), stderr[-2000:]
    assert len(read_metrics(newest)) == steps[-1]  # checkpointed the round it ended
  if kind != 'none' and steps:
    corrupt(os.path.join(checkpoints, str(steps[-1])), kind, rng)
  subprocess.run(_launch(workdir, pipeline), check=True, capture_output=True, cwd=ROOT)
  return kill_after, kind, all_metrics(workdir)


@pytest.mark.parametrize('sig, status', [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_while_compiling_stops_at_once_saying_nothing_was_trained(sig, status,
                                                                           tmp_path):
  # Before: Ctrl-C while compiling segfaulted in 2 of 5 tries after claiming the trained
  # rounds were checkpointed, and SIGTERM waited for the end of a round. The signal is
  # sent as the run announces its data (it builds the round next, then compiles it for
  # seconds): the process must end within 10 s, its lock let go, no round recorded.
  proc = subprocess.Popen(_launch(tmp_path), cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  lines = []
  for line in proc.stderr:
    lines.append(line)
    if 'train examples' in line:   # 'fedavg seed 0: 10 clients, … train examples …'
      break
  sent = time.time()
  proc.send_signal(sig)
  rest = proc.communicate(timeout=60)[1]
  assert time.time() - sent < 10
  assert proc.returncode == status, ''.join(lines) + rest
  assert (f'{signal.Signals(sig).name} received while no trained round was waiting to be '
          'checkpointed') in rest
  assert 'Segmentation fault' not in rest and 'Traceback' not in rest
  assert not os.path.exists(tmp_path / '.lock')
  assert not os.path.exists(tmp_path / RUN / 'metrics.jsonl') or not read_metrics(
      str(tmp_path / RUN / 'metrics.jsonl'))


@pytest.mark.parametrize('sig, status', [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_while_importing_stops_at_once(sig, status, tmp_path):
  # Before: Ctrl-C while `import jax` ran (the first 1-2 s) was swallowed by the import
  # in 3 of 6 tries (the run went on to the end, exit 0) or surfaced as an ImportError.
  proc = subprocess.Popen(_launch(tmp_path), cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  time.sleep(0.5)   # the script's first lines have run; its imports have not finished
  proc.send_signal(sig)
  rest = proc.communicate(timeout=60)[1]
  assert proc.returncode == status, rest
  assert (f'{signal.Signals(sig).name} received outside the run (starting, or its results '
          'written): nothing to save; stopped') in rest
  assert 'Traceback' not in rest
  assert not os.path.exists(tmp_path / '.lock')


# Trial 4: SIGKILL, checkpoints left whole; 1: SIGKILL, the newest checkpoint's default
# item deleted; 3: SIGTERM, its data truncated (trial % 4 picks the damage).
@pytest.mark.parametrize('trial, sig', [(4, signal.SIGKILL), (1, signal.SIGKILL),
                                        (3, signal.SIGTERM)])
def test_kill_corrupt_resume_matches_an_uninterrupted_run(trial, sig, uninterrupted, tmp_path):
  expected = uninterrupted()
  _, _, metrics = kill_corrupt_resume(str(tmp_path), trial, sig)
  assert [r['round'] for r in metrics[RUN]] == list(range(1, ROUNDS + 1))
  assert metrics == expected  # exact equality of every loss and accuracy


@pytest.mark.slow
@pytest.mark.parametrize('trial', range(100, 120))
def test_kill_corrupt_resume_twenty_trials(trial, uninterrupted, tmp_path):
  """Trials cycle through the pipelines, and each pipeline through the signals."""
  pipeline = list(PIPELINE_RUNS)[trial % 3]
  expected = uninterrupted(pipeline)
  sig = (signal.SIGKILL, signal.SIGTERM, signal.SIGUSR1)[(trial // 3) % 3]
  kill_after, kind, metrics = kill_corrupt_resume(str(tmp_path), trial, sig, pipeline)
  assert metrics == expected, (f'{pipeline} trial {trial}: {sig.name} after {kill_after} '
                               f'records, {kind}')


def test_resuming_on_rebuilt_data_that_differs_is_refused(tmp_path):
  # A run directory records a digest of its data; when the same config builds other data
  # (a changed benchmark or source), its checkpoints belong to other clients.
  config = config_lib.apply_variant(config_lib.base_config(), 'tiny')
  config.algorithms = ('fedavg',)
  workdir = str(tmp_path / 'run')
  first = pipelines.run(config, workdir)
  path = os.path.join(workdir, 'fedavg', 'seed_0', 'partition.json')
  record = json.load(open(path))
  assert len(record['data_digest']) == 64
  again = pipelines.run(config, workdir)   # same data: resumes
  assert again.records['results'][0]['metrics'] == first.records['results'][0]['metrics']
  record['data_digest'] = '0' * 64
  json.dump(record, open(path, 'w'))
  with pytest.raises(ValueError, match='trained on other data than this config builds now'):
    pipelines.run(config, workdir)


def test_a_workdir_never_holds_seeds_of_different_configurations(tmp_path):
  """Seeds of one method in one workdir are averaged together: a run of another seed
  with another `rounds` (or another field) beside a finished seed is refused before it
  trains, naming the other seed's directory and the change."""
  config = tiny_config(**{'rounds': 2, 'eval_every': 2})
  pipelines.run(config, str(tmp_path))
  other = tiny_config(**{'rounds': 3, 'eval_every': 3, 'seeds': (1,)})
  with pytest.raises(ValueError, match=r'(?s)fedavg/seed_0 holds another seed.*rounds: 2 → 3'):
    pipelines.run(other, str(tmp_path))
  other = tiny_config(**{'rounds': 2, 'eval_every': 2, 'seeds': (1,),
                         'client.learning_rate': 0.07})
  with pytest.raises(ValueError, match=r'(?s)seed_0 holds another seed.*client.learning_rate'):
    pipelines.run(other, str(tmp_path))
  assert not os.path.exists(tmp_path / 'fedavg' / 'seed_1' / 'run.json')
  pipelines.run(tiny_config(**{'rounds': 2, 'eval_every': 2, 'seeds': (1,)}), str(tmp_path))


def test_backbone_weights_are_fingerprinted_by_content_hashed_once(tmp_path, monkeypatch):
  """backbone.weights=<path> enters a run's fingerprint by its bytes, not its path:
  weights rewritten in place make the run another configuration. The file is hashed
  once; a re-run reads the cached digest (keyed by path, size, modification time, inode
  and status-change time)."""
  from fedjax_shift.pipelines import fingerprints
  monkeypatch.setattr(fingerprints, 'DIGEST_CACHE', str(tmp_path / 'cache' / 'digests.json'))
  weights = tmp_path / 'weights.npz'
  weights.write_bytes(b'first weights' * 1000)
  config = tiny_config(**{'backbone.weights': str(weights)})
  first = fingerprints.run_fields(config, 'fedavg')
  assert 'backbone.content' in first and first['backbone.weights'] == json.dumps(str(weights))
  hashed = []
  monkeypatch.setattr(fingerprints, '_hash_file', lambda path: hashed.append(path) or 'x')
  assert fingerprints.run_fields(config, 'fedavg') == first and hashed == []   # read from the cache
  weights.write_bytes(b'other weights' * 1000)                          # same path, new bytes
  os.utime(weights, ns=(1, 10 ** 18))
  assert fingerprints.run_fields(config, 'fedavg')['backbone.content'] != first['backbone.content']
  assert hashed == [str(weights)]
  # Same size and the modification time put back: the status-change time still moves.
  hashed.clear()
  edited = os.stat(weights)
  time.sleep(0.05)    # past the file system's clock tick
  weights.write_bytes(b'third weights' * 1000)
  os.utime(weights, ns=(edited.st_atime_ns, edited.st_mtime_ns))
  assert os.stat(weights).st_size == edited.st_size
  assert os.stat(weights).st_mtime_ns == edited.st_mtime_ns
  fingerprints.run_fields(config, 'fedavg')
  assert hashed == [str(weights)]
  # A directory: the digest covers every file in it.
  folder = tmp_path / 'saved'
  (folder / 'params').mkdir(parents=True)
  (folder / 'params' / 'a').write_bytes(b'1')
  monkeypatch.undo()
  monkeypatch.setattr(fingerprints, 'DIGEST_CACHE', str(tmp_path / 'cache' / 'digests.json'))
  before = fingerprints.content_digest(str(folder))
  (folder / 'params' / 'b').write_bytes(b'2')
  assert fingerprints.content_digest(str(folder)) != before


def _write_seed(workdir, method, seed, accuracy, fields, rounds=10):
  write_run(workdir, method, seed, {f'{m}/test/{k}': accuracy for m in ('global', 'personalized')
                                    for k in ('accuracy', 'client_accuracy')})
  (workdir / method / f'seed_{seed}' / 'run.json').write_text(
      json.dumps({'fields': fields, 'rounds': rounds}))


def test_report_refuses_to_average_seeds_of_different_configurations(tmp_path):
  """Two seeds of fedavg trained with another learning rate (or another round target)
  are refused by every report layout, naming the field; equal fields are averaged."""
  from fedjax_shift.report import load_runs
  same = tmp_path / 'same'
  for seed in (0, 1):
    _write_seed(same, 'fedavg', seed, 0.5, {'client.learning_rate': '0.1'})
  assert len(load_runs([str(same)])['same']) == 2
  mixed = tmp_path / 'mixed'
  _write_seed(mixed, 'fedavg', 0, 0.5, {'client.learning_rate': '0.1'})
  _write_seed(mixed, 'fedavg', 1, 0.6, {'client.learning_rate': '0.05'})
  with pytest.raises(ValueError, match=r'seeds of fedavg trained with different configurations'
                                       r'(.|\n)*client.learning_rate: 0.1 → 0.05'):
    load_runs([str(mixed)])
  longer = tmp_path / 'longer'
  _write_seed(longer, 'fedavg', 0, 0.5, {}, rounds=10)
  _write_seed(longer, 'fedavg', 1, 0.6, {}, rounds=20)
  from fedjax_shift.papers.fedevolve import tables
  with pytest.raises(ValueError, match=r'rounds: 10 → 20'):
    tables.straggler_from_workdirs([str(longer)])


def test_fedevolve_layouts_say_how_many_seeds_each_row_averages(tmp_path):
  """Table 6 over two straggler ratios: FedEvolve with seeds {0, 1} in one and {0} in the
  other says '2 / 1'; a diverged seed is counted as such."""
  from fedjax_shift.papers.fedevolve import tables
  first, second = tmp_path / 'r0', tmp_path / 'r1'
  for seed in (0, 1):
    _write_seed(first, 'fedevolve', seed, 0.5, {})
  _write_seed(second, 'fedevolve', 0, 0.5, {})
  text = tables.straggler_from_workdirs([str(first), str(second)], ['0', '0.1'])
  header = next(line for line in text.splitlines() if line.startswith('| Method |'))
  assert '| seeds |' in header
  row = next(line for line in text.splitlines() if line.startswith('| FedEvolve |'))
  assert '| 2 / 1 |' in row
  diverged = json.loads((second / 'fedevolve' / 'seed_0' / 'results.json').read_text())
  diverged['diverged'] = {'round': 3}
  (second / 'fedevolve' / 'seed_0' / 'results.json').write_text(json.dumps(diverged))
  text = tables.straggler_from_workdirs([str(first), str(second)], ['0', '0.1'])
  assert '2 / 1 (1 diverged)' in text


def test_full_disk_while_checkpointing_is_one_clear_error(tmp_path, monkeypatch):
  """orbax's save failing with ENOSPC (raised from deep inside, as orbax wraps it) becomes
  DiskFullError naming the directory, the checkpoint's size (two float32 leaves of 2^18
  values = 2 MiB), keep_checkpoints and what to do; other errors pass unchanged."""
  import errno
  from fedjax_shift.checkpoint import DiskFullError
  checkpointer = Checkpointer(str(tmp_path / 'ckpt'), every=1, keep=3)
  state = (np.zeros(2 ** 18, np.float32), np.zeros(2 ** 18, np.float32))

  def full(*args, **kwargs):
    try:
      raise OSError(errno.ENOSPC, 'No space left on device')
    except OSError as err:
      raise RuntimeError('orbax: write failed') from err

  checkpointer.save(1, state)
  checkpointer.save(2, state)
  monkeypatch.setattr(checkpointer.manager, 'save', full)
  with pytest.raises(DiskFullError, match=r'the disk is full: saving the round-4 checkpoint '
                     r'into .*ckpt needs about 2.0 MiB .*config.keep_checkpoints=3 .*delete its '
                     r"older checkpoints \['.*ckpt/1'\]: the newest, round 2, is what a re-run "
                     r'resumes from.* re-run'):
    checkpointer.save(4, state)

  def broken(*args, **kwargs):
    raise RuntimeError('something else')

  monkeypatch.setattr(checkpointer.manager, 'save', broken)
  with pytest.raises(RuntimeError, match='something else'):
    checkpointer.save(5, state)


def test_a_diverged_record_must_belong_to_its_run_and_deleting_it_retrains(tmp_path, caplog):
  # fedavg at lr 1e8 diverges in round 1 (no checkpoint kept); at lr 0.05 it finishes
  # its 4 rounds with a checkpoint of round 4.
  diverging = quick(**{'client.learning_rate': 1e8, 'on_divergence': 'continue'})
  healthy = quick(on_divergence='continue')
  pipelines.run(diverging, str(tmp_path / 'diverged'))
  pipelines.run(healthy, str(tmp_path / 'healthy'))
  record = tmp_path / 'diverged' / RUN / 'diverged.json'
  recorded = json.loads(record.read_text())
  assert recorded['round'] == 1 and recorded['fingerprint'] == json.loads(
      (tmp_path / 'diverged' / RUN / 'run.json').read_text())['fingerprint']
  # Copied into the healthy run: another run's fingerprint; refused, nothing rewritten.
  copied = tmp_path / 'healthy' / RUN / 'diverged.json'
  shutil.copy(record, copied)
  results = (tmp_path / 'healthy' / RUN / 'results.json').read_text()
  with pytest.raises(RunMismatchError, match=r'healthy/fedavg/seed_0/diverged.json belongs to '
                                             r'another run.*delete it'):
    pipelines.run(healthy, str(tmp_path / 'healthy'))
  # The healthy run's own fingerprint, but a round it holds a checkpoint past.
  own = json.loads((tmp_path / 'healthy' / RUN / 'run.json').read_text())['fingerprint']
  copied.write_text(json.dumps({**recorded, 'fingerprint': own}))
  with pytest.raises(RunMismatchError, match=r'diverged in round 1, but the run holds a '
                                             r'checkpoint of round 4'):
    pipelines.run(healthy, str(tmp_path / 'healthy'))
  for damaged in ('{"round": 1, "err', '{"round": "one", "error": "x"}'):
    copied.write_text(damaged)
    with pytest.raises(ValueError, match=r'diverged.json is not .*delete it to train the run '
                                         r'again'):
      pipelines.run(healthy, str(tmp_path / 'healthy'))
  assert (tmp_path / 'healthy' / RUN / 'results.json').read_text() == results
  # Deleting a diverged run's record trains it again (its results.json says diverged
  # too, but only the record settles a run): it diverges again and is recorded anew.
  record.unlink()
  with caplog.at_level(logging.INFO, logger='fedjax_shift'):
    again = pipelines.run(diverging, str(tmp_path / 'diverged')).records['results'][0]
  assert 'diverged before' not in caplog.text and 'in round 1' in again['diverged']
  assert json.loads(record.read_text())['round'] == 1


def test_report_refuses_accuracies_that_are_not_accuracies_naming_the_file(tmp_path):
  from fedjax_shift.report import load_runs
  for value in (1.7, 'high', True):
    workdir = tmp_path / f'edited_{value}'
    write_run(workdir, 'fedavg', 0, {'global/test/accuracy': value, 'loss': 7.0})
    with pytest.raises(ValueError, match=r'fedavg/seed_0/results.json: global/test/accuracy is '
                                         rf'{value!r}, not an accuracy in \[0, 1\]'):
      load_runs([str(workdir)])
  write_run(tmp_path / 'fine', 'fedavg', 0, {'global/test/accuracy': float('nan')})
  assert len(load_runs([str(tmp_path / 'fine')])['fine']) == 1   # NaN: a diverged cell


def test_report_says_why_a_workdir_has_no_sweep_and_what_a_table_leaves_out(tmp_path):
  from fedjax_shift.report.sweeps import sweep_state, workdir_notes
  assert sweep_state(str(tmp_path / 'nowhere')) == f'{tmp_path / "nowhere"} does not exist'
  for seed, done in ((0, True), (1, False)):
    run = tmp_path / 'half' / 'fedavg' / 'client.learning_rate=0.1' / f'seed_{seed}'
    run.mkdir(parents=True)
    if done:
      (run / 'results.json').write_text('{}')
  assert 'a sweep not finished yet: 1 of the 2 runs begun have results.json' in \
      sweep_state(str(tmp_path / 'half'))
  write_run(tmp_path / 'plain', 'fedavg', 0, {}, tiny_config(seeds=(0, 1, 2)))
  assert 'it ran no config.sweep' in sweep_state(str(tmp_path / 'plain'))
  notes = workdir_notes(str(tmp_path / 'plain'))
  assert notes == [f'{tmp_path / "plain"}: fedavg has no results of seeds [1, 2] (config.seeds '
                   f'[0, 1, 2]): not trained yet, or still training']
  (tmp_path / 'plain' / '.lock').write_text('{}')
  assert 'is in use by a run (its .lock)' in workdir_notes(str(tmp_path / 'plain'))[0]


def test_a_benchmark_without_an_evaluation_split_is_an_error(tmp_path):
  """A run that could measure no accuracy (every example dealt to training) is refused
  before it trains, not finished with status 0 and no accuracy."""
  config = tiny_config(**{'data.split_fractions': ml_collections.ConfigDict({'train': 1.0})})
  with pytest.raises(ValueError, match='no evaluation split'):
    pipelines.run(config, str(tmp_path))


def test_a_lower_keep_checkpoints_frees_space_before_a_rerun_writes(tmp_path, monkeypatch):
  # A full disk: the re-run's first write (config.json) fails. With a lower
  # keep_checkpoints the older checkpoint is deleted before it, so the advice the
  # disk-full message gives can work; the newest is kept.
  import errno
  from fedjax_shift.pipelines import opening
  pipelines.run(quick(), str(tmp_path))
  checkpoints = tmp_path / RUN / 'checkpoints'
  assert sorted(os.listdir(checkpoints)) == ['3', '4']

  def full_disk(path, *args, **kwargs):
    if path.endswith('config.json'):
      raise OSError(errno.ENOSPC, 'No space left on device', path)
    return open(path, *args, **kwargs)
  monkeypatch.setattr(opening, 'open', full_disk, raising=False)
  with pytest.raises(OSError, match='No space left on device'):
    pipelines.run(quick(keep_checkpoints=1), str(tmp_path))
  assert sorted(os.listdir(checkpoints)) == ['4']
  monkeypatch.undo()
  again = pipelines.run(quick(keep_checkpoints=1), str(tmp_path)).records['results'][0]
  assert again['rounds'] == 4 and sorted(os.listdir(checkpoints)) == ['4']


def test_a_finished_runs_cut_last_line_is_moved_aside_and_curves_need_a_round(tmp_path):
  from fedjax_shift.report.figures import plot_curves
  pipelines.run(quick(), str(tmp_path))
  path = tmp_path / RUN / 'metrics.jsonl'
  whole = path.read_text()
  path.write_text(whole + '{"round": 5, "lo')   # a kill while writing a line
  pipelines.run(quick(), str(tmp_path))       # finished: evaluated, not trained
  assert path.read_text() == whole
  assert (tmp_path / RUN / 'metrics.jsonl.cut').read_text() == '{"round": 5, "lo\n'
  assert os.path.getsize(tmp_path / 'curves.png') > 0
  # A run with no evaluated round draws no curves (a stale figure is removed).
  (tmp_path / 'empty').mkdir()
  (tmp_path / 'empty' / 'metrics.jsonl').write_text('{"round": 1, "loss": 2.0}\n')
  (tmp_path / 'stale.png').write_bytes(b'old')
  assert plot_curves({'fedavg': [str(tmp_path / 'empty')]}, str(tmp_path / 'stale.png')) == ''
  assert not os.path.exists(tmp_path / 'stale.png')
