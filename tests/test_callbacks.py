"""Callbacks in the run loop: each run's start, rounds and end reach them; an answer
stops a run early (kept stopped on a re-run, trained on with config.resume='extend');
early stopping and the loggers are built on them."""
import json
import os
import shutil
import sys
import types

import numpy as np
import pytest

from fedjax_shift import pipelines
from fedjax_shift.metrics import read_metrics
from fedjax_shift.pipelines import callbacks
from fedjax_shift.pipelines.runs import build_data
from tests.helpers import tiny_config

VAL = 'global/val/accuracy'
TEST = 'global/test/accuracy'


def config_for(**fields):
  return tiny_config(**{'rounds': 6, 'eval_every': 1, 'checkpoint_every': 4, **fields})


def results(config, workdir, given=()):
  out = pipelines.run(config, str(workdir), callbacks=given)
  return {(r['algorithm'], r['seed']): r for r in out.records['results']}


def run_dir(workdir, seed=0, method='fedavg'):
  return os.path.join(str(workdir), method, f'seed_{seed}')


def rounds_of(workdir, seed=0):
  return [r['round'] for r in read_metrics(os.path.join(run_dir(workdir, seed), 'metrics.jsonl'))]


class Recorder(callbacks.Callback):
  """Every event it is told, and a stop at ``stop_at`` for the runs labelled ``stop``."""

  def __init__(self, stop_at=None, stop=()):
    self.events, self.stop_at, self.stop = [], stop_at, stop

  def on_start(self, run):
    self.events.append(run)

  def on_round(self, event):
    self.events.append(event)
    if event.round == self.stop_at and event.label in self.stop:
      return f'asked at round {event.round}'
    return None

  def on_end(self, run):
    self.events.append(run)


def test_early_stopping_counts_evaluations_without_improvement():
  stopping = callbacks.EarlyStopping('global/val/accuracy', patience=2, min_delta=0.01)
  event = lambda r, value: callbacks.RoundEnd('run', '/d', r, 10, {'round': r, VAL: value},  # noqa: E731
                                              True, None)
  # 0.50, then 0.505 (not > 0.51: no improvement), 0.52 (one: the count restarts),
  # 0.52, 0.525: two in a row without an improvement > 0.01 over 0.52 -> stop
  answers = [stopping.on_round(event(r, v)) for r, v in
             enumerate([0.50, 0.505, 0.52, 0.52, 0.525], start=1)]
  assert answers[:4] == [None] * 4
  assert answers[4] == ('global/val/accuracy has not improved by more than 0.01 in 2 '
                        'evaluations (best 0.5200 at round 3)')
  # a resumed run counts its earlier evaluations (metrics.jsonl): the same answer at 5
  resumed = callbacks.EarlyStopping('global/val/accuracy', patience=2, min_delta=0.01)
  history = [{'round': r, VAL: v} for r, v in enumerate([0.50, 0.505, 0.52, 0.52], start=1)]
  resumed.on_start(callbacks.RunStart('run', '/d', 4, 10, {}, history))
  assert resumed.on_round(event(5, 0.525)) == answers[4]
  # 'min': lower is better; a round without the metric is not counted
  loss = callbacks.EarlyStopping('global/val/loss', patience=1, mode='min')
  assert loss.on_round(callbacks.RoundEnd('run', '/d', 1, 9, {'round': 1}, False, None)) is None
  make = lambda r, v: callbacks.RoundEnd('run', '/d', r, 9, {'round': r, 'global/val/loss': v},  # noqa: E731
                                         True, None)
  assert loss.on_round(make(1, 2.0)) is None and loss.on_round(make(2, 1.5)) is None
  assert loss.on_round(make(3, 1.5)).startswith('global/val/loss has not improved')


def test_early_stopping_on_a_metric_not_evaluated_names_the_field():
  stopping = callbacks.EarlyStopping('global/valid/accuracy', patience=1)
  event = callbacks.RoundEnd('fedavg seed 0', '/d', 1, 9, {'round': 1, VAL: 0.5, 'loss': 1.0},
                             True, None)
  with pytest.raises(ValueError, match=r"config.early_stopping.metric: 'global/valid/accuracy' "
                                       r"is not one of the metrics fedavg seed 0 evaluates: "
                                       r"\['global/val/accuracy'\]"):
    stopping.on_round(event)


@pytest.mark.parametrize('fields,match', [
    ({'early_stopping.metric': 'accuracy'}, r"early_stopping.metric.*'<model>/<split>/<metric>'"),
    ({'early_stopping.metric': VAL, 'early_stopping.patience': 0}, 'patience: must be >= 1'),
    ({'early_stopping.metric': VAL, 'early_stopping.mode': 'up'}, "mode: unknown 'up'"),
    ({'log_to': ('neptune',)}, r"log_to: unknown 'neptune'; choose from \['mlflow', 'wandb'\]"),
])
def test_bad_callback_fields_are_refused_before_training(tmp_path, fields, match):
  with pytest.raises(ValueError, match=match):
    pipelines.run(config_for(**fields), str(tmp_path))
  assert not os.path.exists(tmp_path / 'fedavg')


def test_a_logger_whose_package_is_absent_names_the_extra(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, 'mlflow', None)   # import mlflow -> ImportError
  with pytest.raises(ValueError, match=r"log_to: logging to mlflow needs the 'mlflow' "
                                        r"package: pip install -e '.\[mlflow\]'"):
    pipelines.run(config_for(log_to=('mlflow',)), str(tmp_path))


def test_a_callback_sees_every_round_its_evaluations_and_the_state(tmp_path):
  recorder = Recorder()
  config = config_for(eval_every=2)
  record, = results(config, tmp_path, [recorder]).values()
  start, *rounds, end = recorder.events
  assert isinstance(start, callbacks.RunStart) and isinstance(end, callbacks.RunEnd)
  assert (start.label, start.start_round, start.rounds, start.history) == ('fedavg seed 0', 0, 6, [])
  assert start.fields['client.learning_rate'] == '0.05'   # run.json's fingerprint fields
  assert [e.round for e in rounds] == [1, 2, 3, 4, 5, 6]
  assert [e.evaluated for e in rounds] == [False, True, False, True, False, True]
  assert all(e.state is not None for e in rounds)   # one round a call: each has the state
  # the records are metrics.jsonl's, the evaluations with them
  assert [e.record for e in rounds] == read_metrics(os.path.join(run_dir(tmp_path),
                                                                 'metrics.jsonl'))
  assert (end.round, end.stopped, end.error) == (6, None, None)
  assert end.summary == record['metrics'] == {k: v for k, v in rounds[-1].record.items()
                                              if k.count('/') == 2}
  assert 'stopped' not in record


def test_early_stopping_keeps_the_stop_round_then_resume_extend_trains_on(tmp_path, caplog):
  """min_delta 1 (no accuracy improves by more than 1) and patience 2: the run stops at its
  third evaluation, round 3, checkpointed there, its results that round's evaluation. A
  re-run keeps it stopped without training; resume='extend' trains it on to the round an
  uninterrupted run ends with, with that run's results (training is deterministic)."""
  straight = results(config_for(), tmp_path / 'straight')[('fedavg', 0)]
  config = config_for(**{'early_stopping.metric': VAL, 'early_stopping.patience': 2,
                         'early_stopping.min_delta': 1.0})
  stopped = results(config, tmp_path / 'run')[('fedavg', 0)]
  directory = run_dir(tmp_path / 'run')
  reason = (f'{VAL} has not improved by more than 1 in 2 evaluations (best '
            f'{read_metrics(os.path.join(directory, "metrics.jsonl"))[0][VAL]:.4f} at round 1)')
  assert stopped['stopped'] == {'round': 3, 'reason': reason}
  with open(os.path.join(directory, 'stopped.json')) as f:
    assert json.load(f) == {'round': 3, 'reason': reason}
  with open(os.path.join(directory, 'results.json')) as f:
    assert json.load(f)['stopped'] == stopped['stopped']
  assert rounds_of(tmp_path / 'run') == [1, 2, 3]
  assert sorted(os.listdir(os.path.join(directory, 'checkpoints'))) == ['3']
  third = read_metrics(os.path.join(run_dir(tmp_path / 'straight'), 'metrics.jsonl'))[2]
  assert stopped['metrics'][TEST] == third[TEST]
  # the same command: still stopped, nothing trained, the same results
  with caplog.at_level('INFO', logger='fedjax_shift'):
    again = results(config, tmp_path / 'run')[('fedavg', 0)]
  assert any('stopped early at round 3' in m and 'not trained' in m for m in caplog.messages)
  assert (again['stopped'], again['metrics']) == (stopped['stopped'], stopped['metrics'])
  assert rounds_of(tmp_path / 'run') == [1, 2, 3]
  # resume='extend' trains on (early stopping off); the results are the straight run's
  config.early_stopping.metric = ''
  config.resume = 'extend'
  extended = results(config, tmp_path / 'run')[('fedavg', 0)]
  assert 'stopped' not in extended and not os.path.exists(os.path.join(directory, 'stopped.json'))
  assert rounds_of(tmp_path / 'run') == [1, 2, 3, 4, 5, 6]
  assert extended['metrics'] == straight['metrics']


def test_a_stop_between_evaluations_evaluates_the_run_there(tmp_path):
  """Stopped at round 2 of eval_every 3: the run is evaluated at round 2 (its last record
  and its results hold that evaluation), the reason is the callback's answer."""
  recorder = Recorder(stop_at=2, stop=('fedavg seed 0',))
  record = results(config_for(eval_every=3), tmp_path, [recorder])[('fedavg', 0)]
  assert record['stopped'] == {'round': 2, 'reason': 'asked at round 2'}
  last = read_metrics(os.path.join(run_dir(tmp_path), 'metrics.jsonl'))[-1]
  assert last['round'] == 2 and last[TEST] == record['metrics'][TEST]
  end = recorder.events[-1]
  assert (end.round, end.stopped, end.error, end.summary) == (
      2, 'asked at round 2', None, record['metrics'])


def test_a_stop_at_the_last_round_is_not_recorded(tmp_path):
  record = results(config_for(), tmp_path, [Recorder(stop_at=6, stop=('fedavg seed 0',))])
  assert 'stopped' not in record[('fedavg', 0)]
  assert not os.path.exists(os.path.join(run_dir(tmp_path), 'stopped.json'))


def test_an_answer_of_true_records_the_callbacks_name(tmp_path):
  class StopNow(callbacks.Callback):
    def on_round(self, event):
      return True

  record = results(config_for(), tmp_path, [StopNow()])[('fedavg', 0)]
  assert record['stopped'] == {'round': 1, 'reason': 'StopNow'}


def test_a_callback_that_raises_ends_the_run_and_is_told_why(tmp_path):
  class Fails(Recorder):
    def on_round(self, event):
      super().on_round(event)
      if event.round == 2:
        raise RuntimeError('broken logger')

  fails = Fails()
  with pytest.raises(RuntimeError, match='broken logger'):
    results(config_for(), tmp_path, [fails])
  assert fails.events[-1].error == 'RuntimeError: broken logger'


def test_only_callbacks_are_taken():
  with pytest.raises(TypeError, match='is not a fedjax_shift callbacks.Callback'):
    with callbacks.given([print]):
      pass


def vmapped_config(**fields):
  config = config_for(**{'seeds': (0, 1, 2), 'rounds': 4, 'eval_every': 2,
                         'checkpoint_every': 2, 'engine.vmap_seeds': True, **fields})
  config.data.pad_to = max(int(max(split.num_examples.max() for split in build_data(config, s)
                                   .splits.values())) for s in config.seeds)
  return config


def test_one_vmapped_seed_stops_while_the_others_train_on_and_resume(tmp_path):
  """Seed 1 stops at round 1 (evaluated there); seeds 0 and 2 go on with the sequential
  runs' results. After a kill that lost seeds 0 and 2's round-4 checkpoints the re-run
  resumes them at round 2 while seed 1 stays at its round 1, untrained."""
  config = vmapped_config()
  sequential = results(vmapped_config(**{'engine.vmap_seeds': False}), tmp_path / 'sequential')
  first = results(config, tmp_path / 'run', [Recorder(stop_at=1, stop=('fedavg seed 1',))])
  assert first[('fedavg', 1)]['stopped'] == {'round': 1, 'reason': 'asked at round 1'}
  assert rounds_of(tmp_path / 'run', 1) == [1]
  for seed in (0, 2):
    assert 'stopped' not in first[('fedavg', seed)]
    np.testing.assert_allclose(first[('fedavg', seed)]['metrics'][TEST],
                               sequential[('fedavg', seed)]['metrics'][TEST], rtol=1e-5)
  for seed in (0, 2):
    shutil.rmtree(os.path.join(run_dir(tmp_path / 'run', seed), 'checkpoints', '4'))
    os.remove(os.path.join(run_dir(tmp_path / 'run', seed), 'results.json'))
  recorder = Recorder()
  again = results(config, tmp_path / 'run', [recorder])
  assert {e.label for e in recorder.events if isinstance(e, callbacks.RunStart)} == {
      'fedavg seed 0', 'fedavg seed 2'}
  assert {e.round for e in recorder.events if isinstance(e, callbacks.RoundEnd)} == {3, 4}
  assert rounds_of(tmp_path / 'run', 1) == [1]
  for key, record in first.items():
    assert again[key].get('stopped') == record.get('stopped')
    np.testing.assert_array_equal(again[key]['metrics'][TEST], record['metrics'][TEST])


class FakeWandbRun:
  def __init__(self, log, **init):
    self.calls, self.init, self.summary = log, init, {}

  def log(self, record, step):
    self.calls.append(('log', step, record))

  def finish(self, exit_code):
    self.calls.append(('finish', exit_code, dict(self.summary)))


def test_wandb_logs_every_record_at_its_round(tmp_path, monkeypatch):
  """A stand-in ``wandb`` module records what the logger calls: one W&B run per run with
  its fingerprint fields, each record at its round, the end with the stop."""
  calls, runs = [], []

  def init(**kwargs):
    runs.append(FakeWandbRun(calls, **kwargs))
    return runs[-1]

  monkeypatch.setitem(sys.modules, 'wandb', types.SimpleNamespace(init=init))
  config = config_for(**{'log_to': ('wandb',), 'log_project': 'shift',
                         'early_stopping.metric': VAL, 'early_stopping.patience': 1,
                         'early_stopping.min_delta': 1.0})
  record = results(config, tmp_path)[('fedavg', 0)]
  run, = runs
  assert (run.init['project'], run.init['name']) == ('shift', 'fedavg seed 0')
  assert run.init['config']['client.learning_rate'] == '0.05'
  records = read_metrics(os.path.join(run_dir(tmp_path), 'metrics.jsonl'))
  assert [c[:2] for c in calls] == [('log', 1), ('log', 2), ('finish', 0)]
  assert calls[1][2] == {k: v for k, v in records[1].items() if k != 'round'}
  assert calls[-1][2]['stopped'] == record['stopped']['reason']
  assert calls[-1][2][TEST] == record['metrics'][TEST]


def test_wandb_offline_writes_its_run(tmp_path, monkeypatch):
  pytest.importorskip('wandb')
  monkeypatch.setenv('WANDB_MODE', 'offline')
  monkeypatch.setenv('WANDB_DIR', str(tmp_path))
  monkeypatch.setenv('WANDB_SILENT', 'true')
  results(config_for(log_to=('wandb',)), tmp_path / 'run')
  assert list((tmp_path / 'run' / 'fedavg' / 'seed_0' / 'wandb').glob('offline-run-*'))


def test_mlflow_logs_params_and_every_metric_by_round(tmp_path, monkeypatch):
  mlflow = pytest.importorskip('mlflow')
  monkeypatch.setenv('MLFLOW_TRACKING_URI', (tmp_path / 'mlruns').as_uri())
  monkeypatch.setenv('MLFLOW_ALLOW_FILE_STORE', 'true')   # a file store: no server needed
  config = config_for(**{'log_to': ('mlflow',), 'log_project': 'shift'})
  record = results(config, tmp_path / 'run')[('fedavg', 0)]
  client = mlflow.MlflowClient()
  found, = client.search_runs([client.get_experiment_by_name('shift').experiment_id])
  assert found.info.run_name == 'fedavg seed 0' and found.info.status == 'FINISHED'
  assert found.data.params['client.learning_rate'] == '0.05'
  history = client.get_metric_history(found.info.run_id, TEST)
  assert [m.step for m in history] == [1, 2, 3, 4, 5, 6]
  assert history[-1].value == pytest.approx(record['metrics'][TEST])
