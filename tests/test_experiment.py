"""End-to-end runs: results table, resume after SIGKILL, divergence, evaluation."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from fedjax_shift import pipelines
from fedjax_shift.metrics import read_metrics, without_timing
from helpers import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize('name', ['fedavg', 'fedprox', 'fedbn', 'fedavg_ft', 'local'])
def test_tiny_run_writes_table_and_metrics(tmp_path, name):
  config = tiny_config(algorithms=(name,), **{'model.name': 'bn_mlp'})
  out = pipelines.run(config, str(tmp_path))
  metrics = out.records['results'][0]['metrics']
  has_global = name in ('fedavg', 'fedprox', 'fedavg_ft')
  has_personal = name in ('fedbn', 'fedavg_ft', 'local')
  assert ('global/test/accuracy' in metrics) == has_global
  assert ('personalized/test_corrupted/accuracy' in metrics) == has_personal
  for value in metrics.values():
    assert np.isfinite(value)
  assert os.path.exists(tmp_path / 'results.md') and os.path.exists(tmp_path / 'results.csv')
  assert os.path.exists(tmp_path / 'curves.png')
  records = read_metrics(str(tmp_path / name / 'seed_0' / 'metrics.jsonl'))
  assert [r['round'] for r in records] == [1, 2, 3]
  partition = json.load(open(tmp_path / name / 'seed_0' / 'partition.json'))
  assert partition['statistics']['train']['clients'] == 6
  train = partition['statistics']['train']
  assert out.preamble.startswith(
      f"Benchmark label_skew_corrupted: {config.data.source}, partition dirichlet "
      f"α={config.data.dirichlet_alpha}, 6 clients, {train['examples']} train examples "
      f"({train['examples_per_client_min']}-{train['examples_per_client_max']} per client, "
      f"seed 0), 3 rounds"), out.preamble


def test_the_methods_of_a_config_build_each_seeds_data_once(tmp_path, monkeypatch):
  """Three methods × two seeds build each seed's data once (kept for the next method),
  and a benchmark past the kept bytes is built for its run alone."""
  from fedjax_shift.pipelines import runs
  built = []
  build_data = runs.build_data
  monkeypatch.setattr(runs, 'build_data', lambda config, seed: built.append(seed) or
                      build_data(config, seed))
  config = tiny_config(algorithms=('fedavg', 'fedprox', 'fedbn'), seeds=(0, 1), rounds=1,
                       **{'model.name': 'bn_mlp'})
  pipelines.run(config, str(tmp_path / 'kept'))
  assert sorted(built) == [0, 1]
  built.clear()
  monkeypatch.setattr(runs, 'MAX_SHARED_DATA_BYTES', 0)
  pipelines.run(config, str(tmp_path / 'not_kept'))
  assert sorted(built) == [0] * 4 + [1] * 4   # per run, and per seed for the round's plan


def test_training_beats_chance(tmp_path):
  config = tiny_config(rounds=15, eval_every=15, **{'data.num_clients': 6, 'cohort_size': 6,
                                                    'data.partition': 'iid'})
  out = pipelines.run(config, str(tmp_path))
  # 10 classes: chance is 10 %; 15 FedAvg rounds of an MLP on MNIST digits get far past it.
  assert out.records['results'][0]['metrics']['global/test/accuracy'] > 0.6


def test_eval_adapters_alone_adapt_every_method_run_they_can(tmp_path):
  """With config.eval_adapter_algorithms empty, an adapter of config.eval_adapters runs on
  every method it adapts (T3A on FedAvg's global model: a global+t3a column); one that
  adapts only other methods' models (FedTTA's g) is refused naming config.algorithms."""
  from fedjax_shift import config as config_lib
  config = tiny_config(**{'eval_adapters': ('t3a:online',), 'rounds': 1, 'eval_every': 1})
  out = pipelines.run(config, str(tmp_path / 'alone'))
  metrics = out.records['results'][0]['metrics']
  assert 0.0 <= metrics['global+t3a/test/accuracy'] <= 1.0
  config.eval_adapters = ('fedtta:episodic',)
  with pytest.raises(ValueError, match=r"config.algorithms: the fedtta adapter adapts models "
                                       r"trained by \['fedtta', 'fedtta_prox'\]; none of "
                                       r"\['fedavg'\] is"):
    config_lib.validate(config, str(tmp_path / 'refused'))


def _launch(workdir, rounds):
  return [sys.executable, os.path.join(ROOT, 'launch', 'train.py'),
          '--config=' + os.path.join(ROOT, 'configs', 'fedavg.py') + ':tiny',
          f'--workdir={workdir}', f'--config.rounds={rounds}', '--config.eval_every=2',
          '--config.checkpoint_every=2', '--config.data.num_clients=10',
          '--config.cohort_size=4']


def test_command_line_mistakes_are_one_paragraph_and_touch_nothing(tmp_path):
  # A stray word (an unquoted workdir with a space), a value out of range and a
  # mistyped field: a message that names it, no traceback, no workdir written.
  stray = subprocess.run(_launch(tmp_path / 'my', 2) + ['run'], capture_output=True,
                         text=True, cwd=ROOT)
  assert stray.returncode == 2 and "unexpected words on the command line: ['run']" in \
      stray.stderr
  bad = subprocess.run(_launch(tmp_path / 'bad', 2) + ['--config.client.momentum=1.5'],
                       capture_output=True, text=True, cwd=ROOT)
  assert bad.returncode == 2 and 'Traceback' not in bad.stderr, bad.stderr[-3000:]
  assert 'config.client.momentum: must be in [0, 1), got 1.5' in bad.stderr
  assert 'FEDJAX_SHIFT_TRACEBACK=1' in bad.stderr
  typo = subprocess.run(_launch(tmp_path / 'typo', 2) + ['--config.client.lr=0.1'],
                        capture_output=True, text=True, cwd=ROOT)
  assert typo.returncode == 2 and 'Traceback' not in typo.stderr, typo.stderr[-3000:]
  assert ("--config.client.lr: config.client has no field 'lr'; its fields: augmentation, "
          "batch_size, clip_norm, learning_rate") in typo.stderr
  # a method's own rate as its section once had it: the field that holds it now
  renamed = subprocess.run(_launch(tmp_path / 'renamed', 2) +
                           ['--config.fedprox.client_learning_rate=0.3'],
                           capture_output=True, text=True, cwd=ROOT)
  assert renamed.returncode == 2 and 'Traceback' not in renamed.stderr, renamed.stderr[-3000:]
  assert ("--config.fedprox.client_learning_rate: a method's own client learning rate is "
          "config.client_overrides.fedprox.learning_rate, e.g. --config.client_overrides="
          "\"{'fedprox': {'learning_rate': …}}\"") in renamed.stderr
  # a benchmark's own field given beside the shared ones: the section that holds it; a
  # field of another benchmark's section than the run's: refused (it would go unused)
  moved = subprocess.run(_launch(tmp_path / 'moved', 2) + ['--config.data.severity=3'],
                         capture_output=True, text=True, cwd=ROOT)
  assert moved.returncode == 2 and 'Traceback' not in moved.stderr, moved.stderr[-3000:]
  assert ("--config.data.severity: 'severity' is a benchmark's own field, in its section: "
          "--config.data.label_skew_corrupted.severity or --config.data.digit_domains.severity"
          ) in moved.stderr
  other = subprocess.run(_launch(tmp_path / 'other', 2) + ['--config.data.upfl.public_examples=9'],
                         capture_output=True, text=True, cwd=ROOT)
  assert other.returncode == 2 and 'Traceback' not in other.stderr, other.stderr[-3000:]
  assert ("config.data.upfl.public_examples: the run's benchmark is config.data.benchmark="
          "'label_skew_corrupted', which does not read config.data.upfl") in other.stderr
  assert not (tmp_path / 'moved').exists() and not (tmp_path / 'other').exists()
  # a sweep field given as a section and dotted: one message naming it
  twice = subprocess.run(_launch(tmp_path / 'twice', 2) + [
      "--config.sweep={'client': {'learning_rate': (0.1, 0.2)}, 'client.learning_rate': (0.3,)}"],
                         capture_output=True, text=True, cwd=ROOT)
  assert twice.returncode == 2 and 'Traceback' not in twice.stderr, twice.stderr[-3000:]
  assert 'client.learning_rate is swept twice' in twice.stderr
  # a method's override set as a dotted field where the method has none yet: the dict form
  dotted = subprocess.run(_launch(tmp_path / 'dotted', 2) +
                          ['--config.client_overrides.fedprox.learning_rate=0.3'],
                          capture_output=True, text=True, cwd=ROOT)
  assert dotted.returncode == 2 and 'Traceback' not in dotted.stderr, dotted.stderr[-3000:]
  assert "--config.client_overrides=\"{'fedprox': {'learning_rate': 0.3}}\"" in dotted.stderr
  # entries for a method the run does not train would go unused: refused, naming it
  # (fedavg.py:tiny runs FedAvg alone)
  for flag in ("--config.client_overrides={'fedprox': {'learning_rate': 0.3}}",
               "--config.sweep_metric={'fedprox': 'global/val/accuracy'}"):
    unused = subprocess.run(_launch(tmp_path / 'unused', 2) + [flag], capture_output=True,
                            text=True, cwd=ROOT)
    assert unused.returncode == 2 and 'Traceback' not in unused.stderr, unused.stderr[-3000:]
    section = flag.split('=')[0][len('--config.'):]
    assert (f"config.{section}.fedprox: config.algorithms ['fedavg'] does not run fedprox, "
            'so the entry would go unused') in unused.stderr, unused.stderr[-3000:]
  # ... but a config file's own entries for methods a shorter --config.algorithms leaves
  # out are let be (configs/fedtta.py tunes eight methods' rates)
  shorter = subprocess.run([sys.executable, '-c', (
      "import sys; sys.path.insert(0, 'launch'); import train; from configs import fedtta; "
      "c = fedtta.get_config(); c.algorithms = ('fedavg',); "
      "print(repr(train.entries_for_methods_not_run(c, ['--config=configs/fedtta.py'])))")],
      capture_output=True, text=True, cwd=ROOT)
  assert shorter.stdout.strip() == "''", shorter.stderr[-3000:]
  # an unroll that cannot be meant
  for unroll in ('0', '1000'):
    refused = subprocess.run(_launch(tmp_path / 'unroll', 2) + [f'--config.engine.unroll={unroll}'],
                             capture_output=True, text=True, cwd=ROOT)
    assert refused.returncode == 2 and 'config.engine.unroll: must be True' in refused.stderr, \
        refused.stderr[-3000:]
  # an int where the seeds' tuple goes: refused, naming both forms
  seeds = subprocess.run(_launch(tmp_path / 'seeds', 2) + ['--config.seeds=3'],
                         capture_output=True, text=True, cwd=ROOT)
  assert seeds.returncode == 2 and seeds.stderr.strip().splitlines() == [
      'launch/train.py: --config.seeds=3 would run seed 3 alone: config.seeds is the tuple of '
      'seeds to run, e.g. --config.seeds="(0, 1, 2)" for three, --config.seeds="(3,)" for '
      'seed 3 alone'], seeds.stderr[-3000:]
  # a variant typo: one line naming the variant and the known ones, like a field typo
  variant = subprocess.run(
      [arg.replace('fedavg.py:tiny', 'fedavg.py:tny') for arg in _launch(tmp_path / 'variant', 2)],
      capture_output=True, text=True, cwd=ROOT)
  lines = variant.stderr.strip().splitlines()
  assert variant.returncode == 2 and len(lines) == 1, variant.stderr[-3000:]
  assert lines[0].startswith('launch/train.py: --config=') and \
      "fedavg.py:tny: unknown config variant 'tny'; the known variants are" in lines[0]
  assert not os.path.exists(tmp_path / 'seeds') and not os.path.exists(tmp_path / 'variant')
  assert not os.path.exists(tmp_path / 'my') and not os.path.exists(tmp_path / 'bad')
  assert not os.path.exists(tmp_path / 'typo') and not os.path.exists(tmp_path / 'renamed')
  assert not os.path.exists(tmp_path / 'twice') and not os.path.exists(tmp_path / 'unroll')
  assert not os.path.exists(tmp_path / 'unused')


@pytest.mark.slow
def test_ctrl_c_saves_says_how_to_resume_and_prints_no_traceback(tmp_path):
  """Ctrl-C (SIGINT) saves, says how to resume, exits 130. Slow: inside the whole
  parallel suite (pytest-xdist, 2 workers) the run has been seen to exit 0 after the
  signal without training on, while alone or with its file it passes; run it with
  --runslow."""
  metrics_path = tmp_path / 'fedavg' / 'seed_0' / 'metrics.jsonl'
  proc = subprocess.Popen(_launch(tmp_path, 200), cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 300
  while time.time() < deadline and len(read_metrics(str(metrics_path))) < 3:
    time.sleep(0.05)
  proc.send_signal(signal.SIGINT)
  _, stderr = proc.communicate(timeout=120)
  assert proc.returncode == 130 and 'Traceback' not in stderr, stderr[-3000:]
  saved = sorted(int(p) for p in os.listdir(metrics_path.parent / 'checkpoints') if p.isdigit())
  assert f'interrupted: saved round {saved[-1]} of fedavg seed 0' in stderr
  assert 'run the same command again to resume' in stderr


def test_divergence_stops_with_round_and_keeps_checkpoint(tmp_path):
  config = tiny_config(rounds=6, checkpoint_every=1, **{'client.learning_rate': 1e30})
  with pytest.raises(FloatingPointError, match=r'non-finite training loss .* in round \d'):
    pipelines.run(config, str(tmp_path))
  ckpt_dir = tmp_path / 'fedavg' / 'seed_0' / 'checkpoints'
  saved = sorted(int(p) for p in os.listdir(ckpt_dir) if p.isdigit())
  records = read_metrics(str(tmp_path / 'fedavg' / 'seed_0' / 'metrics.jsonl'))
  assert all(np.isfinite(r['loss']) for r in records)
  # Every saved checkpoint is a round whose loss was finite.
  assert set(saved) <= {r['round'] for r in records}


def test_host_store_run_matches_device_store(tmp_path):
  a = pipelines.run(tiny_config(), str(tmp_path / 'device'))
  b = pipelines.run(tiny_config(**{'data.store': 'host'}), str(tmp_path / 'host'))
  for key, value in a.records['results'][0]['metrics'].items():
    np.testing.assert_allclose(b.records['results'][0]['metrics'][key], value, rtol=1e-5, atol=1e-6)


def accuracy_cells(markdown: str) -> dict:
  """{(method, column): (mean, std)} of the first table in ``markdown`` whose header
  starts with 'method' and names 'global/test': its 'mean ± std' cells."""
  lines = [l for l in markdown.splitlines() if l.startswith('| ')]
  start = next(i for i, l in enumerate(lines) if l.startswith('| method |') and 'global/test' in l)
  header = [c.strip() for c in lines[start].strip('|').split('|')]
  cells = {}
  for line in lines[start + 1:]:
    row = [c.strip() for c in line.strip('|').split('|')]
    if set(row[0]) <= set('-: '):
      continue
    if len(row) != len(header) or row[0] == 'method':
      break
    for column, cell in zip(header[1:], row[1:]):
      if ' ± ' in cell:
        mean, std = cell.split(' ± ')
        cells[(row[0], column)] = (float(mean), float(std.split()[0]))
  return cells


@pytest.mark.slow
def test_default_experiment_prints_the_readme_table_within_its_stated_spread(tmp_path):
  """README command 1 in full (3 methods × 3 seeds, about 70 s on 2 cores): every
  'mean ± std' cell of the README's table, within the spread the README states for
  other CPU types (XLA:CPU rounds differently per CPU type)."""
  import re
  with open(os.path.join(ROOT, 'README.md')) as f:
    readme = f.read()
  spread = re.search(r'every mean within ([0-9.]+) and every standard deviation within '
                     r'([0-9.]+) of', readme)
  assert spread, 'the README states the spread of its table across CPU types'
  mean_spread, std_spread = float(spread.group(1)), float(spread.group(2))
  expected = accuracy_cells(readme[readme.index('What the default experiment prints'):])
  assert len(expected) == 9   # fedavg, fedprox: global; fedbn: personalized; 3 splits
  run = subprocess.run([sys.executable, 'launch/train.py', '--config=configs/default.py',
                        f'--workdir={tmp_path}', '--compilation_cache='],
                       capture_output=True, text=True, cwd=ROOT)
  assert run.returncode == 0, run.stderr[-3000:]
  with open(tmp_path / 'results.md') as f:
    printed = accuracy_cells(f.read())
  assert set(printed) == set(expected)
  off = {key: (printed[key], expected[key]) for key in expected
         if abs(printed[key][0] - expected[key][0]) > mean_spread + 1e-9 or
         abs(printed[key][1] - expected[key][1]) > std_spread + 1e-9}
  assert not off, f'printed vs the README table, beyond the stated spread: {off}'


def _records(workdir):
  return without_timing(read_metrics(str(workdir / 'fedavg' / 'seed_0' / 'metrics.jsonl')))


def test_rounds_per_call_gives_the_same_rounds(tmp_path):
  """12 rounds as 12 calls or as scans of 5 (chunks 1–4, 5, 6–8, 9–10, 11–12: cut at
  multiples of 5 and at the evaluation rounds 4, 8, 12): the same per-round records and
  the same final model and evaluation."""
  base = dict(rounds=12, eval_every=4, checkpoint_every=3)
  one = pipelines.run(tiny_config(**base), str(tmp_path / 'one'))
  five = pipelines.run(tiny_config(**base, **{'engine.rounds_per_call': 5}),
                       str(tmp_path / 'five'))
  a, b = _records(tmp_path / 'one'), _records(tmp_path / 'five')
  assert [r['round'] for r in b] == list(range(1, 13))
  assert [sorted(r) for r in a] == [sorted(r) for r in b]  # evaluations on the same rounds
  for ra, rb in zip(a, b):
    for key, value in ra.items():
      np.testing.assert_allclose(rb[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
  for key, value in one.records['results'][0]['metrics'].items():
    np.testing.assert_allclose(five.records['results'][0]['metrics'][key], value, rtol=1e-5,
                               atol=1e-6)
  # Checkpoints at the ends of calls that crossed a multiple of checkpoint_every.
  kept = sorted(int(p) for p in os.listdir(tmp_path / 'five' / 'fedavg' / 'seed_0' /
                                           'checkpoints') if p.isdigit())
  assert kept == [10, 12]  # keep_checkpoints=2 of the saves after rounds 4, 5, 8, 10, 12


def test_divergence_inside_a_call_names_its_round_and_keeps_the_checkpoint(tmp_path):
  """A loss that turns NaN in round 7, inside the call running rounds 7–8 (calls: 1–3,
  4, 5–6, 7–8 for R=3 cut at evaluation round 4); the checkpoint saved at the end of the
  call that crossed round 5 (checkpoint_every) — round 6 — stays."""
  import jax.numpy as jnp
  from fedjax_shift.algorithms import ALGORITHMS
  from fedjax_shift.algorithms.fedavg import fedavg

  def nan_in_round_seven(hparams, context):
    base = fedavg(hparams, context)

    def client_update(server_state, client_state, data, rng):
      out, state = base.client_update(server_state, client_state, data, rng)
      loss = jnp.where(server_state.round == 6, jnp.nan, out.metrics['loss'])
      return out._replace(metrics={**out.metrics, 'loss': loss}), state
    return base._replace(client_update=client_update)

  ALGORITHMS.register('toy_nan_round7')(nan_in_round_seven)
  try:
    config = tiny_config(rounds=8, eval_every=4, checkpoint_every=5,
                         algorithms=('toy_nan_round7',), **{'engine.rounds_per_call': 3})
    with pytest.raises(FloatingPointError, match=r'in round 7; the last good checkpoint '
                                                 r'\(round 6\)'):
      pipelines.run(config, str(tmp_path))
  finally:
    ALGORITHMS.unregister('toy_nan_round7')
  run_dir = tmp_path / 'toy_nan_round7' / 'seed_0'
  assert [r['round'] for r in read_metrics(str(run_dir / 'metrics.jsonl'))] == [1, 2, 3, 4, 5, 6]


def test_on_divergence_continue_records_the_run_and_goes_on(tmp_path):
  import jax.numpy as jnp
  from fedjax_shift.algorithms import ALGORITHMS
  from fedjax_shift.algorithms.fedavg import fedavg

  def nan_from_round_two(hparams, context):
    base = fedavg(hparams, context)

    def client_update(server_state, client_state, data, rng):
      out, state = base.client_update(server_state, client_state, data, rng)
      loss = jnp.where(server_state.round >= 1, jnp.nan, out.metrics['loss'])
      return out._replace(metrics={**out.metrics, 'loss': loss}), state
    return base._replace(client_update=client_update)

  ALGORITHMS.register('toy_nan_round2')(nan_from_round_two)
  try:
    config = tiny_config(rounds=3, algorithms=('toy_nan_round2', 'fedavg'),
                         on_divergence='continue')
    out = pipelines.run(config, str(tmp_path))
  finally:
    ALGORITHMS.unregister('toy_nan_round2')
  diverged, fedavg_run = out.records['results']
  assert 'in round 2' in diverged['diverged'] and diverged['metrics'] == {}
  assert 0.0 <= fedavg_run['metrics']['global/test/accuracy'] <= 1.0   # it still ran
  assert '| toy_nan_round2 | n/a' in out.records['table']['markdown']
  assert '1 (1 diverged)' in out.records['table']['markdown']
  with open(tmp_path / 'toy_nan_round2' / 'seed_0' / 'results.json') as f:   # for report.py
    assert 'in round 2' in json.load(f)['diverged']
  with pytest.raises(ValueError, match='config.on_divergence'):
    pipelines.run(tiny_config(on_divergence='retry'), str(tmp_path / 'bad'))


@pytest.mark.parametrize('field, value, pattern', [
    ('engine.rounds_per_call', 0, r'config.engine.rounds_per_call: must be >= 1'),
    ('data.store', 'host', r"config.engine.rounds_per_call: > 1 scans rounds over the device"),
    ('engine.backend', 'loop', r"config.engine.rounds_per_call: > 1 scans the compiled round"),
])
def test_rounds_per_call_bad_input(field, value, pattern, tmp_path):
  config = tiny_config(**{'engine.rounds_per_call': 3, field: value})
  with pytest.raises(ValueError, match=pattern):
    pipelines.run(config, str(tmp_path))


def test_later_seeds_with_the_same_shapes_reuse_the_compiled_programs(tmp_path):
  """Compile once: seeds 0, 1, 2 of an IID partition have the same padded
  shapes, so seeds 1 and 2 run the method, round and evaluation compiled for seed 0
  (zero XLA compilations, counted from jax.monitoring) — and give exactly the
  metrics a process that runs seed 1 alone gives."""
  config = tiny_config(**{'data.partition': 'iid', 'progress': False})
  config.seeds = (0, 1, 2)
  out = pipelines.run(config, str(tmp_path / 'all'))
  results = out.records['results']
  assert results[0]['compilations'] > 0
  assert [r['compilations'] for r in results[1:]] == [0, 0], results
  config.seeds = (1,)
  alone = pipelines.run(config, str(tmp_path / 'one')).records['results'][0]
  assert alone['compilations'] > 0
  assert alone['metrics'] == results[1]['metrics']


def test_pad_to_gives_dirichlet_seeds_one_compilation_and_the_same_metrics(tmp_path):
  """Dirichlet seeds pad to different client sizes N (each recompiles); with
  data.pad_to, a bound for all of them, seed 1 reuses seed 0's programs — and its
  metrics equal the unpadded run's (padding is masked everywhere)."""
  from fedjax_shift.pipelines.runs import build_data
  config = tiny_config(progress=False)
  sizes = [build_data(config, seed).splits['train'].max_examples for seed in (0, 1)]
  assert sizes[0] != sizes[1], sizes            # the case really differs by seed
  bound = max(build_data(config, s).splits[n].max_examples
              for s in (0, 1) for n in ('train', 'val', 'test', 'test_corrupted'))
  config.seeds = (0, 1)
  plain = pipelines.run(config, str(tmp_path / 'plain')).records['results']
  assert plain[1]['compilations'] > 0
  config.data.pad_to = bound
  padded = pipelines.run(config, str(tmp_path / 'padded')).records['results']
  assert padded[1]['compilations'] == 0, padded
  for a, b in zip(plain, padded):
    for key, value in a['metrics'].items():
      np.testing.assert_allclose(b['metrics'][key], value, rtol=1e-5, atol=1e-6, err_msg=key)
  config.data.pad_to = min(sizes) - 1
  with pytest.raises(ValueError, match=r'config.data.pad_to=.*raise pad_to'):
    pipelines.run(config, str(tmp_path / 'small'))
  config.data.pad_to = -1
  with pytest.raises(ValueError, match=r'config.data.pad_to: must be >= 0'):
    pipelines.run(config, str(tmp_path / 'negative'))


def test_a_workdir_held_by_a_live_run_is_a_refusal_with_exit_status_2(tmp_path):
  # A refused workdir exits 2 as the README says (WorkdirBusyError once exited 1).
  sleeper = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])
  try:
    tmp_path.joinpath('busy').mkdir()
    (tmp_path / 'busy' / '.lock').write_text(json.dumps(
        {'host': os.uname().nodename, 'pid': sleeper.pid, 'started': 'then'}))
    busy = subprocess.run(_launch(tmp_path / 'busy', 2), capture_output=True, text=True,
                          cwd=ROOT)
  finally:
    sleeper.kill()
    sleeper.wait()
  assert busy.returncode == 2 and 'Traceback' not in busy.stderr, busy.stderr[-3000:]
  assert f'in use by a live run: pid {sleeper.pid}' in busy.stderr
  assert sorted(os.listdir(tmp_path / 'busy')) == ['.lock']   # no probe file left behind
