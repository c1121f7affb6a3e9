"""Benchmark of the compiled round (a script, not a test).

For one model, on the same cohort (C clients × N examples, one local epoch of batch
B, FedAvg with SGD):

  (a) round   the compiled vmapped round (one jit call)
  (b) loop    a Python loop over clients calling a jitted per-client update, then
              the jitted server update (the naive port)
  (c) fused   one jitted centralized step over the pooled C·B-example batches for
              the same number of steps (same FLOPs) — the limit a round can approach
  (d) torch   the per-client PyTorch loop of the papers' code (deepcopy global,
              train, average), when torch is importable (never a dependency); on the
              GPU when torch sees one
  (e) torch_vmap  PyTorch torch.func: the clients' parameters stacked, one vmapped
              gradient per local step (BatchNorm on batch statistics); GPU as (d)
  (f) fedjax  fedjax 0.0.17's FedAvg (a Python loop of its jitted per-client step) on a
              Haiku twin of the MLP, in --fedjax_python's environment (fedjax needs an
              older jax); skipped with the reason when fedjax does not import
  loop_backend  the engine's round with ``engine.backend='loop'`` (sampling, keys,
              stragglers, scatter included), to compare with (a) and (b)
  tta_vmap / tta_loop  an online adapter (--tta_adapter: ATP with α = 0.1, Tent, Surgical
              as the ATP release runs it, whose block selection on 1,000 labelled
              source examples is timed on its own as select_s, FedICON's
              contrastive adaptation with a memory, or FedTHE's ensemble)
              over the same clients as target clients, batches of B: the jitted
              vmapped scan vs a Python loop over clients of a jitted step (opt-in)
  tta_episodic / tta_transductive  the vmapped scan in the episodic mode, and in the
              transductive mode (--tta_epochs passes over each client's shuffled test
              split, then prediction; FedICON only) (opt-in)
  fedevolve   FedEvolve's compiled round on the same cohort (the client data read as
              10 domains of N/10; one local iteration = 9 consecutive-domain steps,
              each a batch of B from both domains through φ and ψ), next to (a) (opt-in)
  fedtta      FedTTA's compiled round on the same cohort: one epoch of steps, each an
              inner step on ‖g(f(X; ψ); φ)‖₂ and the CE of the adapted model
              differentiated through it (second order), next to (a) (opt-in)
  algorithm:<name>[:<field>=<value>…]  the compiled round of any registered method
              (its registered defaults but the named fields of its section, one epoch)
              on the same cohort, next to (a) (opt-in; e.g.
              --cases=round,algorithm:scaffold,algorithm:fedins:head_pool=True)
  seeds_vmap / seeds_loop  --seeds seeds of the FedAvg round on the same cohort: one
              call vmapped over seeds (engine.vmap_seeds) vs one call per seed (opt-in)
  processes:<P>  the default experiment's tiny variant through launch/train.py, FedAvg
              with a cohort of 4 over 4 CPU devices: P = 2 processes of 2 devices on the
              loopback address (JAX's distributed runtime, Gloo collectives) or P = 1
              process of 4; seconds per round (median of rounds 2-10 of metrics.jsonl);
              next to each other (opt-in; --cases=processes:1,processes:2)
  grid_vmap / grid_loop  a hyperparameter sweep: --grid_rates client learning rates ×
              --seeds seeds of the FedAvg round (each seed its own init and keys), as the
              pipeline runs config.sweep (the rate a traced argument, points × seeds one
              vmapped call) vs one run after another (a program per rate, a call per
              run); seconds per round of all runs, compile seconds of all programs
              (opt-in)
  hetero_fedtta / hetero_fedtta_medium  HeteroFedTTA's grouped round (core/groups.py):
              the C clients dealt to small / medium / big MLPs (or all medium, one
              group), 10 Eq. 14 digest steps on a 500-image public set, one epoch of
              FedTTA steps, logits on the public set; MLP models only (opt-in)
  fedtta_e50 / fedtta_pp_scan / fedtta_pp_while  FedTTA's test-time adaptation of C
              new clients (episodic batches of B): 50 inner steps, vs FedTTA++'s entropy
              early stop (patience 1) as a masked scan and as a while_loop (opt-in)
  rates:<K>:<remat|plain>  the learned-rates round (adapters/learned_rates.py) of
              --tta_adapter (atp: α online; tent: per-BN-layer rates) through K online
              test batches of B, one step, with or without jax.checkpoint on each
              test-time step; next to alpha_round (opt-in; e.g. --cases=alpha_round,
              rates:1:plain,rates:5:plain,rates:5:remat,rates:10:plain,rates:10:remat)
  fedavg_1step / alpha_round  the compiled FedAvg round with ONE local step of batch
              B vs ATP's α-training round with one α step of batch B on the same
              cohort (entropy forward/backward for h, then CE forward/backward
              through θ − α⊙h) (opt-in)
  images:<serial|threads|grain>  reading a folder of 2,000 64×64 PNGs in 10 class
              folders (data.sources.image_folder): one file after another, the library's
              thread pool (one thread per core), or grain's DataLoader in one worker
              process per core (skipped when grain is not importable); seconds per
              folder and images/s (opt-in; --cases=images:serial,images:threads
              --populations=)

then a population sweep (host store, cohort fixed) over K clients.

Client sizes: --sizes picks a profile ('uniform': N each; 'skewed': SKEWED_SIZES, a
floor of 20 plus a Dirichlet(0.5) split, tiled and scaled to C clients of mean N;
'default_experiment': the train split of configs/default.py, seed 0). --profiles
runs every case at each listed profile instead, interleaved case by case, --passes
times, and prints one table: seconds with the machine's load, the ratio to the first
profile, and the round's real / scanned local steps (its own metrics). The round cases
plan the cohort as the pipeline does (groups sorted by size, width fitted under
--max_scanned or --client_chunk, padded sizes fitted to the sizes). Each case runs in
its own subprocess so its peak RSS is its own. Prints a markdown table; --out writes it.

The cases live in launch/benchmarks/, registered by name in a module per subject:
engine.py (the rounds), test_time.py, sweeps.py (seeds, grids, processes, whole runs),
data.py (reading image folders) and peers.py (PyTorch, fedjax); this script is the launcher and the tables.

--clients and --conv take lists: every case runs at each cohort size with each
convolution (the PyTorch peers once per size), one table each, then a cohort-sweep
table of (a), (c), (d), (e) and the ratios (a)/(c), (a)/(d), (a)/(e) per row (the
targets on a GPU: (a)/(e) ≤ 1 at every size and (a)/(c) ≤ 2 at 240 clients).

    python launch/benchmark.py --model=atp_cnn --out=/tmp/bench_cnn.md
    python launch/benchmark.py --model=mlp --out=/tmp/bench_mlp.md
    python launch/benchmark.py --model=atp_cnn --clients=60,240,1000 --conv=lax,patches \
        --cases=round,fused,torch,torch_vmap --populations= --out=/tmp/bench_sweep.md
    python launch/benchmark.py --model=mlp --profiles=uniform,skewed --passes=3 --unroll=1 \
        --cases=round,loop_backend,fused,torch,fedjax --torch_threads=1 \
        --fedjax_python=/path/to/fedjax-venv/bin/python --populations=
"""
import json
import os
import platform
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # noqa: E402

from launch.benchmarks import (data, engine, find, peers, sweeps,  # noqa: E402,F401  (register)
                               test_time)
from launch.benchmarks.common import (CONV_CHOICES, CONV_MODELS, FLAGS, SHAPES,  # noqa: E402
                                      SIZE_PROFILES, TORCH_CASES, client_sizes, define_flags,
                                      real_steps, run_case)

def max_scanned() -> float:
  """--max_scanned, or the engine's default where it is unset."""
  from fedjax_shift.core.plan import MAX_SCANNED
  return MAX_SCANNED if FLAGS.max_scanned is None else FLAGS.max_scanned


# The script a case runs in: this one, or for the peers that run in their own
# environment (--fedjax_python) the peers' module, which imports nothing of fedjax_shift.
PEER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'benchmarks', 'peers.py')


def label(name: str) -> str:
  """The table row name of case ``name``."""
  return find(name).label(name)


def check_flags():
  """Errors naming the flag for a cohort size that is not a positive integer or an
  unknown convolution."""
  for size in FLAGS.clients:
    if not size.isdigit() or int(size) < 1:
      raise app.UsageError(f'--clients: {size!r} is not a positive integer')
  for profile in FLAGS.profiles:
    if profile not in SIZE_PROFILES:
      raise app.UsageError(f'--profiles: unknown {profile!r}; choose from '
                           f'{", ".join(SIZE_PROFILES)}')
  for name in FLAGS.cases:
    try:
      find(name)
    except ValueError as err:
      raise app.UsageError(str(err)) from None
  if FLAGS.passes < 1:
    raise app.UsageError(f'--passes must be >= 1, got {FLAGS.passes}')
  for conv in FLAGS.conv:
    if conv not in CONV_CHOICES:
      raise app.UsageError(f'--conv: unknown {conv!r}; choose from {", ".join(CONV_CHOICES)}')
  for conv in FLAGS.conv:
    if conv != 'auto' and FLAGS.model not in CONV_MODELS:
      raise app.UsageError(f'--conv={conv}: --model={FLAGS.model} has no convolutions '
                           f'(leave --conv at auto)')


def spawn(name, clients: int, conv: str, sizes: str = ''):
  """Runs case ``name`` at cohort size ``clients`` with ``config.model.conv=conv`` and
  client sizes ``sizes`` (a --sizes profile; '' = --sizes) in a subprocess (its own
  peak RSS; the 'fedjax' case in --fedjax_python's interpreter); returns its result
  dict (with the machine's 1-minute load average at its start) or {'error': last
  stderr line}."""
  sizes = sizes or FLAGS.sizes
  python = FLAGS.fedjax_python if name == 'fedjax' and FLAGS.fedjax_python else sys.executable
  listed = ','.join(str(n) for n in client_sizes(clients, sizes))
  script = PEER_SCRIPT if name == 'fedjax' else os.path.abspath(__file__)
  argv = [python, script, f'--case={name}', f'--clients={clients}',
          f'--conv={conv}', f'--sizes={sizes}', f'--sizes_list={listed}']
  argv += [f'--{f}={FLAGS[f].serialize().split("=", 1)[1]}' for f in
           ('model', 'examples', 'batch_size', 'repeats', 'unroll', 'client_chunk',
            'sweep_repeats', 'tta_adapter', 'tta_compare', 'tta_epochs', 'rounds_per_call', 'seeds', 'trace',
            'grid_rates', 'max_scanned', 'torch_threads')
           if FLAGS[f].value is not None]   # unset: the case's own default
  load = os.getloadavg()[0]
  proc = subprocess.run(argv, capture_output=True, text=True)
  if proc.returncode:
    lines = proc.stderr.strip().splitlines()
    errors = [line for line in lines if 'Error' in line.split(':', 1)[0]]
    return {'error': (errors or lines or ['failed'])[-1], 'load': load}
  return {**json.loads(proc.stdout.strip().splitlines()[-1]), 'load': load}


def profile_comparison(clients: int, conv: str) -> str:
  """The --profiles table: each case of --cases at every profile, run interleaved (case
  by case, profile by profile) --passes times."""
  profiles, cases = FLAGS.profiles, FLAGS.cases
  runs = {(profile, name): [] for profile in profiles for name in cases}
  for _ in range(FLAGS.passes):
    for name in cases:
      for profile in profiles:
        result = spawn(name, clients, conv, profile)
        print(profile, name, json.dumps(result), flush=True)
        runs[(profile, name)].append(result)

  def cell(profile, name):
    done = [r for r in runs[(profile, name)] if 'seconds' in r]
    if not done:
      first = runs[(profile, name)][0]
      return None, first.get('skipped') or first.get('error'), ''
    seconds = statistics.median(r['seconds'] for r in done)
    load = max(r['load'] for r in done)
    steps = ''
    if 'scanned_steps' in done[0]:
      steps = (f"{done[0]['local_steps']}/{done[0]['scanned_steps']} "
               f"({done[0]['local_steps'] / done[0]['scanned_steps']:.0%})")
    return seconds, f'{seconds:.4g} (load {load:.1f})', steps

  sizes = {p: client_sizes(clients, p) for p in profiles}
  lines = [f'### Size profiles: {FLAGS.model}, one epoch of batch {FLAGS.batch_size}, '
           f'unroll={FLAGS.unroll}, max_scanned={max_scanned()}, '
           f'client_chunk={FLAGS.client_chunk} (0: fitted)\n',
           f'Machine: {machine()}. s/round: median of {FLAGS.passes} interleaved passes, each '
           f'the median of {FLAGS.repeats} after one warm-up; load: the 1-minute load '
           f'average at the start of the case (the highest of the passes).\n']
  for p in profiles:
    n = sizes[p]
    lines.append(f'- {p}: {len(n)} clients, {int(n.sum()):,} examples (min {n.min()}, median '
                 f'{int(statistics.median(n.tolist()))}, max {n.max()}), '
                 f'{real_steps(n)} real local steps')
  columns = ([f'{p} s/round' for p in profiles] + [f'{p} / {profiles[0]}' for p in profiles[1:]]
             + [f'{p} real/scanned steps' for p in profiles])
  lines += ['', '| case | ' + ' | '.join(columns) + ' |', '|---' * (1 + len(columns)) + '|']
  seconds = {}
  for name in cases:
    cells = [cell(p, name) for p in profiles]
    for p, (value, _, _) in zip(profiles, cells):
      seconds[(p, name)] = value
    ratios = [f'{c[0] / cells[0][0]:.2f}×' if c[0] and cells[0][0] else '—' for c in cells[1:]]
    row = [c[1] for c in cells] + ratios + [c[2] or '—' for c in cells]
    lines.append(f'| {label(name)} | ' + ' | '.join(row) + ' |')
  for ours in ('round', 'loop_backend'):
    for peer in ('torch', 'fedjax'):
      pairs = [f'{p} {seconds[(p, ours)] / seconds[(p, peer)]:.2f}' for p in profiles
               if seconds.get((p, ours)) and seconds.get((p, peer))]
      if pairs:
        lines.append(f'\n{label(ours)} / {label(peer)}: ' + ', '.join(pairs))
  return '\n'.join(lines)


def machine() -> str:
  import jax
  device = jax.devices()[0]
  return (f'{platform.processor() or platform.machine()}, {os.cpu_count()} cores, '
          f'{jax.default_backend()} ({device.device_kind}), jax {jax.__version__}')


def seconds(results: dict, name: str):
  """Seconds of case ``name``, or None where it did not run (skipped, error, absent)."""
  return results.get(name, {}).get('seconds')


def case_table(results: dict) -> str:
  """The markdown table of one cohort size and convolution, with its ratio lines."""
  base = seconds(results, 'fused')
  lines = ['| case | s/round | compile s | peak RSS GB | vs (c) fused | parameters sent per '
           'client | XLA GFLOP |', '|---|---|---|---|---|---|---|']
  for name, result in results.items():
    if 'seconds' not in result:
      lines.append(f"| {label(name)} | {result.get('skipped') or result.get('error')} | | | | "
                   f"| |")
      continue
    ratio = f"{result['seconds'] / base:.2f}×" if base else ''
    sent = f"{result['uploaded_parameters']:,}" if 'uploaded_parameters' in result else ''
    gflop = f"{result['flops'] / 1e9:.4g}" if 'flops' in result else ''
    lines.append(f"| {label(name)} | {result['seconds']:.4g} | {result['compile_s']:.1f} | "
                 f"{result['peak_rss_gb']:.2f} | {ratio} | {sent} | {gflop} |")
  for name, result in results.items():   # tta_compare: one row per adapter
    if 'adapters' in result:
      first = next(iter(result['adapters']))
      measured = all('ratio_to_work' in row for row in result['adapters'].values())
      forward = (f"\nA forward pass (every client's copy of the model on its batch): "
                 f"{1e3 * result['forward_seconds_per_batch']:.2f} ms.\n" if measured else '')
      lines += [f'\n{label(name)}:\n{forward}', f'| adapter | ms per batch (all clients) | '
                f'compile s | ÷ {first} | model passes per batch | ÷ {first} per pass |' +
                (' steps + forwards per batch | ÷ measured work |' if measured else ''),
                '|---|---|---|---|---|---|' + ('---|---|' if measured else '')]
      lines += [f"| `{adapter}` | {1e3 * row['seconds_per_batch']:.2f} | "
                f"{row['compile_s']:.1f} | {row['ratio']:.2f} | {row['passes_per_batch']:.3g} | "
                f"{row['ratio_per_pass']:.2f} |" +
                (f" {row['work_per_batch'][0]:.3g} + {row['work_per_batch'][1]:.3g} | "
                 f"{row['ratio_to_work']:.2f} |" if measured else '')
                for adapter, row in result['adapters'].items()]
  kernels = results.get('round', {}).get('kernels')
  if kernels:
    lines += [f"\nDevice kernels of one traced round of (a) ({kernels['kernel_seconds']:.4g} s "
              f"summed; trace {kernels['trace']}):\n", '| kernel | s | calls | share |',
              '|---|---|---|---|']
    lines += [f'| {name[:100]} | {seconds:.4g} | {count} | '
              f"{seconds / max(kernels['kernel_seconds'], 1e-12):.1%} |"
              for name, seconds, count in kernels['top']]
  pairs = [('round', 'loop', '(a)/(b)'), ('round', 'torch', '(a)/(d)'),
           ('round', 'torch_vmap', '(a)/(e)'), ('tta_vmap', 'tta_loop', 'tta vmapped / tta loop'),
           ('seeds_vmap', 'seeds_loop', 'seeds vmapped / seeds one by one'),
           ('grid_vmap', 'grid_loop', 'sweep as one program / runs one by one'),
           ('grid_vmap', 'round', 'sweep as one program / one run'),
           ('alpha_round', 'fedavg_1step', 'α round / FedAvg 1-step round'),
           ('fedtta', 'round', 'FedTTA round / FedAvg round (vmapped)'),
           ('fedtta_loop', 'loop_backend', "FedTTA round / FedAvg round (backend='loop')"),
           ('loop_backend', 'torch', "backend='loop' / (d)"),
           ('processes:2', 'processes:1', '2 processes × 2 devices / 1 process × 4'),
           ('experiment:events', 'experiment:no_events',
            'default experiment with / without event files'),
           ('images:serial', 'images:threads', 'image folder read one file after another / '
            'by the thread pool'),
           ('images:grain', 'images:threads', 'image folder read by grain / by the thread pool')]
  for top, bottom, text in pairs:
    if seconds(results, top) and seconds(results, bottom):
      lines.append(f'\n{text} = {seconds(results, top) / seconds(results, bottom):.2f}')
  lines += [f"\n{label(name)}: {result['images_per_second']:,.0f} images/s"
            for name, result in results.items() if 'images_per_second' in result]
  flops = {name: result['flops'] for name, result in results.items() if 'flops' in result}
  if 'fedtta' in flops and 'round' in flops:   # inherent cost, against the seconds' ratio
    lines.append(f"\nFedTTA / FedAvg in XLA's FLOP counts = {flops['fedtta'] / flops['round']:.2f}")
  return '\n'.join(lines)


def cohort_sweep_table(runs) -> str:
  """One row per (cohort size, convolution) of ``runs`` [(clients, conv, results)]: the
  seconds of (a), (c), (d), (e) and the ratios the GPU targets are stated in."""
  steps = -(-FLAGS.examples // FLAGS.batch_size)
  fmt = lambda value: '—' if value is None else f'{value:.4g}'
  ratio = lambda top, bottom: '—' if not (top and bottom) else f'{top / bottom:.2f}'
  lines = [f'### Cohort sweep: {FLAGS.model}, {FLAGS.examples} examples per client, {steps} '
           f'local steps of batch {FLAGS.batch_size} (s/round, median of {FLAGS.repeats})\n',
           '| clients | conv | (a) round | (a) compile s | (c) fused | (d) torch loop | '
           '(e) torch.func vmap | (a)/(c) | (a)/(d) | (a)/(e) |',
           '|---|---|---|---|---|---|---|---|---|---|']
  for clients, conv, results in runs:
    a = seconds(results, 'round')
    compile_s = results.get('round', {}).get('compile_s')
    lines.append(
        f"| {clients} | {conv} | {fmt(a)} | {'—' if compile_s is None else f'{compile_s:.1f}'} | "
        f"{fmt(seconds(results, 'fused'))} | {fmt(seconds(results, 'torch'))} | "
        f"{fmt(seconds(results, 'torch_vmap'))} | {ratio(a, seconds(results, 'fused'))} | "
        f"{ratio(a, seconds(results, 'torch'))} | {ratio(a, seconds(results, 'torch_vmap'))} |")
  return '\n'.join(lines)


def population_sweep(clients: int, conv: str) -> str:
  """The population sweep at cohort size ``clients`` over populations of distinct real
  examples (launch/benchmarks/sweeps.py ``case_population``), markdown."""
  lines = [f'\nPopulation sweep (FedAvg, cohort {clients}, median of {FLAGS.sweep_repeats}; '
           'store / examples: the store\'s bytes over the examples\' own; sent / cohort: '
           'host→device bytes a round moves over its cohort\'s real examples\' bytes):\n',
           '| population | store | data | examples (median, largest per client) | store MB | '
           'store / examples | sent MB/round | sent / cohort | gathered rows | real / scanned '
           'steps | fallback rounds | s/round (median, best) | first round s | peak RSS GB | '
           'vs smallest (median, best) |',
           '|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|']
  first = {}
  for placement in FLAGS.placements:
    for population in FLAGS.populations:
      result = spawn(f'sweep:{population}:{placement}', clients, conv)
      print('sweep', population, placement, json.dumps(result), flush=True)
      if 'seconds' not in result:
        lines.append(f"| {population} | {placement} | {result.get('error')} |"
                     + ' |' * 12)
        continue
      first.setdefault(placement, (result['seconds'], min(result['times'])))
      sent = result['sent_bytes_per_round']
      lines.append(
          f"| {int(population):,} | {placement} | {result['data']} | {result['examples']:,} "
          f"({result['median_client']:g}, {result['largest_client']}) | "
          f"{result['store_bytes'] / 1e6:.1f} | "
          f"{result['store_bytes'] / result['example_bytes']:.3f} | "
          f"{sent / 1e6:.2f} | "
          f"{(sent / result['cohort_bytes_per_round']) if sent else 0:.2f} | "
          f"{result['gathered_rows']:,} | {result['local_steps']:.0f} / "
          f"{result['scanned_steps']:.0f} | {result['fallback_rounds']}/{result['rounds']} | "
          f"{result['seconds']:.3f}, {min(result['times']):.3f} | {result['compile_s']:.1f} | "
          f"{result['peak_rss_gb']:.2f} | {result['seconds'] / first[placement][0]:.2f}×, "
          f"{min(result['times']) / first[placement][1]:.2f}× |")
  return '\n'.join(lines)


def main(argv):
  del argv
  if FLAGS.case:
    print(json.dumps(run_case(FLAGS.case)))
    return
  check_flags()
  if FLAGS.profiles:
    text = profile_comparison(int(FLAGS.clients[0]), FLAGS.conv[0]) + '\n'
    print('\n' + text)
    if FLAGS.out:
      with open(FLAGS.out, 'w') as f:
        f.write(text)
    return
  steps = -(-FLAGS.examples // FLAGS.batch_size)
  sizes = [int(size) for size in FLAGS.clients]
  sections, runs, torch_results = [], [], {}
  for clients in sizes:
    for conv in FLAGS.conv:
      header = (f'### {FLAGS.model}, {SHAPES[FLAGS.model]} inputs, {clients} clients × '
                f'{FLAGS.examples} examples, {steps} local steps of batch {FLAGS.batch_size}, '
                f'unroll={FLAGS.unroll}, client_chunk={FLAGS.client_chunk}, conv={conv}\n\n'
                f'Machine: {machine()}. Median of {FLAGS.repeats} after one warm-up.\n')
      print(header, flush=True)
      results = {}
      for name in FLAGS.cases:
        if name in TORCH_CASES and (clients, name) in torch_results:
          results[name] = torch_results[(clients, name)]   # the same run for every conv
          continue
        results[name] = spawn(name, clients, conv)
        print(name, json.dumps(results[name]), flush=True)
        if name in TORCH_CASES:
          torch_results[(clients, name)] = results[name]
      sections.append(header + '\n' + case_table(results))
      runs.append((clients, conv, results))
  text = '\n\n'.join(sections) + '\n'
  if len(runs) > 1:
    text += '\n' + cohort_sweep_table(runs) + '\n'
  if FLAGS.populations and FLAGS.populations != ['']:
    text += population_sweep(sizes[0], FLAGS.conv[0]) + '\n'
  print('\n' + text)
  if FLAGS.out:
    with open(FLAGS.out, 'w') as f:
      f.write(text)


if __name__ == '__main__':
  define_flags()
  app.run(main)
