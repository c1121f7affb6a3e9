"""The run loop every training pipeline shares: R runs of one method trained in
lockstep, each with its own run directory, checkpoints, metrics and evaluation.

The runs share one state pytree whose layout the caller chooses through a
``Trainer``: one run holds its state as it is (``take`` is the identity); runs trained
as one program hold theirs stacked on a leading run axis (``take`` slices run i out),
e.g. the federated pipeline's vmapped seeds. The loop knows nothing of that axis'
meaning (seeds today; hyperparameter values fit the same axis).

The loop owns, once for every pipeline: the progress bar, the rounds per call, the
divergence check (a non-finite loss stops the pipeline, or, when the caller keeps
going, marks that run diverged while the others go on), the metrics.jsonl records,
the evaluation rounds, the checkpoints (periodic, last round, Ctrl-C) and the final
evaluation of a run resumed after its last round. Besides the method's metrics, a
record holds ``round_seconds``, ``examples_per_second`` (when the trainer knows its
examples per step) and, in the first record of a call that compiled,
``compile_seconds`` (JAX's tracing, lowering and compilation during that call).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import monitoring

from fedjax_shift import distributed
from fedjax_shift.checkpoint import RunState
from fedjax_shift.core.round import memory_error
from fedjax_shift.pipelines import callbacks as callbacks_lib
from fedjax_shift.pipelines.workdir import WorkdirLock

log = logging.getLogger('fedjax_shift')


class DivergenceError(FloatingPointError):
  """Training produced a non-finite loss."""


# Written in a run's directory when its loss turns non-finite and the others go on
# (``keep_going``): {'round': the round, 'error': the message, 'fingerprint': the
# run's fingerprint from its run.json}.
DIVERGED_FILE = 'diverged.json'


def run_fingerprint(run_dir: str) -> Optional[str]:
  """The fingerprint ``run_dir``'s run.json records (None: no run.json)."""
  path = os.path.join(run_dir, 'run.json')
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f).get('fingerprint')


def record_divergence(run_dir: str, round_index: int, error: DivergenceError) -> None:
  record = {'round': round_index, 'error': str(error), 'fingerprint': run_fingerprint(run_dir)}
  with distributed.open_output(os.path.join(run_dir, DIVERGED_FILE)) as f:
    json.dump(record, f, indent=1)


class Preempted(Exception):
  """SIGTERM or SIGUSR1 (what SLURM, Kubernetes and preemptible VMs send before a kill)
  stopped training after a round whose checkpoints were saved; re-running the same
  command resumes from them."""


class Interrupted(KeyboardInterrupt):
  """Ctrl-C stopped training; the message says which round was saved (or that none had
  been trained)."""


# The signals that stop training at the end of the current round, checkpointed.
PREEMPT_SIGNALS = ('SIGTERM', 'SIGUSR1')


@contextlib.contextmanager
def stop_requests():
  """Yields a list that collects the names of PREEMPT_SIGNALS received while inside
  (their previous handlers restored on exit). Signals can only be caught on the main
  thread; elsewhere the list stays empty and the default handling applies."""
  received: List[str] = []
  if threading.current_thread() is not threading.main_thread():
    yield received
    return
  previous = {}
  for name in PREEMPT_SIGNALS:
    number = getattr(signal, name, None)
    if number is not None:
      previous[number] = signal.signal(number, lambda sig, frame: received.append(
          signal.Signals(sig).name))
  try:
    yield received
  finally:
    for number, handler in previous.items():
      signal.signal(number, handler)


class PromptStop:
  """Stops the process at once on SIGINT, SIGTERM or SIGUSR1 received while no round
  it trained waits to be checkpointed: while it builds the data or compiles (XLA holds
  the interpreter for as long as a compilation takes, so a Python handler would run only
  after it), and between a round's checkpoint and the next round's end. It prints why,
  lets go of the workdir locks this process holds and exits with status 130 (Ctrl-C) or
  143 (a preempt signal, as after a checkpointed stop). While trained rounds are unsaved, the loop's handling applies: a
  preempt signal stops after the round with a checkpoint, Ctrl-C saves and stops.

  The command line's (``launch/train.py``) around a whole run: the signal is seen by a
  thread of its own through ``signal.set_wakeup_fd``, written by the interpreter's C
  handler whatever the main thread does. From Python (a notebook) nothing changes.
  """
  active: Optional['PromptStop'] = None   # signals belong to the process: one at a time
  SIGNALS = ('SIGINT',) + PREEMPT_SIGNALS

  def __init__(self, program: str):
    self.program = program
    self.unsaved = False   # set by ``train``: rounds trained since the last checkpoint
    self._previous: Dict[int, Any] = {}

  def __enter__(self) -> 'PromptStop':
    if threading.current_thread() is not threading.main_thread():
      return self
    import socket
    self._reader, self._writer = socket.socketpair()
    self._writer.setblocking(False)
    self._previous_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
    self._numbers = {getattr(signal, name) for name in self.SIGNALS if hasattr(signal, name)}
    for number in self._numbers:
      self._previous[number] = signal.signal(number, self._on_main_thread)
    self._watcher = threading.Thread(target=self._watch, name='prompt-stop', daemon=True)
    self._watcher.start()
    PromptStop.active = self
    return self

  def _on_main_thread(self, number, frame) -> None:
    # The interpreter's handler, run between two bytecodes of the main thread: Ctrl-C
    # with rounds unsaved is KeyboardInterrupt (the loop saves them); everything else
    # is the watcher's.
    if number == signal.SIGINT and self.unsaved:
      raise KeyboardInterrupt

  def _watch(self) -> None:
    while True:
      try:
        received = self._reader.recv(64)
      except OSError:
        return
      if not received:
        return
      for number in received:
        if number in self._numbers and not self.unsaved:
          self._stop(number)

  def _stop(self, number: int) -> None:
    name = signal.Signals(number).name
    print(f'{self.program}: {name} received while no trained round was waiting to be '
          f'checkpointed (building the data, compiling, or just after a checkpoint): '
          f'stopped at once. Run the same command again to go on from the last checkpoint '
          f'in the workdir (from the start where there is none)', file=sys.stderr, flush=True)
    WorkdirLock.release_held()
    # The statuses of the stops the loop makes itself (launch/train.py): 130 for Ctrl-C,
    # 143 for a preempt signal. os._exit: the main thread may be inside XLA.
    os._exit(130 if number == signal.SIGINT else 143)

  def __exit__(self, *exc) -> None:
    if PromptStop.active is not self:
      return
    PromptStop.active = None
    for number, handler in self._previous.items():
      signal.signal(number, handler)
    signal.set_wakeup_fd(self._previous_fd)
    self._writer.close()
    self._reader.shutdown(2)
    self._watcher.join()
    self._reader.close()


def mark_unsaved(unsaved: bool) -> None:
  """Tells the command line's ``PromptStop`` (when there is one) whether rounds trained
  since the last checkpoint wait to be saved."""
  if PromptStop.active is not None:
    PromptStop.active.unsaved = unsaved


class Run(NamedTuple):
  """One run's own side of the loop.

  Attributes:
    label: names the run in messages ('fedavg seed 0').
    run_dir: its directory (checkpoints/, metrics.jsonl).
    checkpointer: its ``checkpoint.Checkpointer``.
    writer: its ``metrics.MetricsWriter``; None when no round is left to train.
    start_round: rounds already trained (restored from its checkpoint).
    elapsed: training seconds so far.
    evaluate: (the run's state) -> flat metrics {'<model>/<split>/<metric>': value}.
    log_state: (the run's state) -> extra fields of every record written at the end
      of a call (ATP: α per module); None for none.
  """
  label: str
  run_dir: str
  checkpointer: Any
  writer: Any
  start_round: int
  elapsed: float
  evaluate: Callable[[Any], Dict[str, float]]
  log_state: Optional[Callable[[Any], Dict[str, float]]] = None


class Trainer(NamedTuple):
  """How the loop advances the state of every run.

  Attributes:
    advance: (state, start, stop) -> (state after round ``stop``, per-round metrics
      {name: [stop − start, R] array}, 'loss' first); one compiled call.
    take: (state, i) -> run i's (server state, client states), checkpointed with its
      seconds as a ``checkpoint.RunState``.
    rounds_per_call: rounds one call may train (it stops early at an evaluation round
      and the last round).
    examples_per_step: examples one client step reads times the cohort (progress only;
      0 when the metrics have no 'num_steps').
  """
  advance: Callable[[Any, int, int], Tuple[Any, Dict[str, np.ndarray]]]
  take: Callable[[Any, int], tuple]
  rounds_per_call: int = 1
  examples_per_step: int = 0


ROUND_METRICS = ('loss', 'num_steps', 'local_steps', 'scanned_steps', 'fallback_plan')


def round_metric_names(metrics: Dict[str, Any]) -> Tuple[str, ...]:
  """The round metrics the loop records, of those a round's output has: the weighted
  mean 'loss' and 'num_steps' of the cohort, and the round's real ('local_steps') and
  iterated ('scanned_steps', padding included) local steps summed over the cohort, and
  with a fallback plan whether the cohort ran at it ('fallback_plan')."""
  return tuple(name for name in ROUND_METRICS if name in metrics)


def one_round(metrics: Dict[str, Any], names: Sequence[str]) -> Dict[str, np.ndarray]:
  """``Trainer.advance``'s metrics of a call that trained one round: each of ``names``
  from a round's output metrics (a scalar for one run, [R] for runs on a leading run
  axis) as a [1, R] float32 array."""
  return {name: np.reshape(np.asarray(metrics[name], np.float32), (1, -1)) for name in names}


def only_run(state, index: int):
  """``Trainer.take`` of a single run: its state is the whole state."""
  del index
  return state


class CompileSeconds:
  """Seconds JAX spends tracing, lowering and compiling (its '/jax/core/compile/'
  duration events) while it is open; ``take()`` returns the sum since the last take."""

  def __init__(self):
    self.total = 0.0
    monitoring.register_event_duration_secs_listener(self._add)

  def _add(self, event: str, seconds: float, **kwargs) -> None:
    del kwargs
    if event.startswith('/jax/core/compile/'):
      self.total += seconds

  def take(self) -> float:
    seconds, self.total = self.total, 0.0
    return seconds

  def close(self) -> None:
    monitoring.unregister_event_duration_listener(self._add)


class Outcome(NamedTuple):
  """What the loop leaves of one run."""
  summary: Dict[str, float]         # the last evaluation's metrics ({} when diverged)
  elapsed: float                    # training seconds
  state: Any                        # the run's final state (``Trainer.take``)
  diverged: Optional[DivergenceError] = None
  stopped: Optional[Dict[str, Any]] = None   # a callback's stop: {'round', 'reason'}


def call_end(start: int, rounds: int, rounds_per_call: int, eval_every: int) -> int:
  """The round after which the call starting at ``start`` stops: a multiple of
  ``rounds_per_call``, an evaluation round or the last round, whichever comes first."""
  if rounds_per_call == 1:
    return start + 1
  return min(rounds, (start // rounds_per_call + 1) * rounds_per_call,
             (start // eval_every + 1) * eval_every)


def _divergence(run: Run, loss: float, round_index: int) -> DivergenceError:
  kept = run.checkpointer.latest_round()
  return DivergenceError(
      f'{run.label}: non-finite training loss ({loss}) in round {round_index}; ' +
      (f'the last good checkpoint (round {kept}) is kept in {run.run_dir}'
       if kept is not None else 'no checkpoint was saved before it'))


class Progress:
  """The round counter a person reads. On a terminal, tqdm's bar; without one (a job's
  log file, a pipe) a plain log line every ``log_every`` rounds — 0: about a tenth of
  the run, at most one a second — and one at the end, with the bar's fields and the ETA
  (from the seconds per round without compilation: a first call's compile time is not
  charged to every round left). ``terminal`` None: whether stderr is a terminal."""

  def __init__(self, total: int, initial: int, description: str, log_every: int = 0,
               terminal: Optional[bool] = None):
    self.total, self.done, self.description = total, initial, description
    self.terminal = sys.stderr.isatty() if terminal is None else terminal
    self.bar = None
    if self.terminal:
      from tqdm import tqdm
      self.bar = tqdm(total=total, initial=initial, unit='round', desc=description, leave=False)
    self.every = log_every or max(1, -(-total // 10))
    self.min_seconds = 0.0 if log_every else 1.0
    self.next = (initial // self.every + 1) * self.every
    self.start, self.start_round, self.last = time.perf_counter(), initial, -float('inf')
    self.compiling = 0.0

  def update(self, count: int, fields: Dict[str, str], compile_seconds: float = 0.0) -> None:
    """``count`` more rounds done, ``compile_seconds`` of their time compiling; ``fields``
    (e.g. loss, examples_per_s) to show."""
    self.done += count
    self.compiling += compile_seconds
    if self.bar is not None:
      self.bar.update(count)
      self.bar.set_postfix(**fields)
      return
    now = time.perf_counter()
    if self.done < self.total and (self.done < self.next or now - self.last < self.min_seconds):
      return
    seconds_per_round = (now - self.start - self.compiling) / max(self.done - self.start_round, 1)
    eta = seconds_per_round * (self.total - self.done)
    log.info('%s: round %d/%d, %s, %.2f s/round, ETA %s', self.description, self.done,
             self.total, ', '.join(f'{k} {v}' for k, v in fields.items()), seconds_per_round,
             time.strftime('%H:%M:%S', time.gmtime(eta)))
    self.last = now
    self.next = (self.done // self.every + 1) * self.every

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()


class Cadence(NamedTuple):
  """How far and how often the loop goes: ``rounds`` (the target), an evaluation every
  ``eval_every`` rounds and at the last, a checkpoint every ``checkpoint_every``;
  ``keep_going``: a run whose loss turns non-finite is marked diverged (its Outcome
  carries the error) and the others go on, else the DivergenceError is raised;
  ``progress``: show ``Progress`` (a line every ``log_every`` rounds off a terminal);
  ``callbacks``: ``callbacks.Callback``s; ``extend``: a run a callback stopped early
  trains on (``config.resume='extend'``) instead of staying stopped."""
  rounds: int
  eval_every: int
  checkpoint_every: int
  keep_going: bool = False
  progress: bool = True
  log_every: int = 0
  callbacks: Tuple[callbacks_lib.Callback, ...] = ()
  extend: bool = False

  @classmethod
  def of(cls, config, keep_going: Optional[bool] = None) -> 'Cadence':
    """The run config's (``keep_going`` None: ``config.on_divergence == 'continue'``),
    with its callbacks and those given from Python (``callbacks.for_config``)."""
    return cls(config.rounds, config.eval_every, config.checkpoint_every,
               config.on_divergence == 'continue' if keep_going is None else keep_going,
               config.progress, config.log_every, callbacks_lib.for_config(config),
               config.resume == 'extend')


def _advance(trainer: Trainer, state, start: int, stop: int):
  """One compiled call, its metrics read back: the call is dispatched asynchronously, so
  its errors (out of memory: one message naming the fields to lower) arrive here."""
  try:
    state, metrics = trainer.advance(state, start, stop)
    return state, {name: np.asarray(values) for name, values in metrics.items()}
  except jax.errors.JaxRuntimeError as err:
    explained = memory_error(err)
    if explained is None:
      raise
    raise explained from err


def _call_records(run: Run, i: int, own, metrics: Dict[str, np.ndarray], first: int,
                  seconds: float, compile_seconds: float, trainer: Trainer,
                  evaluate_now: bool) -> Tuple[List[dict], Optional[Dict[str, float]]]:
  """Run i's records of the call's rounds first + 1 … (one per round; the last with its
  evaluation when ``evaluate_now`` and its ``log_state``), and that evaluation (None if
  none). ``own``: the run's state after the call; ``seconds``: the call's per run."""
  calls = len(metrics['loss'])
  records, summary = [], None
  for offset in range(calls):
    record = {'round': first + offset + 1,
              **{name: float(values[offset, i]) for name, values in metrics.items()},
              'round_seconds': seconds / calls}
    if trainer.examples_per_step and 'num_steps' in metrics:
      record['examples_per_second'] = (float(metrics['num_steps'][offset, i]) *
                                       trainer.examples_per_step / record['round_seconds'])
    if offset == 0 and compile_seconds > 0:
      record['compile_seconds'] = compile_seconds
    if offset == calls - 1:  # the call's last round: its state is the one we hold
      if evaluate_now:
        summary = run.evaluate(own)
        record.update(summary)
      if run.log_state is not None:
        record.update(run.log_state(own))
    records.append(record)
  return records, summary


def _progress_fields(metrics: Dict[str, np.ndarray], live: List[int], trainer: Trainer,
                     seconds: float) -> Dict[str, str]:
  """The bar's fields after a call: the live runs' loss, examples/s and the share of the
  iterated local steps that are real."""
  fields = {'loss': f'{np.nanmean(metrics["loss"][-1, live]) if live else float("nan"):.3f}'}
  if trainer.examples_per_step and 'num_steps' in metrics and live:
    steps = float(np.sum(metrics['num_steps'][:, live])) / len(live)
    fields['examples_per_s'] = f'{steps * trainer.examples_per_step / seconds:.0f}'
  if 'scanned_steps' in metrics and live:
    scanned = float(np.sum(metrics['scanned_steps'][:, live]))
    fields['real_steps'] = (f"{float(np.sum(metrics['local_steps'][:, live])) / scanned:.0%}"
                            if scanned else 'n/a')
  return fields


class _Book:
  """The loop's bookkeeping of each run: seconds, last checkpoint, last evaluation, and
  whether it diverged or a callback stopped it (those are neither trained nor saved)."""

  def __init__(self, runs: Sequence[Run], trainer: Trainer, cadence: Cadence,
               settled: Optional[Dict[int, DivergenceError]], state):
    self.runs, self.trainer, self.cadence = runs, trainer, cadence
    self.diverged: Dict[int, DivergenceError] = dict(settled or {})
    self.stopped = self._settled_stops(state)   # i -> (its stop record, its Outcome)
    starts = {run.label: run.start_round for i, run in enumerate(runs) if self.is_live(i)}
    if len(set(starts.values())) > 1:
      raise ValueError(f'runs trained in lockstep must start at one round; their '
                       f'checkpoints are at {starts}')
    self.start = next(iter(starts.values()), cadence.rounds)
    self.elapsed = [run.elapsed for run in runs]
    self.summaries: List[Dict[str, float]] = [{} for _ in runs]
    self.saved_at = [run.start_round for run in runs]   # each run's last checkpoint
    self.started: List[int] = []                         # runs told on_start

  def _settled_stops(self, state) -> Dict[int, Tuple[Dict[str, Any], Outcome]]:
    """The runs a callback stopped before at the round they resume at (their
    ``callbacks.STOPPED_FILE``), evaluated at it; with ``cadence.extend`` they train on."""
    rounds = self.cadence.rounds
    markers = callbacks_lib.read_stops([run.run_dir for run in self.runs])
    out = {}
    for i, marker in markers.items():
      run = self.runs[i]
      if i in self.diverged or run.start_round >= rounds:
        continue
      if self.cadence.extend or marker['round'] != run.start_round:
        log.info('%s: stopped early at round %d (%s); %s', run.label, marker['round'],
                 marker['reason'], 'config.resume=extend: trains on' if self.cadence.extend
                 else f'its checkpoints are at round {run.start_round} now: trains on')
        callbacks_lib.clear_stop(run.run_dir)
        continue
      log.info('%s: stopped early at round %d (%s); evaluated there, not trained (%s, or '
               "config.resume='extend', trains it on)", run.label, marker['round'],
               marker['reason'], os.path.join(run.run_dir, callbacks_lib.STOPPED_FILE))
      own = self.trainer.take(state, i)
      out[i] = (marker, Outcome(run.evaluate(own), run.elapsed, own, stopped=marker))
    return out

  def is_live(self, i: int) -> bool:
    return i not in self.diverged and i not in self.stopped

  def live(self) -> List[int]:
    return [i for i in range(len(self.runs)) if self.is_live(i)]

  def save(self, i: int, state, completed: int) -> None:
    self.runs[i].checkpointer.save(completed, RunState(*self.trainer.take(state, i),
                                                       jnp.float32(self.elapsed[i])),
                                   force=True)
    self.saved_at[i] = completed

  def save_live(self, state, completed: int) -> List[str]:
    """Checkpoints the live runs that trained rounds; their labels."""
    saved = [i for i in self.live() if completed > self.runs[i].start_round]
    for i in saved:
      if self.saved_at[i] != completed:
        self.save(i, state, completed)
    mark_unsaved(False)
    return [self.runs[i].label for i in saved]

  def diverges(self, i: int, metrics: Dict[str, np.ndarray], first: int) -> bool:
    """Whether run i's loss turned non-finite in the call (raised unless keep_going)."""
    bad = np.flatnonzero(~np.isfinite(metrics['loss'][:, i]))
    if not bad.size:
      return False
    run = self.runs[i]
    error = _divergence(run, metrics['loss'][bad[0], i], first + bad[0] + 1)
    if not self.cadence.keep_going:
      raise error
    log.warning('%s; config.on_divergence=continue: the other runs go on', error)
    self.diverged[i] = error
    record_divergence(run.run_dir, first + int(bad[0]) + 1, error)
    return True

  def on_start(self) -> None:
    for i in self.live() if self.cadence.callbacks else ():
      run = self.runs[i]
      event = callbacks_lib.start_event(run.label, run.run_dir, self.start,
                                        self.cadence.rounds)
      self.started.append(i)
      for callback in self.cadence.callbacks:
        callback.on_start(event)

  def ask(self, i: int, records: List[dict], own, evaluated: bool) -> Optional[str]:
    """Every callback's ``on_round`` on run i's records of a call (the state with the
    last); the first stop reason given, at a round before the last (None: go on)."""
    run, rounds, reason = self.runs[i], self.cadence.rounds, None
    for record in records:
      last = record is records[-1]
      event = callbacks_lib.RoundEnd(run.label, run.run_dir, record['round'], rounds,
                                     record, evaluated and last, own if last else None)
      for callback in self.cadence.callbacks:   # each is told, even after a stop
        asked = callbacks_lib.stop_reason(callback, callback.on_round(event))
        reason = reason or asked
    return reason if records[-1]['round'] < rounds else None

  def stop(self, i: int, state, completed: int, own, reason: str) -> None:
    """Run i stops after round ``completed``: checkpointed there with its record."""
    run = self.runs[i]
    if not self.summaries[i]:
      self.summaries[i] = run.evaluate(own)
    self.save(i, state, completed)
    marker = {'round': completed, 'reason': reason}
    callbacks_lib.record_stop(run.run_dir, completed, reason)
    log.info('%s: stopped early after round %d of %d: %s', run.label, completed,
             self.cadence.rounds, reason)
    self.stopped[i] = (marker, Outcome(self.summaries[i], self.elapsed[i], own,
                                       stopped=marker))

  def on_end(self, completed: int, error: Optional[str]) -> None:
    for i in self.started:
      run, marker = self.runs[i], self.stopped.get(i, (None,))[0]
      failed = str(self.diverged[i]) if i in self.diverged else error
      event = callbacks_lib.RunEnd(run.label, run.run_dir,
                                   marker['round'] if marker else completed,
                                   self.summaries[i], marker and marker['reason'], failed)
      for callback in self.cadence.callbacks:
        callback.on_end(event)

  def outcomes(self, state) -> List[Outcome]:
    out = []
    for i, run in enumerate(self.runs):
      if i in self.diverged:
        out.append(Outcome({}, self.elapsed[i], None, self.diverged[i]))
      elif i in self.stopped:
        out.append(self.stopped[i][1])
      else:
        own = self.trainer.take(state, i)   # a run resumed after its final round: evaluated
        out.append(Outcome(self.summaries[i] or run.evaluate(own), self.elapsed[i], own))
    return out


def train(runs: Sequence[Run], state, trainer: Trainer, cadence: Cadence,
          description: str = '', settled: Optional[Dict[int, DivergenceError]] = None
          ) -> List[Outcome]:
  """Trains every run of ``runs`` from their common start round to ``cadence.rounds``,
  telling ``cadence.callbacks`` of each start, round and end.

  ``settled``: runs (by index) that diverged before, within the rounds (their
  ``DIVERGED_FILE``): they hold a place in ``state`` but are neither trained on nor
  saved, and their Outcome carries that error. A run a callback stopped (now, or before
  at the round it resumes at: its ``callbacks.STOPPED_FILE``) holds its place the same
  way; its Outcome is its evaluation at the stop round. Returns one Outcome per run, in
  order.
  """
  rounds, count = cadence.rounds, len(runs)
  book = _Book(runs, trainer, cadence, settled, state)
  completed = book.start
  bar = Progress(rounds, completed, description, cadence.log_every) if cadence.progress else None
  signals = contextlib.ExitStack()
  requests = signals.enter_context(stop_requests())
  compiling = CompileSeconds()
  signals.callback(compiling.close)
  error = None   # what ended the loop early, for the callbacks' on_end
  try:
    if completed < rounds:
      book.on_start()
    while completed < rounds and book.live():
      compiling.take()
      tick = time.perf_counter()
      stop = call_end(completed, rounds, trainer.rounds_per_call, cadence.eval_every)
      state, metrics = _advance(trainer, state, completed, stop)
      mark_unsaved(True)
      seconds = time.perf_counter() - tick
      compile_seconds = compiling.take()
      first, completed = completed, stop
      evaluate_now = completed % cadence.eval_every == 0 or completed == rounds
      for i in book.live():
        if book.diverges(i, metrics, first):
          continue
        run, own = runs[i], trainer.take(state, i)
        book.elapsed[i] += seconds / count
        records, summary = _call_records(run, i, own, metrics, first, seconds / count,
                                         compile_seconds, trainer, evaluate_now)
        book.summaries[i] = summary or book.summaries[i]
        reason = book.ask(i, records, own, evaluate_now)
        if reason is not None and not evaluate_now:   # its results: evaluated at the stop
          book.summaries[i] = run.evaluate(own)
          records[-1].update(book.summaries[i])
        for record in records:
          run.writer.write(record)
        if reason is not None:
          book.stop(i, state, completed, own, reason)
        elif completed == rounds or any(r % cadence.checkpoint_every == 0
                                        for r in range(first + 1, completed + 1)):
          book.save(i, state, completed)
      mark_unsaved(any(book.saved_at[i] != completed for i in book.live()))
      if bar is not None:
        bar.update(stop - first, _progress_fields(metrics, book.live(), trainer, seconds),
                   compile_seconds)
      if requests and completed < rounds and book.live():
        book.save_live(state, completed)
        raise Preempted(f'{requests[0]} received: stopped after round {completed} of '
                        f'{rounds} with checkpoints saved ({", ".join(r.label for r in runs)}); '
                        f'run the same command again to resume')
  except KeyboardInterrupt:
    saved = book.save_live(state, completed)
    error = 'interrupted'
    raise Interrupted(f'interrupted: saved round {completed} of {", ".join(saved)}' if saved
                      else 'interrupted before a round was trained: nothing to save') from None
  except BaseException as err:
    error = f'{type(err).__name__}: {err}'
    raise
  finally:
    mark_unsaved(False)   # what is not saved now is lost with the error that ends the loop
    signals.close()
    if bar is not None:
      bar.close()
    for run in runs:
      if run.writer is not None:
        run.writer.close()
    book.on_end(completed, error)
  return book.outcomes(state)
