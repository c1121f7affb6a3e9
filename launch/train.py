"""Runs an experiment from an ml_collections config.

    python launch/train.py --config=configs/fedavg.py:mnist_dir0.1 --workdir=/tmp/run \
        --config.rounds=50 --config.seeds='(0,1,2)'

Any config field can be overridden with --config.<field>=<value>. Re-running the
same command resumes from the checkpoints in --workdir. SIGTERM or SIGUSR1 (a
scheduler's warning before it kills the job) stops training at the end of the current
round with a checkpoint and exits with status 143; re-running resumes from there. ``config.pipeline`` picks the
run loop from ``fedjax_shift.pipelines.PIPELINES``; every pipeline's results print
the same way.
"""
import logging
import os
import signal
import sys
from typing import Optional, Tuple


def stop_outside_the_run(number, frame) -> None:
  """A signal before the run starts (importing, parsing the config) or after it ends:
  nothing to save, so the process ends at once (130 for Ctrl-C, 143 otherwise). Without
  it a Ctrl-C while ``import jax`` runs can be swallowed by the import (the run then
  goes on) or surface as an ImportError."""
  os.write(2, f'launch/train.py: {signal.Signals(number).name} received outside the run '
              f'(starting, or its results written): nothing to save; stopped\n'.encode())
  os._exit(130 if number == signal.SIGINT else 143)


# Ctrl-C and the preempt signals: stopped outside the run, forwarded by ``supervise``.
STOP_SIGNALS = ('SIGINT', 'SIGTERM', 'SIGUSR1')

if __name__ == '__main__':   # before the imports below; the run's own handling replaces it
  for _name in STOP_SIGNALS:
    signal.signal(getattr(signal, _name), stop_outside_the_run)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
from absl import app, flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

import ml_collections  # noqa: E402

from fedjax_shift import checkpoint, distributed, metrics, pipelines  # noqa: E402
from fedjax_shift.data import sources  # noqa: E402
from fedjax_shift.algorithms import ALGORITHMS  # noqa: E402
from fedjax_shift.core.test_time import ADAPTERS  # noqa: E402
from fedjax_shift.pipelines import loop, sweep  # noqa: E402
from fedjax_shift.pipelines.workdir import WorkdirBusyError  # noqa: E402

# The exit status of a run stopped by SIGTERM / SIGUSR1 after checkpointing (128 + 15, as a
# shell reports a SIGTERM'd job): a scheduler sees a failure and re-queues the command.
PREEMPTED_STATUS = 143
# The exit status after Ctrl-C (128 + SIGINT's 2, as a shell reports it).
INTERRUPTED_STATUS = 130
# The exit status of a config, flag or workdir the run refuses (as command-line tools
# report a usage error); other errors a user mends (disk, memory) exit with 1.
USAGE_STATUS = 2

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file[:variant].')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints, metrics, results.')
_DISTRIBUTED = flags.DEFINE_bool('distributed', False,
                                 'Call jax.distributed.initialize() first (multi-host runs).')
_COORDINATOR = flags.DEFINE_string('coordinator', None, 'HOST:PORT of process 0 (multi-host).')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Number of hosts (multi-host).')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, 'This host\'s index (multi-host).')
_INIT_TIMEOUT = flags.DEFINE_integer(
    'initialization_timeout', 300, 'Seconds a process of a multi-host run waits for the '
    'coordinator (process 0) before it stops naming the address.')
_HEARTBEAT = flags.DEFINE_integer(
    'heartbeat_timeout', 100, 'Seconds without a heartbeat after which the processes of a '
    'multi-host run stop, naming the lost one (JAX\'s coordination service).')
_COMPILATION_CACHE = flags.DEFINE_string(
    'compilation_cache', '~/.cache/fedjax_shift/jax',
    "JAX's persistent compilation cache: a re-run, a resumed run or another seed with the "
    "same shapes reuses compiled programs ('' turns it off).")
flags.mark_flags_as_required(['config', 'workdir'])

# Mistakes a user mends (a config value, a workdir, a file, the disk, the memory, an
# optional extra not installed): printed as the library's one-paragraph message, without
# a traceback, unless FEDJAX_SHIFT_TRACEBACK=1.
USER_ERRORS = (ValueError, OSError, MemoryError, WorkdirBusyError, pipelines.PrimaryRefused,
               sources.MissingExtra)
TRACEBACK_VARIABLE = 'FEDJAX_SHIFT_TRACEBACK'
# Of those, the refusals (exit status USAGE_STATUS): a config value, a workdir another
# run holds or that cannot be written, a full disk, a missing file, folder or extra; the
# rest (out of memory, other I/O failures) exit 1.
REFUSED = (ValueError, WorkdirBusyError, checkpoint.DiskFullError, FileNotFoundError,
           NotADirectoryError, PermissionError, pipelines.PrimaryRefused, sources.MissingExtra)


def train(config: ml_collections.ConfigDict, workdir: str) -> pipelines.Results:
  """Runs ``config.pipeline`` in ``workdir`` and prints its results."""
  results = pipelines.run(config, workdir)
  if jax.process_index() == 0:   # process 0 reports (fedjax_shift/distributed.py)
    print(pipelines.format_results(results, workdir))
  return results


# Set in the environment of the process ``supervise`` starts.
SUPERVISED = 'FEDJAX_SHIFT_SUPERVISED_PROCESS'


def supervise() -> int:
  """Runs this command again as a child process and stands by it (a process of a
  multi-host run): when JAX's distributed runtime aborts it (SIGABRT, after a C++
  stack: another process lost, the run's processes never gathered, the coordinator
  gone), this process prints one message naming the cause and the resume command
  instead, and exits 1. Signals sent to this process go to the child; the child dies
  with it (a ``kill -9`` of this process stops the run as it would stop it alone)."""
  import collections
  import ctypes
  import subprocess

  def die_with_parent():
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG

  child = subprocess.Popen([sys.executable] + sys.argv, env={**os.environ, SUPERVISED: '1'},
                           stderr=subprocess.PIPE, text=True, errors='replace', bufsize=1,
                           start_new_session=True, preexec_fn=die_with_parent)
  for name in STOP_SIGNALS:
    signal.signal(getattr(signal, name), lambda number, frame: child.send_signal(number))
  last_lines, aborting = collections.deque(maxlen=200), False
  dumping_threads = False
  for line in child.stderr:
    # the runtime's error spans several lines before its abort; Python's dump of its
    # threads after SIGABRT says nothing of the cause
    dumping_threads = dumping_threads or line.startswith(distributed.PYTHON_ABORT_DUMP)
    if not dumping_threads:
      last_lines.append(line)
    aborting = aborting or distributed.runtime_abort_begins(line)
    if not aborting:   # the runtime's fatal error and the stacks after it: summarised below
      sys.stderr.write(line)
      sys.stderr.flush()
  status = child.wait()
  if status in (-signal.SIGABRT, 128 + signal.SIGABRT):
    cause = distributed.runtime_stop_cause(
        ''.join(last_lines), _PROCESS_ID.value, _NUM_PROCESSES.value, _COORDINATOR.value,
        _HEARTBEAT.value, _INIT_TIMEOUT.value)
    print(f'launch/train.py: process {_PROCESS_ID.value if _PROCESS_ID.value is not None else "?"}'
          f': stopped by JAX\'s distributed runtime: {cause}. The workdir keeps the '
          f'checkpoints saved so far: run every process again with the same command to '
          f'resume.', file=sys.stderr, flush=True)
    return 1
  return status if status >= 0 else 128 - status


def main(argv):
  if len(argv) > 1:   # e.g. an unquoted --workdir with a space: its second word lands here
    print(f'launch/train.py: unexpected words on the command line: {argv[1:]}; every '
          f'argument is a --flag=value (quote a value holding a space)', file=sys.stderr)
    sys.exit(USAGE_STATUS)
  config = _CONFIG.value
  problem = entries_for_methods_not_run(config, sys.argv) or other_benchmark_flags(config,
                                                                                   sys.argv)
  if problem:
    print(f'launch/train.py: {problem}', file=sys.stderr)
    sys.exit(USAGE_STATUS)
  if config.engine.deterministic:
    # XLA's deterministic GPU ops: read when the backend starts, i.e. before any array is
    # made; on CPU XLA is deterministic already and this is a no-op.
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                               ' --xla_gpu_deterministic_ops=true').strip()
  if _DISTRIBUTED.value and not os.environ.get(SUPERVISED):
    sys.exit(supervise())
  if _DISTRIBUTED.value and _COORDINATOR.value and _PROCESS_ID.value == 0:
    problem = distributed.coordinator_port_problem(_COORDINATOR.value)   # process 0 serves it
    if problem:
      print(f'launch/train.py: --distributed: {problem}', file=sys.stderr)
      sys.exit(USAGE_STATUS)
  if _DISTRIBUTED.value:
    # CPU devices of several processes talk through Gloo (GPUs and TPUs bring their own
    # collectives; the setting only concerns the CPU backend).
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    # Named first: an unreachable coordinator makes JAX's runtime abort the process
    # after the timeout, with its own error below this line.
    print(f'launch/train.py: process {_PROCESS_ID.value} joining the run at coordinator '
          f'{_COORDINATOR.value or "(found by JAX from the cluster environment)"} '
          f'(--initialization_timeout={_INIT_TIMEOUT.value}s)', file=sys.stderr, flush=True)
    if _COORDINATOR.value and _PROCESS_ID.value:
      # JAX's runtime aborts the process (SIGABRT) when the coordinator never answers;
      # a process other than 0 (which serves it) first waits for its port to open.
      problem = distributed.wait_for_coordinator(_COORDINATOR.value, _INIT_TIMEOUT.value)
      if problem:
        sys.exit(f'launch/train.py: --distributed: could not reach the coordinator '
                 f'{_COORDINATOR.value} (process 0) within --initialization_timeout='
                 f'{_INIT_TIMEOUT.value}s ({problem}): start process 0 with the same '
                 f'--coordinator, or check the address and the network between the hosts')
    try:
      jax.distributed.initialize(coordinator_address=_COORDINATOR.value,
                                 num_processes=_NUM_PROCESSES.value,
                                 process_id=_PROCESS_ID.value,
                                 initialization_timeout=_INIT_TIMEOUT.value,
                                 heartbeat_timeout_seconds=_HEARTBEAT.value)
    except Exception as err:   # an unreachable coordinator, a wrong process count
      sys.exit(f'launch/train.py: --distributed: could not join the run at coordinator '
               f'{_COORDINATOR.value or "(found by JAX from the cluster environment)"} '
               f'within --initialization_timeout={_INIT_TIMEOUT.value}s: '
               f'{str(err).splitlines()[0][:300]}')
  absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every save at INFO
  handler = logging.StreamHandler()
  handler.setFormatter(logging.Formatter('%(asctime)s %(message)s'))
  log = logging.getLogger('fedjax_shift')
  log.addHandler(handler)
  log.setLevel(logging.INFO)
  log.propagate = False
  if _DISTRIBUTED.value:
    if jax.process_index() > 0:   # process 0 reports progress and writes the workdir
      log.setLevel(logging.WARNING)
      config.progress = False
  if _COMPILATION_CACHE.value:
    jax.config.update('jax_compilation_cache_dir', os.path.expanduser(_COMPILATION_CACHE.value))
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  try:
    with loop.PromptStop('launch/train.py'):   # a signal while compiling stops at once
      train(config, _WORKDIR.value)
  except loop.Preempted as stopped:
    log.warning('%s', stopped)
    sys.exit(PREEMPTED_STATUS)
  except KeyboardInterrupt as stopped:
    print(f'launch/train.py: {stopped or "interrupted before training started: nothing to save"}'
          f'; run the same command again to resume', file=sys.stderr)
    sys.exit(INTERRUPTED_STATUS)
  except USER_ERRORS as err:
    if os.environ.get(TRACEBACK_VARIABLE) == '1':
      raise
    full = (' The disk is full: free space (a re-run with a lower --config.keep_checkpoints '
            'deletes the older checkpoints first) or pass another --workdir, then re-run the '
            'same command to resume.' if checkpoint.is_disk_full(err) and
            not isinstance(err, checkpoint.DiskFullError) else '')
    print(f'launch/train.py: {type(err).__name__}: {err}{full}\n(the traceback: re-run '
          f'with {TRACEBACK_VARIABLE}=1)', file=sys.stderr)
    sys.exit(USAGE_STATUS if isinstance(err, REFUSED) else 1)
  except jax.errors.JaxRuntimeError as err:
    if jax.process_count() == 1:
      raise
    # A collective whose peer is gone fails at once; a process that is waiting
    # elsewhere is stopped by the coordination service after --heartbeat_timeout.
    lost = distributed.lost_processes(_HEARTBEAT.value + 10)
    log.error('process %d of %d: a collective with the other processes failed (%s): '
              '%s stopped (its log says why). Re-run every process with the same command to '
              'resume from the last checkpoint.', jax.process_index(), jax.process_count(),
              str(err).splitlines()[0][:300],
              f'process {", ".join(map(str, lost))} of this run' if lost else
              'another process of this run')
    os._exit(1)   # the runtime's shutdown would wait for the lost process


# The fields each method's section had for its own client rate and batch, and the
# config.client fields that config.client_overrides.<method> now sets in their place.
RENAMED_CLIENT_FIELDS = {recorded: field for field, (recorded, _)
                         in metrics.RECORDED_OVERRIDES.items()}


def file_config(argv) -> Optional[ml_collections.ConfigDict]:
  """The config ``--config=<file>[:<variant>]`` of ``argv`` builds, without the
  ``--config.<field>`` flags; None when it does not load (flag parsing says why)."""
  import importlib.util
  spec = next((a.split('=', 1)[1] for a in argv if a.startswith('--config=')), '')
  path, _, variant = spec.partition(':')
  try:
    loader = importlib.util.spec_from_file_location('fedjax_shift_launched_config', path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return module.get_config(variant) if variant else module.get_config()
  except Exception:   # noqa: BLE001  flag parsing reports a config that does not load
    return None


def entries_for_methods_not_run(config: ml_collections.ConfigDict, argv) -> str:
  """Why entries the flags of ``argv`` give ``config.client_overrides`` or
  ``config.sweep_metric`` for a method ``config.algorithms`` does not run would go
  unused ('' when there are none; entries of the config file itself are let be: a
  paper's config carries them for the rows a shorter list of methods leaves out)."""
  if config.pipeline != 'federated':
    return ''
  given = file_config(argv)
  own = sweep.method_entries(given) if given is not None else {}
  flagged = [path for path, entry in sweep.entries_not_run(config).items()
             if own.get(path, None) != entry]
  if not flagged:
    return ''
  return (f'{", ".join("config." + path for path in flagged)}: config.algorithms '
          f'{list(config.algorithms)} does not run '
          f'{", ".join(sorted({path.split(".")[1] for path in flagged}))}, so the entry '
          f'would go unused; add the method to --config.algorithms or drop the entry')


def other_benchmark_flags(config: ml_collections.ConfigDict, argv) -> str:
  """Why a ``--config.data.<benchmark>.<field>`` flag of ``argv`` would go unused: it sets
  a section of a benchmark other than the run's ``config.data.benchmark`` ('' when none
  does)."""
  from fedjax_shift.benchmarks import BENCHMARKS
  for arg in argv:
    parts = arg[len('--config.'):].split('=', 1)[0].split('.')
    if (arg.startswith('--config.data.') and len(parts) > 2 and parts[1] in BENCHMARKS and
        parts[1] != config.data.benchmark):
      return (f'{arg.split("=", 1)[0][2:]}: the run\'s benchmark is config.data.benchmark='
              f'{config.data.benchmark!r}, which does not read config.data.{parts[1]}; set '
              f'--config.data.benchmark={parts[1]} or drop the flag')
  return ''


def moved_data_field(field: str, config: ml_collections.ConfigDict) -> str:
  """Where ``--config.data.<field>`` lives when it is a benchmark's own field
  (``config.data.<benchmark>.<field>``), the run's benchmark first; '' otherwise."""
  from fedjax_shift.benchmarks import sections_with
  owners = sections_with(field, config.data.benchmark)
  if not owners:
    return ''
  return (f'--config.data.{field}: {field!r} is a benchmark\'s own field, in its section: '
          + ' or '.join(f'--config.data.{name}.{field}' for name in owners) +
          f' (the run\'s benchmark: {config.data.benchmark!r})')


def unknown_override(argv) -> str:
  """Why a ``--config.<field>=<value>`` of ``argv`` names no field of the config that
  ``--config=<file>[:<variant>]`` builds ('' when each one does, or the file does not
  load: flag parsing then says why), with the field's near names."""
  import difflib
  config = file_config(argv)
  if config is None:
    return ''
  for arg in argv:
    if not arg.startswith('--config.'):
      continue
    field = arg[len('--config.'):].split('=', 1)[0]
    *section, leaf = field.split('.')
    if leaf in RENAMED_CLIENT_FIELDS and section:   # a method's own rate or batch as it was
      renamed, method = RENAMED_CLIENT_FIELDS[leaf], section[0]
      return (f'--config.{field}: a method\'s own client {renamed.replace("_", " ")} is '
              f'config.client_overrides.{method}.{renamed}, e.g. --config.client_overrides='
              f'"{{\'{method}\': {{\'{renamed}\': …}}}}"')
    node, walked = config, []
    parts = field.split('.')
    if len(parts) == 2 and parts[0] == 'data' and parts[1] not in config.data:
      moved = moved_data_field(parts[1], config)
      if moved:
        return moved
    if (len(parts) == 3 and parts[0] == 'client_overrides' and
        parts[1] not in config.client_overrides):   # a method without an override yet
      merged = config.client_overrides.to_dict()
      merged[parts[1]] = {parts[2]: override_value(arg.split('=', 1)[1] if '=' in arg else '')}
      return (f'--config.{field}: config.client_overrides has no section {parts[1]!r} in '
              f'this config to set a field of; give the method\'s overrides as a dict (with '
              f'the config\'s others): --config.client_overrides="{merged!r}"')
    for part in parts:
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        known = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
        near = difflib.get_close_matches(part, known, n=3, cutoff=0.5)
        where = 'config.' + '.'.join(walked) if walked else 'the config'
        return (f'--config.{field}: {where} has no field {part!r}' +
                (f'; did you mean {", ".join(near)}?' if near else
                 f'; its fields: {", ".join(known)}' if known else
                 f' ({where} is a value, not a section)'))
      node = node[part]
      walked.append(part)
  return ''


def override_value(text: str):
  """A flag's value as Python reads it ('0.3' -> 0.3), else the text itself."""
  import ast
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def variant_field_flags(argv) -> Tuple[list, list]:
  """(``argv`` without its ``--config.<variant>.<field>=<value>`` flags for a field the
  variant follows from its method's section, those flags' ([path], value)): a
  variant's section holds only what it changes (``Registry.register(variant_of=)``),
  so absl has no flag for the others; they are set after parsing."""
  kept, later = [], []
  for arg in argv:
    flag, equals, text = arg.partition('=')
    path = flag[len('--config.'):].split('.') if flag.startswith('--config.') else []
    registry, entry = (ADAPTERS, path[1:]) if path[:1] == ['adapters'] else (ALGORITHMS, path)
    if (equals and len(entry) == 2 and entry[0] in registry and registry.variant_of(entry[0])
        and entry[1] in registry.defaults(entry[0])):
      later.append((path, override_value(text)))
    else:
      kept.append(arg)
  return kept, later


def set_variant_fields(config: ml_collections.ConfigDict, fields) -> None:
  """Sets the ``variant_field_flags`` fields on ``config``; a value of another type than
  the field's default is refused (exit 2), as absl refuses it for other fields."""
  for path, value in fields:
    *sections, field = path
    section = config
    for name in sections:
      section = section[name]
    registry = ADAPTERS if sections[0] == 'adapters' else ALGORITHMS
    default = registry.defaults(sections[-1])[field]
    if not (type(value) is type(default) or (isinstance(default, float) and
                                             type(value) is int)):
      print(f'launch/train.py: --config.{".".join(path)}: expected a value of type '
            f'{type(default).__name__} (as config.{".".join(path)}\'s default '
            f'{default!r}), got {value!r}', file=sys.stderr)
      sys.exit(USAGE_STATUS)
    with section.unlocked():   # config_flags locks the config it built
      section[field] = float(value) if isinstance(default, float) else value


def parse_flags(argv):
  """absl's flag parsing, a mistyped --config.<field> one line naming it;
  ``--config.sweep`` and ``--config.sweep_metric`` also read in their string form; a
  variant's field it follows from its method set too (``variant_field_flags``)."""
  try:
    argv = [sweep.legacy_flag(arg) for arg in argv]
  except ValueError as err:   # e.g. a sweep field given as a section and dotted
    print(f'launch/train.py: {err}', file=sys.stderr)
    sys.exit(USAGE_STATUS)
  for arg in argv:
    flag, _, value = arg.partition('=')
    if flag == '--config.seeds' and value.strip().isdigit():
      print(f'launch/train.py: --config.seeds={value} would run seed {value} alone: '
            f'config.seeds is the tuple of seeds to run, e.g. --config.seeds="(0, 1, 2)" '
            f'for three, --config.seeds="({value},)" for seed {value} alone', file=sys.stderr)
      sys.exit(USAGE_STATUS)
  argv, variant_fields = variant_field_flags(argv)
  sys.argv[:] = argv   # config_flags reads its overrides' names from sys.argv
  try:
    rest = flags.FLAGS(argv)
    set_variant_fields(_CONFIG.value, variant_fields)
    return rest
  except (AttributeError, KeyError) as err:
    problem = unknown_override(argv)
    if problem:
      print(f'launch/train.py: {problem}', file=sys.stderr)
      sys.exit(USAGE_STATUS)
    raise err
  except flags.Error as err:
    refused = config_file_error(str(err))
    print(f'launch/train.py: {refused}' if refused else
          f'launch/train.py: {err}\nPass --helpfull to see the flags.', file=sys.stderr)
    sys.exit(USAGE_STATUS)


def config_file_error(text: str) -> str:
  """Where absl's message ``text`` says ``--config``'s file refused its variant or a
  value (the library's one-line ValueError), that flag and line alone, without the
  traceback config_flags wraps it in; '' for any other error (a config file's own bug
  keeps its traceback)."""
  lines = [line for line in text.splitlines() if line.strip()]
  header = 'Error whilst parsing config file'
  if lines and header in lines[0] and lines[-1].startswith('ValueError: '):
    flag = lines[0].split(': ' + header)[0]
    return f'{flag[len("flag "):] if flag.startswith("flag ") else flag}: ' \
        f'{lines[-1][len("ValueError: "):]}'
  return ''


if __name__ == '__main__':
  app.run(main, flags_parser=parse_flags)
