"""Workdirs written by earlier versions of the library keep resuming: a run whose
configuration did not change in meaning has the fingerprint it was recorded with.

tests/data/recorded_runs.json holds the run.json records (fields, fingerprint, round
target) of three one-round workdirs written by the library at commit 33464e0, before
the method client overrides and the sweep sections: FedTTA's tiny config (FedProx at
its own client rate 0.3), FedIns' tiny per-image config (federated SSF at its own batch
1) and a sweep of the client rate × FedProx's μ in the string form of that time.
"""
import ast
import importlib
import json
import os

import pytest

from fedjax_shift.pipelines import fingerprints
from fedjax_shift.pipelines import federated, sweep, workdir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, 'tests', 'data', 'recorded_runs.json')) as f:
  RECORDED = json.load(f)['workdirs']


def recorded_config(case: dict):
  """The config the recorded workdir's command line gives today, its sweep given in
  the string form of that time (as launch/train.py reads it)."""
  path, _, variant = case['config'].partition(':')
  module = importlib.import_module(path[:-len('.py')].replace('/', '.'))
  config = module.get_config(variant)
  for field, value in case['overrides'].items():
    if field == 'sweep':
      flag = sweep.legacy_flag(f'--config.sweep={value}')
      value = ast.literal_eval(flag.split('=', 1)[1])   # as the flag parser reads it
    config[field] = tuple(value) if isinstance(value, list) else value
  return config


@pytest.mark.parametrize('name', sorted(RECORDED))
def test_a_recorded_workdir_has_todays_fingerprints(name, tmp_path):
  """Every run directory of the workdir: the fields the config gives today equal the
  recorded ones field by field (so the sha256 fingerprint is the same), and the
  resume check accepts the recorded run.json."""
  case = RECORDED[name]
  config = recorded_config(case)
  runs = {os.path.relpath(run_dir, str(tmp_path)): (run_config, section)
          for run_dir, run_config, section in federated.run_dirs(config, str(tmp_path))}
  assert sorted(runs) == sorted(case['runs'])
  for run_dir, recorded in case['runs'].items():
    run_config, section = runs[run_dir]
    fields = fingerprints.run_fields(run_config, section)
    assert fields == recorded['fields'], run_dir
    assert fingerprints.fingerprint(fields) == recorded['fingerprint'], run_dir
    directory = tmp_path / run_dir
    directory.mkdir(parents=True)
    (directory / 'run.json').write_text(json.dumps(recorded))
    workdir.check_run_dir(str(directory), fields, run_config, resume='')
  # A changed override is a changed run, named as a config writes it.
  method = config.algorithms[-1]
  config.client_overrides[method] = {'batch_size': 7}
  for run_dir, run_config, section in federated.run_dirs(config, str(tmp_path)):
    if section == method:
      with pytest.raises(workdir.RunMismatchError,
                         match=fr'client_overrides.{method}.batch_size: \d+.* → 7'):
        workdir.check_run_dir(run_dir, fingerprints.run_fields(run_config, section),
                              run_config, resume='')


def test_a_digit_domains_run_recorded_without_its_corrupted_test_fields_resumes(tmp_path):
  """The digit domains read the corrupted test split's corruptions and severity, which
  runs recorded before the data sections did not record for them: such a run.json
  matches a config at their defaults; one at another severity is another run."""
  from fedjax_shift import config as config_lib
  config = config_lib.load('configs/fedicon.py:digit5')
  config.algorithms = ('fedavg',)
  (run_dir, run_config, section), = federated.run_dirs(config, str(tmp_path))[:1]
  fields = fingerprints.run_fields(run_config, section)
  assert fields['data.severity'] == '5' and 'data.corruptions' in fields
  old = {k: v for k, v in fields.items() if k not in ('data.severity', 'data.corruptions')}
  os.makedirs(run_dir)
  with open(os.path.join(run_dir, 'run.json'), 'w') as f:
    json.dump({'fields': old, 'fingerprint': fingerprints.fingerprint(old),
               'rounds': run_config.rounds}, f)
  workdir.check_run_dir(run_dir, fields, run_config, resume='')
  run_config.data.digit_domains.severity = 3
  with pytest.raises(workdir.RunMismatchError, match=r'data.severity: 5 → 3'):
    workdir.check_run_dir(run_dir, fingerprints.run_fields(run_config, section), run_config,
                          resume='')
