"""TensorBoard event files: the same numbers as metrics.jsonl, read back with TensorBoard's
own reader; rebuilt from metrics.jsonl when deleted or damaged; an unwritable event
directory stops the run before training."""
import logging
import os

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fedjax_shift import events, pipelines, report
from fedjax_shift.metrics import read_metrics
from tests.helpers import tiny_config

RUN = os.path.join('fedavg', 'seed_0')


def config():
  return tiny_config(algorithms=('fedavg',), rounds=3, eval_every=2)


def read_events(run_dir):
  accumulator = EventAccumulator(os.path.join(run_dir, events.DIRECTORY),
                                 size_guidance={'scalars': 0})
  accumulator.Reload()
  return accumulator, {tag: {event.step: event.value for event in accumulator.Scalars(tag)}
                       for tag in accumulator.Tags()['scalars']}


def expected_scalars(run_dir):
  """{tag: {round: value as float32}} of every numeric field of metrics.jsonl."""
  out = {}
  for record in read_metrics(os.path.join(run_dir, 'metrics.jsonl')):
    for tag, value in events.scalars(record).items():
      out.setdefault(tag, {})[record['round']] = float(np.float32(value))
  return out


@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp('tensorboard'))
  pipelines.run(config(), path)
  return path


def test_event_files_hold_the_metrics_records_and_the_fingerprint(workdir):
  run_dir = os.path.join(workdir, RUN)
  accumulator, scalars = read_events(run_dir)
  expected = expected_scalars(run_dir)
  assert scalars == expected
  assert set(scalars['loss']) == {1, 2, 3}
  assert set(scalars['global/test/accuracy']) == {2, 3}        # the evaluated rounds
  assert {'round_seconds', 'examples_per_second', 'compile_seconds'} <= set(scalars)
  assert 1 in scalars['compile_seconds']                       # the first call compiled
  assert '_hparams_/session_start_info' in accumulator.PluginTagToContent('hparams')
  from tensorboard.plugins.hparams import plugin_data_pb2
  start = plugin_data_pb2.HParamsPluginData.FromString(
      accumulator.PluginTagToContent('hparams')['_hparams_/session_start_info'])
  hparams = start.session_start_info.hparams
  assert (hparams['method'].string_value, hparams['seed'].number_value,
          hparams['point'].string_value) == ('fedavg', 0, '')   # the run named first
  assert 'client.learning_rate' in hparams


def hparams_view(logdir):
  """(metric tags, hyperparameter names) that TensorBoard's HParams view shows for the
  runs under ``logdir``, computed by its plugin's own backend."""
  from tensorboard import context
  from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
  from tensorboard.plugins import base_plugin
  from tensorboard.plugins.hparams import backend_context
  multiplexer = plugin_event_multiplexer.EventMultiplexer()
  multiplexer.AddRunsFromDirectory(logdir)
  multiplexer.Reload()
  provider = data_provider.MultiplexerDataProvider(multiplexer, logdir)
  backend = backend_context.Context(base_plugin.TBContext(
      logdir=logdir, multiplexer=multiplexer, data_provider=provider))
  ctx = context.RequestContext()
  experiment = backend.experiment_from_metadata(
      ctx, '', True, backend.hparams_metadata(ctx, ''),
      backend.hparams_from_data_provider(ctx, '', None))
  return ({m.name.tag for m in experiment.metric_infos},
          {h.name for h in experiment.hparam_infos})


def test_the_hparams_view_of_a_fresh_run_lists_every_evaluated_metric(workdir):
  """Written as the run trains (its first record had no evaluation), the event files
  still give the HParams view every metric the run evaluated, beside its fields."""
  metrics, names = hparams_view(workdir)
  assert {'loss', 'global/test/accuracy', 'global/val/accuracy',
          'global/test_corrupted/accuracy'} <= metrics
  assert {'method', 'seed', 'client.learning_rate'} <= names


def test_a_run_is_named_by_its_directory():
  assert events.run_identity('/w/fedavg/client.learning_rate=0.1/seed_2') == {
      'method': '"fedavg"', 'point': '"client.learning_rate=0.1"', 'seed': '2'}
  assert events.run_identity('/w/fedbn/seed_0')['method'] == '"fedbn"'
  assert events.run_identity('/w/atp/alpha') == {}


def test_deleted_or_damaged_event_files_are_rebuilt_with_a_warning(workdir, caplog):
  run_dir = os.path.join(workdir, RUN)
  expected = expected_scalars(run_dir)
  directory = os.path.join(run_dir, events.DIRECTORY)
  for damage in ('delete', 'truncate'):
    (name,) = os.listdir(directory)
    path = os.path.join(directory, name)
    if damage == 'delete':
      os.remove(path)
    else:
      with open(path, 'r+b') as f:
        f.truncate(os.path.getsize(path) - 7)
    assert not events.intact(directory)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger='fedjax_shift'):
      pipelines.run(config(), workdir)      # finished: restored, its event files rebuilt
    assert any(events.DIRECTORY in r.getMessage() for r in caplog.records), damage
    assert events.intact(directory)
    assert read_events(run_dir)[1] == expected


def test_report_rebuilds_every_runs_event_files(workdir):
  (written,) = report.rebuild_event_files(workdir)
  assert written == os.path.join(workdir, RUN, events.DIRECTORY)
  assert read_events(os.path.join(workdir, RUN))[1] == expected_scalars(
      os.path.join(workdir, RUN))
  with pytest.raises(FileNotFoundError, match='no metrics.jsonl'):
    report.rebuild_event_files(os.path.join(workdir, 'nothing_here'))


def test_an_unwritable_event_directory_stops_the_run_before_training(tmp_path):
  run_dir = tmp_path / 'fedavg' / 'seed_0'
  run_dir.mkdir(parents=True)
  (run_dir / events.DIRECTORY).write_text('a file where the event directory goes')
  with pytest.raises(events.EventDirectoryError, match=str(run_dir / events.DIRECTORY)):
    pipelines.run(config(), str(tmp_path))
  assert read_metrics(str(run_dir / 'metrics.jsonl')) == []


def test_a_read_only_run_directory_is_named_not_file_exists(tmp_path, monkeypatch):
  # Permissions as a non-root user meets them (root may write anywhere): the run
  # directory read-only. The message says so, not "[Errno 17] File exists".
  run_dir = tmp_path / 'fedavg' / 'seed_0'
  (run_dir / events.DIRECTORY).mkdir(parents=True)
  real_access = os.access
  monkeypatch.setattr(os, 'access', lambda path, mode: False if str(path) == str(run_dir)
                      else real_access(path, mode))
  with pytest.raises(events.EventDirectoryError,
                     match=rf'{run_dir}/tensorboard: {run_dir} is read-only; give it write'):
    events.rebuild(str(run_dir), [{'round': 1, 'loss': 1.0}])


def test_scalars_keep_non_finite_values_and_skip_the_round():
  record = {'round': 4, 'loss': None, 'gap': 'inf', 'accuracy': 0.5, 'diverged': True}
  scalars = events.scalars(record)
  assert set(scalars) == {'loss', 'gap', 'accuracy'}
  assert np.isnan(scalars['loss']) and scalars['gap'] == np.inf and scalars['accuracy'] == 0.5


def test_the_viewer_is_installed_with_the_package():
  """``pip install -e .`` brings the viewer the README's command runs, not only the
  writer: tensorboard is a base dependency, not a development extra."""
  import re
  import tomllib
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, 'pyproject.toml'), 'rb') as f:
    project = tomllib.load(f)['project']
  base = {re.split(r'[<>=\[ ]', requirement)[0] for requirement in project['dependencies']}
  assert {'tensorboard', 'tensorboardX'} <= base
  assert not any(r.startswith('tensorboard') for extra in project['optional-dependencies'].values()
                 for r in extra)
