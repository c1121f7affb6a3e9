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
  ``progress``: show ``Progress`` (a line every ``log_every`` rounds off a terminal)."""
  rounds: int
  eval_every: int
  checkpoint_every: int
  keep_going: bool = False
  progress: bool = True
  log_every: int = 0

  @classmethod
  def of(cls, config, keep_going: Optional[bool] = None) -> 'Cadence':
    """The run config's (``keep_going`` None: ``config.on_divergence == 'continue'``)."""
    return cls(config.rounds, config.eval_every, config.checkpoint_every,
               config.on_divergence == 'continue' if keep_going is None else keep_going,
               config.progress, config.log_every)


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


def train(runs: Sequence[Run], state, trainer: Trainer, cadence: Cadence,
          description: str = '', settled: Optional[Dict[int, DivergenceError]] = None
          ) -> List[Outcome]:
  """Trains every run of ``runs`` from their common start round to ``cadence.rounds``.

  ``settled``: runs (by index) that diverged before, within the rounds (their
  ``DIVERGED_FILE``): they hold a place in ``state`` but are neither trained on nor
  saved, and their Outcome carries that error. Returns one Outcome per run, in order.
  """
  rounds = cadence.rounds
  diverged: Dict[int, DivergenceError] = dict(settled or {})
  starts = {run.label: run.start_round for i, run in enumerate(runs) if i not in diverged}
  if len(set(starts.values())) > 1:
    raise ValueError(f'runs trained in lockstep must start at one round; their checkpoints '
                     f'are at {starts}')
  count = len(runs)
  completed = next(iter(starts.values()), rounds)
  elapsed = [run.elapsed for run in runs]
  summaries: List[Dict[str, float]] = [{} for _ in runs]
  bar = Progress(rounds, completed, description, cadence.log_every) if cadence.progress else None
  saved_at = [run.start_round for run in runs]   # each run's last checkpoint

  def save(i: int) -> None:
    runs[i].checkpointer.save(
        completed, RunState(*trainer.take(state, i), jnp.float32(elapsed[i])), force=True)
    saved_at[i] = completed

  def save_live() -> None:
    for i, run in enumerate(runs):
      if i not in diverged and completed > run.start_round:
        save(i)
    mark_unsaved(False)

  signals = contextlib.ExitStack()
  requests = signals.enter_context(stop_requests())
  compiling = CompileSeconds()
  signals.callback(compiling.close)
  try:
    while completed < rounds:
      compiling.take()
      tick = time.perf_counter()
      stop = call_end(completed, rounds, trainer.rounds_per_call, cadence.eval_every)
      state, metrics = _advance(trainer, state, completed, stop)
      mark_unsaved(True)
      seconds = time.perf_counter() - tick
      compile_seconds = compiling.take()
      first, completed = completed, stop
      for i, run in enumerate(runs):
        if i in diverged:
          continue
        bad = np.flatnonzero(~np.isfinite(metrics['loss'][:, i]))
        if bad.size:
          error = _divergence(run, metrics['loss'][bad[0], i], first + bad[0] + 1)
          if not cadence.keep_going:
            raise error
          log.warning('%s; config.on_divergence=continue: the other runs go on', error)
          diverged[i] = error
          record_divergence(run.run_dir, first + int(bad[0]) + 1, error)
          continue
        elapsed[i] += seconds / count
        records, summary = _call_records(
            run, i, trainer.take(state, i), metrics, first, seconds / count, compile_seconds,
            trainer, completed % cadence.eval_every == 0 or completed == rounds)
        if summary is not None:
          summaries[i] = summary
        for record in records:
          run.writer.write(record)
        if completed == rounds or any(r % cadence.checkpoint_every == 0
                                      for r in range(first + 1, completed + 1)):
          save(i)
      mark_unsaved(any(saved_at[i] != completed for i in range(count) if i not in diverged))
      if len(diverged) == count:   # nothing left to train
        break
      if bar is not None:
        live = [i for i in range(count) if i not in diverged]
        bar.update(stop - first, _progress_fields(metrics, live, trainer, seconds),
                   compile_seconds)
      if requests and completed < rounds:
        save_live()
        raise Preempted(f'{requests[0]} received: stopped after round {completed} of '
                        f'{rounds} with checkpoints saved ({", ".join(r.label for r in runs)}); '
                        f'run the same command again to resume')
  except KeyboardInterrupt:
    saved = [run.label for i, run in enumerate(runs)
             if i not in diverged and completed > run.start_round]
    save_live()
    raise Interrupted(f'interrupted: saved round {completed} of {", ".join(saved)}' if saved
                      else 'interrupted before a round was trained: nothing to save') from None
  finally:
    mark_unsaved(False)   # what is not saved now is lost with the error that ends the loop
    signals.close()
    if bar is not None:
      bar.close()
    for run in runs:
      if run.writer is not None:
        run.writer.close()
  return [Outcome({}, elapsed[i], None, diverged[i]) if i in diverged else
          _outcome(run, trainer.take(state, i), summaries[i], elapsed[i])
          for i, run in enumerate(runs)]


def _outcome(run: Run, own, summary: Dict[str, float], elapsed: float) -> Outcome:
  """A trained run's Outcome: its last evaluation (a run resumed after its final round,
  with none: the restored state's)."""
  return Outcome(summary or run.evaluate(own), elapsed, own)
