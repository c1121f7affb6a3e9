"""launch/benchmark.py's cohort sweep: every case at each --clients size and
each --conv, the PyTorch peers once per size, and a table of the ratios the GPU
targets are stated in. Times are not checked (that is the benchmark's job); the
table's rows, its arithmetic and the flag errors are."""
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARK = os.path.join(ROOT, 'launch', 'benchmark.py')


def _run(*flags):
  return subprocess.run([sys.executable, BENCHMARK, *flags], capture_output=True, text=True,
                        cwd=ROOT)


@pytest.mark.slow   # eight benchmark subprocesses
def test_cohort_sweep_runs_each_size_and_conv_and_prints_the_ratios(tmp_path):
  out = tmp_path / 'bench.md'
  proc = _run('--model=atp_cnn', '--clients=2,3', '--conv=lax,patches', '--examples=4',
              '--batch_size=4', '--repeats=1', '--cases=round,torch_vmap', '--populations=',
              f'--out={out}')
  assert proc.returncode == 0, proc.stderr[-2000:]
  # One (a) per (size, conv); the PyTorch peer once per size, reused for both convs.
  printed = [line.split(' ', 1) for line in proc.stdout.splitlines()
             if line.startswith(('round {', 'torch_vmap {'))]
  assert [name for name, _ in printed].count('round') == 4
  assert [name for name, _ in printed].count('torch_vmap') == 2
  text = out.read_text()
  assert text.count('### atp_cnn, (32, 32, 3) inputs, 2 clients') == 2
  assert text.count('### atp_cnn, (32, 32, 3) inputs, 3 clients') == 2
  sweep = text[text.index('### Cohort sweep'):]
  rows = [line.split('|')[1:-1] for line in sweep.splitlines() if re.match(r'\| \d', line)]
  assert [(r[0].strip(), r[1].strip()) for r in rows] == [
      ('2', 'lax'), ('2', 'patches'), ('3', 'lax'), ('3', 'patches')]
  rounds = [json.loads(json_text) for name, json_text in printed if name == 'round']
  peers = [json.loads(json_text) for name, json_text in printed if name == 'torch_vmap']
  for row, result, peer in zip(rows, rounds, [peers[0], peers[0], peers[1], peers[1]]):
    assert float(row[2]) == pytest.approx(result['seconds'], abs=1e-3)   # (a) s/round
    if 'seconds' in peer:   # (e) ran (torch installed): (a)/(e) is their quotient
      assert float(row[9]) == pytest.approx(result['seconds'] / peer['seconds'], abs=0.006)
    else:
      assert row[6].strip() == row[9].strip() == '—'
  assert rows[0][6] == rows[1][6] and rows[2][6] == rows[3][6]   # one (e) run per size


@pytest.mark.parametrize('flag, message', [
    ('--clients=60,0', "--clients: '0' is not a positive integer"),
    ('--conv=lax,grouped', "--conv: unknown 'grouped'; choose from auto, lax, patches"),
    ('--conv=patches', '--conv=patches: --model=mlp has no convolutions'),
])
def test_bad_sweep_flags_are_errors_naming_the_flag(flag, message):
  proc = _run('--model=mlp', flag, '--populations=')
  assert proc.returncode != 0
  assert message in proc.stderr


def test_size_profiles_table_puts_skewed_next_to_uniform_with_real_and_scanned_steps(tmp_path):
  out = tmp_path / 'profiles.md'
  proc = _run('--model=mlp', '--clients=6', '--examples=8', '--batch_size=4', '--repeats=1',
              '--unroll=1', '--profiles=uniform,skewed', '--cases=round,fedjax',
              '--populations=', f'--out={out}')
  assert proc.returncode == 0, proc.stderr[-2000:]
  text = out.read_text()
  # The skewed profile keeps the total: 6 clients x mean 8 = 48 examples.
  assert '- uniform: 6 clients, 48 examples (min 8, median 8, max 8), 12 real local steps' in text
  assert re.search(r'- skewed: 6 clients, 4\d examples', text)
  results = {}
  for line in proc.stdout.splitlines():
    match = re.match(r'(uniform|skewed) (round|fedjax) (\{.*)', line)
    if match:
      results[match[1], match[2]] = json.loads(match[3])
  row = next(line for line in text.splitlines() if line.startswith('| (a)')).split('|')[1:-1]
  uniform, skewed = results['uniform', 'round'], results['skewed', 'round']
  assert float(row[1].split()[0]) == pytest.approx(uniform['seconds'], rel=1e-3)
  assert row[3].strip() == f"{skewed['seconds'] / uniform['seconds']:.2f}×"
  assert row[4].strip() == '12/12 (100%)'   # uniform: every scanned step is real
  assert skewed['local_steps'] <= skewed['scanned_steps']
  fedjax_row = next(line for line in text.splitlines() if line.startswith('| (f)'))
  if 'seconds' not in results['uniform', 'fedjax']:   # no fedjax here: the reason is shown
    assert 'fedjax does not import here' in fedjax_row or 'no fedjax twin' in fedjax_row


def test_an_unknown_size_profile_is_an_error_naming_the_flag():
  proc = _run('--model=mlp', '--profiles=uniform,lumpy', '--populations=')
  assert proc.returncode != 0
  assert "--profiles: unknown 'lumpy'" in proc.stderr


GPU_CHECK = os.path.join(ROOT, 'launch', 'gpu_check.sh')


def _gpu_check(*args):
  # STAGE_TIMEOUT bounds a stage that would otherwise start a whole paper run.
  env = dict(os.environ, STAGE_TIMEOUT='60', PATH=os.path.dirname(sys.executable) +
             os.pathsep + os.environ.get('PATH', ''))
  return subprocess.run(['bash', GPU_CHECK, *args], capture_output=True, text=True,
                        cwd=ROOT, env=env)


def test_gpu_check_refuses_an_unknown_stage_before_anything_runs(tmp_path):
  proc = _gpu_check('bogus', str(tmp_path))
  assert proc.returncode == 2
  assert "unknown stage 'bogus'" in proc.stderr
  assert list(tmp_path.iterdir()) == []


def test_gpu_check_passes_extra_arguments_to_the_papers_run(tmp_path):
  """The atp stage hands what follows OUTDIR to launch/train.py: an unknown config field
  there stops train.py with an error naming it, in the stage's log."""
  _gpu_check('atp', str(tmp_path), '--config.no_such_field=1')
  log = (tmp_path / 'atp.log').read_text()
  assert 'no_such_field' in log, log[-2000:]


def test_surgical_test_time_case_times_its_block_selection_on_its_own():
  proc = _run('--model=bn_mlp', '--clients=2', '--examples=40', '--batch_size=20',
              '--repeats=1', '--cases=tta_vmap', '--tta_adapter=surgical', '--populations=')
  assert proc.returncode == 0, proc.stderr[-2000:]
  line = next(line for line in proc.stdout.splitlines() if line.startswith('tta_vmap {'))
  result = json.loads(line.split(' ', 1)[1])
  assert result['select_s'] > 0 and result['seconds'] > 0


def test_tta_compare_case_prints_each_adapter_per_model_pass_against_the_first():
  """Tent's batch is one gradient step (3 forward-pass units), SAR's two (6), NOTE's a
  forward and, every 64 examples, a step on its memory (1 + 3·16/64 at batch 16), no
  adaptation's a forward: each row's ratio to Tent divided by its work relative to
  Tent's, and its seconds per batch divided by its steps at Tent's measured cost plus its
  forwards at the model's on a batch of every client."""
  proc = _run('--model=bn_mlp', '--clients=2', '--examples=64', '--batch_size=16',
              '--repeats=1', '--cases=tta_compare', '--tta_compare=tent,sar,note,no_adapt',
              '--populations=')
  assert proc.returncode == 0, proc.stderr[-2000:]
  line = next(line for line in proc.stdout.splitlines() if line.startswith('tta_compare {'))
  rows = json.loads(line.split(' ', 1)[1])['adapters']
  passes = {'tent': 3.0, 'sar': 6.0, 'note': 1 + 3 * 16 / 64, 'no_adapt': 1.0}
  work = {'tent': (1, 0), 'sar': (2, 0), 'note': (16 / 64, 1), 'no_adapt': (0, 1)}
  result = json.loads(line.split(' ', 1)[1])
  tent_s, forward_s = rows['tent']['seconds_per_batch'], result['forward_seconds_per_batch']
  assert forward_s > 0
  for name, row in rows.items():
    assert row['passes_per_batch'] == pytest.approx(passes[name])
    assert row['ratio_per_pass'] == pytest.approx(row['ratio'] * 3.0 / passes[name])
    steps, forwards = work[name]
    assert row['work_per_batch'] == pytest.approx([steps, forwards])
    assert row['ratio_to_work'] == pytest.approx(
        row['seconds_per_batch'] / (steps * tent_s + forwards * forward_s))
  assert rows['tent']['ratio'] == 1.0 and rows['tent']['ratio_to_work'] == pytest.approx(1.0)
  assert re.search(r'\| `sar` \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| 6 \| [0-9.]+ \| '
                   r'2 \+ 0 \| [0-9.]+ \|', proc.stdout)


def test_a_failed_case_reports_its_error_line_not_jaxs_traceback_note():
  """NOTE's memory of 64 is longer than a stream of 16 examples: refused, and the
  table names the refusal."""
  proc = _run('--model=bn_mlp', '--clients=2', '--examples=16', '--batch_size=8',
              '--repeats=1', '--cases=tta_compare', '--tta_compare=tent,note', '--populations=')
  line = next(line for line in proc.stdout.splitlines() if line.startswith('tta_compare {'))
  assert 'memory_size = 64 is longer than the test stream' in line


def test_kernel_summary_sums_device_kernels_by_name_and_leaves_out_the_host():
  from helpers import launch_module
  launch_module('benchmark')   # puts the repository root on sys.path for launch.benchmarks
  from launch.benchmarks import engine
  trace = {'traceEvents': [
      {'ph': 'M', 'name': 'process_name', 'pid': 1, 'args': {'name': '/device:GPU:0'}},
      {'ph': 'M', 'name': 'process_name', 'pid': 2, 'args': {'name': '/host:CPU'}},
      {'ph': 'X', 'pid': 1, 'name': 'gemm', 'dur': 300.0},
      {'ph': 'X', 'pid': 1, 'name': 'conv', 'dur': 500.0},
      {'ph': 'X', 'pid': 1, 'name': 'gemm', 'dur': 400.0},
      {'ph': 'X', 'pid': 2, 'name': 'gemm', 'dur': 9000.0},   # host thread: not a kernel
  ]}
  summary = engine.kernel_summary(trace, top=1)
  # Device time 300 + 500 + 400 µs; gemm (700 µs, 2 calls) is the longest.
  assert summary['kernel_seconds'] == pytest.approx(1.2e-3)
  assert summary['top'] == [['gemm', pytest.approx(7e-4), 2]]


def test_trace_flag_writes_a_trace_of_the_round_and_its_kernel_table(tmp_path):
  out = tmp_path / 'bench.md'
  proc = _run('--model=mlp', '--clients=2', '--examples=4', '--batch_size=4', '--repeats=1',
              '--cases=round', '--populations=', f'--trace={tmp_path / "trace"}', f'--out={out}')
  assert proc.returncode == 0, proc.stderr[-2000:]
  result = json.loads(next(line for line in proc.stdout.splitlines()
                           if line.startswith('round {')).split(' ', 1)[1])
  assert os.path.exists(result['kernels']['trace'])
  assert result['kernels']['trace'].startswith(str(tmp_path / 'trace' / 'mlp_2_auto'))
  if result['kernels']['top']:   # an accelerator: the table follows (a)'s row
    assert 'Device kernels of one traced round' in out.read_text()


def test_grid_cases_time_a_sweep_as_one_program_and_run_by_run():
  proc = _run('--model=mlp', '--clients=2', '--examples=8', '--batch_size=4', '--repeats=1',
              '--unroll=false', '--grid_rates=0.01,0.1', '--seeds=2',
              '--cases=grid_vmap,grid_loop', '--populations=')
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert '2 learning rates × 2 seeds of the FedAvg round, one vmapped program' in proc.stdout
  assert 'sweep as one program / runs one by one = ' in proc.stdout


def test_population_sweep_stores_distinct_examples_and_moves_only_the_cohorts(tmp_path):
  """Populations of distinct rotated images in the compact store: the store holds each
  example's bytes once (plus labels and offsets), the host store moves about the
  cohort's real bytes, the device store nothing."""
  out = tmp_path / 'population.md'
  proc = _run('--model=mlp', '--clients=8', '--batch_size=4', '--cases=', '--sweep_repeats=1',
              '--populations=40', '--placements=host,device', f'--out={out}')
  assert proc.returncode == 0, proc.stderr[-2000:]
  results = {}
  for line in proc.stdout.splitlines():
    match = re.match(r'sweep 40 (host|device) (\{.*)', line)
    if match:
      results[match[1]] = json.loads(match[2])
  for placement, result in results.items():
    # 8.4 × 40 = 336 distinct images, 784 uint8 bytes each
    assert result['examples'] == 336 and result['example_bytes'] == 336 * 784
    assert result['example_bytes'] <= result['store_bytes'] <= 1.1 * result['example_bytes']
    assert 0 <= result['fallback_rounds'] <= result['rounds']
    assert 0 < result['local_steps'] <= result['scanned_steps']
  host = results['host']
  # A cohort of 8 varies a lot round to round, so its capacity (the expected examples
  # plus two standard deviations) is up to ~1.5× a round's; the padded float32 layout
  # would move 8 × the largest client × 784 × 4 bytes.
  assert 0 < host['sent_bytes_per_round'] <= 2 * host['cohort_bytes_per_round'] + 2048
  assert host['sent_bytes_per_round'] < 8 * host['largest_client'] * 784 * 4 / 4
  assert results['device']['sent_bytes_per_round'] == 0
  rows = [line for line in out.read_text().splitlines() if line.startswith('| 40 |')]
  assert [row.split('|')[2].strip() for row in rows] == ['host', 'device']
