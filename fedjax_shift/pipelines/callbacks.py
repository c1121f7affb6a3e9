"""Hooks into the run loop: a ``Callback`` sees each run start, each trained round
(its metrics.jsonl record, the evaluation's metrics on an evaluation round, the run's
state) and each run end; ``on_round`` may stop its run early. Built on it:
``EarlyStopping`` on a validation metric and loggers to Weights & Biases and MLflow
(optional extras), set from a config (``config.early_stopping``, ``config.log_to``) or
given from Python, as pfl-research's callbacks and flax's ``periodic_actions``::

    class PrintAccuracy(callbacks.Callback):
      def on_round(self, event):
        if event.evaluated:
          print(event.label, event.round, event.record['global/val/accuracy'])

    pipelines.run(config, workdir, callbacks=[PrintAccuracy()])

A run stopped early keeps its checkpoint of the round it stopped at and a
``stopped.json`` ({'round', 'reason'}); running the same command again leaves it
stopped (its results are evaluated from that checkpoint), ``config.resume='extend'``
trains it on. Runs trained in one program (vmapped seeds, a sweep's points) stop one
by one: a stopped run's state rides along untrained, unsaved.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import time
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Union

import ml_collections

from fedjax_shift import distributed
from fedjax_shift.metrics import read_metrics
from fedjax_shift.registry import require

log = logging.getLogger('fedjax_shift')


class RunStart(NamedTuple):
  """A run about to train: ``label`` ('fedavg seed 0'), its ``run_dir``, the rounds
  already trained (``start_round``) and the target (``rounds``), its fingerprint
  ``fields`` (run.json's: the config fields that determine its state) and its
  metrics.jsonl records up to ``start_round`` (``history``; [] for a new run)."""
  label: str
  run_dir: str
  start_round: int
  rounds: int
  fields: Dict[str, str]
  history: List[Dict[str, float]]


class RoundEnd(NamedTuple):
  """A trained round: its metrics.jsonl ``record`` ('round', 'loss', …; on an
  evaluation round, ``evaluated`` and the evaluation's '<model>/<split>/<metric>'
  keys too) and, for the last round of a compiled call, the run's ``state`` after it
  (None for a round inside a call of ``engine.rounds_per_call`` > 1 rounds). A stop at
  a round that is not an evaluation round evaluates the run there: that evaluation is
  in the ``RunEnd``'s summary."""
  label: str
  run_dir: str
  round: int
  rounds: int
  record: Dict[str, float]
  evaluated: bool
  state: Any


class RunEnd(NamedTuple):
  """A run done training: the round it reached, its last evaluation (``summary``; {}
  when none was made) and why it ended early: ``stopped``, a callback's reason;
  ``error``, what ended it otherwise (its divergence, an interrupt, an exception);
  both None when it reached ``rounds``."""
  label: str
  run_dir: str
  round: int
  summary: Dict[str, float]
  stopped: Optional[str]
  error: Optional[str]


class Callback:
  """Each hook does nothing; a callback overrides those it needs. ``on_round``'s
  answer stops its run after that round when true: a string is the reason recorded
  (True: the callback's class name). Asked within a call of several rounds, the stop
  takes effect at the call's last round. Every process of a multi-process run calls
  the hooks with the same values; a callback that writes outside the workdir should
  do so on process 0 alone (``distributed.is_primary()``), as the loggers here do."""

  def on_start(self, run: RunStart) -> None:
    del run

  def on_round(self, event: RoundEnd) -> Union[None, bool, str]:
    del event
    return None

  def on_end(self, run: RunEnd) -> None:
    del run


STOPPED_FILE = 'stopped.json'


def read_stopped(run_dir: str) -> Optional[Dict[str, Any]]:
  """The record ``{'round', 'reason'}`` of ``run_dir``'s early stop (None: none)."""
  path = os.path.join(run_dir, STOPPED_FILE)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    record = json.load(f)
  if not (isinstance(record, dict) and isinstance(record.get('round'), int) and
          isinstance(record.get('reason'), str)):
    raise ValueError(f'{path} is not a record of an early stop ({{"round": the round, '
                     f'"reason": why}}); delete it to train the run on')
  return record


def read_stops(run_dirs: Sequence[str]) -> Dict[int, Dict[str, Any]]:
  """{index in ``run_dirs``: its ``read_stopped`` record} of the runs that have one, read
  by process 0 and the same on every process (``distributed.primary_decides``)."""
  def read() -> Dict[int, Dict[str, Any]]:
    records = {i: read_stopped(run_dir) for i, run_dir in enumerate(run_dirs)}
    return {i: record for i, record in records.items() if record is not None}
  decided = distributed.primary_decides(read, f'the early-stop records of {list(run_dirs)}')
  return {int(i): record for i, record in decided.items()}   # JSON: str keys


def record_stop(run_dir: str, round_index: int, reason: str) -> None:
  with distributed.open_output(os.path.join(run_dir, STOPPED_FILE)) as f:
    json.dump({'round': round_index, 'reason': reason}, f, indent=1)


def clear_stop(run_dir: str) -> None:
  if distributed.is_primary() and os.path.exists(os.path.join(run_dir, STOPPED_FILE)):
    os.remove(os.path.join(run_dir, STOPPED_FILE))


MODES = ('max', 'min')


class EarlyStopping(Callback):
  """Stops a run when ``metric`` (a key of its evaluations, e.g. 'global/val/accuracy')
  has not improved by more than ``min_delta`` over ``patience`` evaluations in a row
  (``mode`` 'max': higher is better; 'min': lower). A resumed run counts its earlier
  evaluations from its metrics.jsonl, so stopping does not depend on where it resumed.
  The run's results are its state at the stop round (the last evaluated one), not the
  best round's; the evaluations of every round are in results.json."""

  def __init__(self, metric: str, patience: int, min_delta: float = 0.0, mode: str = 'max'):
    if patience < 1:
      raise ValueError(f'EarlyStopping: patience must be >= 1, got {patience}')
    if mode not in MODES:
      raise ValueError(f'EarlyStopping: unknown mode {mode!r}; choose from {list(MODES)}')
    if min_delta < 0:
      raise ValueError(f'EarlyStopping: min_delta must be >= 0, got {min_delta}')
    self.metric, self.patience, self.min_delta, self.mode = metric, patience, min_delta, mode
    self._best: Dict[str, tuple] = {}    # label -> (best value, its round, evaluations since)

  def _improves(self, value: float, best: float) -> bool:
    return (value > best + self.min_delta if self.mode == 'max' else
            value < best - self.min_delta)

  def _see(self, label: str, round_index: int, value: float) -> None:
    best = self._best.get(label)
    if best is None or self._improves(value, best[0]):
      self._best[label] = (value, round_index, 0)
    else:
      self._best[label] = (best[0], best[1], best[2] + 1)

  def on_start(self, run: RunStart) -> None:
    self._best.pop(run.label, None)
    for record in run.history:
      if self.metric in record:
        self._see(run.label, record['round'], record[self.metric])

  def on_round(self, event: RoundEnd) -> Optional[str]:
    if not event.evaluated:
      return None
    if self.metric not in event.record:
      evaluated = sorted(k for k in event.record if k.count('/') == 2)
      raise ValueError(f'config.early_stopping.metric: {self.metric!r} is not one of the '
                       f'metrics {event.label} evaluates: {evaluated}')
    self._see(event.label, event.round, event.record[self.metric])
    best, best_round, since = self._best[event.label]
    if since < self.patience:
      return None
    return (f'{self.metric} has not improved by more than {self.min_delta:g} in '
            f'{since} evaluations (best {best:.4f} at round {best_round})')


class WandbLogger(Callback):
  """Logs every record of every run to Weights & Biases (``pip install -e '.[wandb]'``):
  a W&B run per run, named by its label, its fingerprint fields as the config, each
  record at its round as the step. ``project`` and the keyword arguments go to
  ``wandb.init`` (``WANDB_MODE=offline`` keeps the files local). Process 0 alone."""

  def __init__(self, project: str, **init_kwargs):
    self.wandb = _import('wandb', 'wandb')
    self.project, self.init_kwargs = project, init_kwargs
    self._runs: Dict[str, Any] = {}

  def on_start(self, run: RunStart) -> None:
    if distributed.is_primary():
      self._runs[run.label] = self.wandb.init(
          project=self.project, name=run.label, config=run.fields, dir=run.run_dir,
          reinit='create_new', **self.init_kwargs)

  def on_round(self, event: RoundEnd) -> None:
    if event.label in self._runs:
      self._runs[event.label].log(_scalars(event.record), step=event.round)

  def on_end(self, run: RunEnd) -> None:
    if run.label in self._runs:
      logged = self._runs.pop(run.label)
      logged.summary.update(_scalars(run.summary))   # with a stop's evaluation
      if run.stopped is not None:
        logged.summary['stopped'] = run.stopped
      logged.finish(exit_code=0 if run.error is None else 1)


class MLflowLogger(Callback):
  """Logs every record of every run to MLflow (``pip install -e '.[mlflow]'``): an MLflow
  run per run, named by its label, in experiment ``experiment``; its fingerprint fields
  as parameters, each record's metrics at its round as the step. The tracking URI is
  MLflow's own (``MLFLOW_TRACKING_URI``, e.g. a server or 'sqlite:///mlflow.db'). Process
  0 alone."""

  def __init__(self, experiment: str):
    self.mlflow = _import('mlflow', 'mlflow')
    self.experiment = experiment
    self._runs: Dict[str, str] = {}   # label -> MLflow run id
    self._evaluated: Dict[str, int] = {}   # label -> its last evaluated round logged

  def on_start(self, run: RunStart) -> None:
    if not distributed.is_primary():
      return
    client = self.mlflow.MlflowClient()
    found = client.get_experiment_by_name(self.experiment)
    experiment_id = (found.experiment_id if found is not None else
                     client.create_experiment(self.experiment))
    created = client.create_run(experiment_id, run_name=run.label,
                                tags={'run_dir': os.path.abspath(run.run_dir)})
    self._runs[run.label] = created.info.run_id
    params = [self.mlflow.entities.Param(k[:250], str(v)[:6000])
              for k, v in sorted(run.fields.items())]
    for start in range(0, len(params), 100):   # MLflow takes at most 100 in a batch
      client.log_batch(created.info.run_id, params=params[start:start + 100])

  def on_round(self, event: RoundEnd) -> None:
    self._log(event.label, event.record, event.round)
    if event.evaluated:
      self._evaluated[event.label] = event.round

  def _log(self, label: str, record: Dict[str, Any], step: int) -> None:
    run_id = self._runs.get(label)
    if run_id is None:
      return
    now = int(time.time() * 1000)
    metrics = [self.mlflow.entities.Metric(key, value, now, step)
               for key, value in _scalars(record).items()]
    client = self.mlflow.MlflowClient()
    for start in range(0, len(metrics), 1000):
      client.log_batch(run_id, metrics=metrics[start:start + 1000])

  def on_end(self, run: RunEnd) -> None:
    if run.label not in self._runs:
      return
    if run.stopped is not None and self._evaluated.get(run.label) != run.round:
      self._log(run.label, run.summary, run.round)   # the stop's evaluation
    client, run_id = self.mlflow.MlflowClient(), self._runs.pop(run.label)
    if run.stopped is not None:
      client.set_tag(run_id, 'stopped', run.stopped)
    client.set_terminated(run_id, 'FAILED' if run.error is not None else 'FINISHED')


def _scalars(record: Dict[str, Any]) -> Dict[str, float]:
  """A record's numeric fields but its round."""
  return {k: float(v) for k, v in record.items()
          if k != 'round' and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _import(module: str, extra: str):
  import importlib
  try:
    return importlib.import_module(module)
  except ImportError:
    raise ImportError(f'logging to {module} needs the {module!r} package: '
                      f"pip install -e '.[{extra}]'") from None


LOGGERS = {'wandb': lambda project: WandbLogger(project),
           'mlflow': lambda project: MLflowLogger(project)}


def early_stopping_defaults() -> ml_collections.ConfigDict:
  """``config.early_stopping``: off while ``metric`` is ''."""
  return ml_collections.ConfigDict({
      'metric': '',        # an evaluated key, e.g. 'global/val/accuracy' ('': off)
      'patience': 5,       # evaluations without improvement before the run stops
      'min_delta': 0.0,    # what counts as an improvement
      'mode': 'max'})      # 'max': higher is better; 'min': lower


def check_config(config: ml_collections.ConfigDict) -> None:
  """``config.early_stopping`` and ``config.log_to``, before anything trains: each
  logger's package importable (else the extra to install)."""
  early = config.early_stopping
  if early.metric:
    parts = early.metric.split('/')
    require(len(parts) == 3 and all(parts), 'early_stopping.metric',
            f"{early.metric!r} is not an evaluated key '<model>/<split>/<metric>', e.g. "
            f"'global/val/accuracy'")
    require(early.patience >= 1, 'early_stopping.patience',
            f'must be >= 1, got {early.patience}')
    require(early.min_delta >= 0, 'early_stopping.min_delta',
            f'must be >= 0, got {early.min_delta}')
    require(early.mode in MODES, 'early_stopping.mode',
            f'unknown {early.mode!r}; choose from {list(MODES)}')
  require(isinstance(config.log_to, (tuple, list)), 'log_to',
          f"a tuple of logger names, e.g. ('wandb',), got {config.log_to!r}")
  for name in config.log_to:
    require(name in LOGGERS, 'log_to', f'unknown {name!r}; choose from {sorted(LOGGERS)}')
    try:
      _import(name, name)
    except ImportError as err:
      require(False, 'log_to', str(err))


_given: contextvars.ContextVar[tuple] = contextvars.ContextVar('callbacks', default=())


@contextlib.contextmanager
def given(callbacks: Sequence[Callback]) -> Iterator[None]:
  """The callbacks a Python caller gave ``pipelines.run``, seen by every run loop inside
  (this thread's, this context's)."""
  for callback in callbacks:
    if not isinstance(callback, Callback):
      raise TypeError(f'callbacks: {callback!r} is not a fedjax_shift callbacks.Callback')
  token = _given.set(_given.get() + tuple(callbacks))
  try:
    yield
  finally:
    _given.reset(token)


def for_config(config: ml_collections.ConfigDict) -> tuple:
  """The run loop's callbacks: the config's (early stopping, loggers), then those given
  from Python (``given``)."""
  out: List[Callback] = []
  early = config.early_stopping
  if early.metric:
    out.append(EarlyStopping(early.metric, early.patience, early.min_delta, early.mode))
  out.extend(LOGGERS[name](config.log_project) for name in config.log_to)
  return tuple(out) + _given.get()


def start_event(label: str, run_dir: str, start_round: int, rounds: int) -> RunStart:
  """A run's ``RunStart``: its fingerprint fields and records read from ``run_dir``."""
  fields: Dict[str, str] = {}
  path = os.path.join(run_dir, 'run.json')
  if os.path.exists(path):
    with open(path) as f:
      fields = json.load(f).get('fields', {})
  metrics_path = os.path.join(run_dir, 'metrics.jsonl')
  history = ([r for r in read_metrics(metrics_path) if r['round'] <= start_round]
             if start_round and os.path.exists(metrics_path) else [])
  return RunStart(label, run_dir, start_round, rounds, fields, history)


def stop_reason(callback: Callback, answer: Union[None, bool, str]) -> Optional[str]:
  """``on_round``'s answer as the reason recorded (None: go on)."""
  if not answer:
    return None
  return answer if isinstance(answer, str) else type(callback).__name__
