"""Progress for humans and for log files: tqdm's bar on a terminal, plain lines without."""
import logging
import os
import subprocess
import sys

import pytest

from fedjax_shift.pipelines import loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_without_a_terminal_one_line_every_log_every_rounds_and_at_the_end(caplog):
  """35 rounds, log_every 10: lines at rounds 10, 20, 30 and 35 (the end), none between,
  each with the fields and an ETA; no bar."""
  progress = loop.Progress(35, 0, 'fedavg seed 0', log_every=10, terminal=False)
  assert progress.bar is None
  with caplog.at_level(logging.INFO, logger='fedjax_shift'):
    for _ in range(35):
      progress.update(1, {'loss': '0.500'})
  lines = [r.getMessage() for r in caplog.records]
  assert [line.split(', ')[0] for line in lines] == [
      f'fedavg seed 0: round {r}/35' for r in (10, 20, 30, 35)]
  assert all('loss 0.500' in line and 'ETA ' in line for line in lines)


def test_default_period_is_a_tenth_of_the_run_and_resumes_on_its_grid(caplog):
  """log_every 0 over 100 rounds: every 10 rounds (at most one a second: the updates
  here are spaced by patching the clock); a run resumed at round 47 logs 50 first."""
  clock = iter(float(t) for t in range(0, 1000, 2))
  original = loop.time.perf_counter
  loop.time.perf_counter = lambda: next(clock)
  try:
    progress = loop.Progress(100, 47, 'run', terminal=False)
    with caplog.at_level(logging.INFO, logger='fedjax_shift'):
      for _ in range(53):
        progress.update(1, {})
  finally:
    loop.time.perf_counter = original
  rounds = [int(r.getMessage().split('round ')[1].split('/')[0]) for r in caplog.records]
  assert rounds == [50, 60, 70, 80, 90, 100]


def test_the_eta_leaves_out_compile_time(caplog):
  """A first call of 52 s of which 50 s compiled, then 2 s per round: 2.00 s/round and
  an ETA of 9 × 2 s (not 9 × 52 s), then 8 × 2 s."""
  clock = iter([0.0, 52.0, 54.0])
  original = loop.time.perf_counter
  loop.time.perf_counter = lambda: next(clock)
  try:
    progress = loop.Progress(10, 0, 'run', log_every=1, terminal=False)
    with caplog.at_level(logging.INFO, logger='fedjax_shift'):
      progress.update(1, {}, compile_seconds=50.0)
      progress.update(1, {})
  finally:
    loop.time.perf_counter = original
  lines = [r.getMessage() for r in caplog.records]
  assert lines[0].endswith('2.00 s/round, ETA 00:00:18') and lines[1].endswith(
      '2.00 s/round, ETA 00:00:16'), lines


def test_piped_run_writes_no_carriage_return_and_few_lines(tmp_path):
  """The default experiment's tiny variant with its output piped (a job's log file):
  progress on, no '\\r' anywhere, and at most 60 lines in all (the bar would write a
  segment per refresh). Outside the workdir it writes only what the README says: the
  compilation cache under ~/.cache/fedjax_shift/ (and matplotlib its font cache)."""
  home = tmp_path / 'home'
  env = {k: v for k, v in os.environ.items() if not k.startswith(('XDG_', 'MPLCONFIGDIR'))}
  env['HOME'] = str(home)
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, 'launch', 'train.py'),
       '--config=' + os.path.join(ROOT, 'configs', 'default.py') + ':tiny',
       '--config.progress=True', f'--workdir={tmp_path / "run"}'],
      capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)
  written = sorted(os.path.relpath(os.path.join(d, f), home) for d, _, files in os.walk(home)
                   for f in files)
  assert written and all(path.startswith(('.cache/fedjax_shift/jax/', '.cache/matplotlib/'))
                         for path in written), written
  assert proc.returncode == 0, proc.stderr[-2000:]
  output = proc.stdout + proc.stderr
  assert '\r' not in output
  assert len(output.splitlines()) <= 60, output
  assert any('round 3/3' in line for line in output.splitlines())


def test_negative_log_every_is_refused():
  from fedjax_shift import config as config_lib
  from fedjax_shift.pipelines.run_config import check_run
  config = config_lib.apply_variant(config_lib.base_config(), 'tiny')
  config.log_every = -1
  with pytest.raises(ValueError, match=r'config.log_every: must be >= 0'):
    check_run(config)


def test_accelerator_extras_name_the_base_jax_requirement():
  """pyproject's cuda12 and tpu extras install jax[cuda12] / jax[tpu] with the same
  version bound as the base jax requirement (no mismatched jaxlib)."""
  tomllib = pytest.importorskip('tomllib')
  with open(os.path.join(ROOT, 'pyproject.toml'), 'rb') as f:
    project = tomllib.load(f)['project']
  (base,) = [d for d in project['dependencies'] if d.startswith('jax>') or d.startswith('jax=')]
  bound = base[len('jax'):]
  extras = project['optional-dependencies']
  assert extras['cuda12'] == [f'jax[cuda12]{bound}']
  assert extras['tpu'] == [f'jax[tpu]{bound}']
