"""Paper tables as registered layouts: a toy paper added from this file alone prints
through launch/train.py and launch/report.py; bad names and missing columns are
errors; the papers' numbers stand beside ours with their claims checked; every command
in every README builds and validates."""
import ast
import json
import glob
import importlib.util
import os
import re
import shlex

import ml_collections
import numpy as np
import pytest

from fedjax_shift import config as config_lib
from fedjax_shift import report
from fedjax_shift.pipelines import sweep
from fedjax_shift.report import PAPER_TABLES, PaperTable
from fedjax_shift.report import figures
from tests.helpers import launch_module, tiny_config, write_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def toy_from_run(config, records):
  rows = [[r['algorithm'], f"{100 * r['metrics']['global/test/accuracy']:.2f}"]
          for r in records['results']]
  return 'Toy paper, Table 1\n\n' + report.paper_markdown(
      ['Method', 'Test'], rows, {'source': 'Table 1 of the toy paper',
                                 'rows': {'fedavg': {'Test': 99.0}}},
      claims=(('fedavg', 'fedprox', ('Test',)),))


def toy_from_workdirs(workdirs, labels):
  runs = report.load_runs(workdirs, labels)
  return 'Toy paper from workdirs: ' + ', '.join(f'{label} {len(r)} runs'
                                                 for label, r in runs.items())


@pytest.fixture
def toy_paper():
  PAPER_TABLES.register('toy_paper', pipelines=('federated',))(
      PaperTable(toy_from_run, toy_from_workdirs, needs=('/test/accuracy',)))
  yield
  PAPER_TABLES.unregister('toy_paper')


def test_a_toy_paper_table_prints_through_train_and_report(toy_paper, tmp_path, capsys,
                                                           monkeypatch):
  monkeypatch.setenv('COLUMNS', '90')   # a 90-column terminal, whatever runs the test
  config = tiny_config(paper_tables='toy_paper', algorithms=('fedavg', 'fedprox'))
  workdir = str(tmp_path / 'run')
  launch_module('train').train(config, workdir)
  printed = capsys.readouterr().out
  assert 'Toy paper, Table 1' in printed
  assert "Paper's numbers: Table 1 of the toy paper." in printed
  # Our column, the paper's beside it, and the claim, which a one-seed run of
  # tiny's rounds does not judge; results.md has the table whole, the 90-column
  # terminal its columns in parts.
  with open(os.path.join(workdir, 'results.md')) as f:
    lines = f.read().splitlines()
  assert "| Method | Test | paper: Test | paper's claims, on our numbers |" in lines
  row = [line for line in lines if line.startswith('| fedavg')][-1]
  assert '| 99.00 |' in row and row.endswith(
      f'| > fedprox: too short to judge ({config.rounds} rounds of the protocol\'s '
      f'{config.paper_rounds}, 1 seed) |'), row
  assert '(columns 2–3 of 4)' in printed and '(columns 4–4 of 4)' in printed
  assert all(len(line) <= 90 for line in printed.splitlines() if line.startswith('|'))
  build = launch_module('report').build
  assert build([workdir]) == 'Toy paper from workdirs: run 2 runs'   # its config's table
  assert build([workdir], 'toy_paper', ['A']) == 'Toy paper from workdirs: A 2 runs'


def test_unknown_paper_tables_and_missing_columns_are_errors(toy_paper, tmp_path):
  with pytest.raises(ValueError, match=r"config.paper_tables: unknown paper table 'nope'; "
                                       r"choose from \[.*'toy_paper'"):
    config_lib.validate(tiny_config(paper_tables='nope'))
  with pytest.raises(ValueError, match=r"--kind: unknown paper table 'nope'; choose from"):
    launch_module('report').build([str(tmp_path)], 'nope')
  config = tiny_config(paper_tables='toy_paper')
  run = {'algorithm': 'fedavg', 'seed': 0, 'metrics': {'global/val/accuracy': 0.5}}
  with pytest.raises(ValueError, match=r"'toy_paper' needs the columns \['/test/accuracy'\], "
                                       r"which this run lacks .*global/val/accuracy"):
    report.paper_table(config, {'results': [run]})
  with pytest.raises(ValueError, match=r"'table1'"):
    report.paper_table(ml_collections.ConfigDict({'paper_tables': 'atp'}), {'results': []})


def test_claims_are_checked_on_our_means():
  header = ['Method', 'Test', 'Val']
  rows = [['A', '80.00 ± 1.00', '70.00'], ['B', '75.00', '72.00'], ['C', 'n/a', '60.00']]
  numbers = {'source': 's', 'rows': {'A': {'Test': 90.0}, 'B': {'Test': 85.5, 'Val': 1.0}}}
  claims = (('A', 'B', ('Test',)), ('A', 'B', ()), ('A', 'C', ()), ('A', 'Z', ()))
  new_header, new_rows = report.beside_paper(header, rows, numbers, claims)
  assert new_header == ['Method', 'Test', 'paper: Test', 'Val', 'paper: Val',
                        "paper's claims, on our numbers"]
  # A > B on Test (80 > 75) holds; on every reported column (Test and Val) 1 of 2;
  # A vs C: only Val has both (70 > 60); Z was not run: left out.
  assert new_rows[0] == ['A', '80.00 ± 1.00', '90.00', '70.00', '—',
                         '> B ✓; > B ✗ (1 of 2); > C ✓']
  assert new_rows[1] == ['B', '75.00', '85.50', '72.00', '1.00', '—']
  assert report.beside_paper(header, rows, None, claims) == (header, [list(r) for r in rows])


@pytest.mark.parametrize('paper', ['atp', 'fedevolve', 'fedicon', 'fedins', 'fedtta'])
def test_every_paper_folder_registers_tables_with_numbers_and_claims(paper):
  numbers = importlib.import_module(f'fedjax_shift.papers.{paper}.numbers')
  assert numbers.PAPER_NUMBERS and all(n['source'] and n['rows']
                                       for n in numbers.PAPER_NUMBERS.values())
  rows = {row for n in numbers.PAPER_NUMBERS.values() for row in n['rows']}
  assert all(better in rows and worse in rows for better, worse, _ in numbers.CLAIMS)
  assert os.path.exists(os.path.join(ROOT, 'fedjax_shift', 'papers', paper, 'README.md'))
  assert [n for n in PAPER_TABLES.names() if n == paper or n.startswith(paper + '_')]


def readme_paths():
  """README.md and the package's pages (the papers', the registry's, the engine's, the
  run loops')."""
  return ['README.md'] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(
      os.path.join(ROOT, 'fedjax_shift', '**', 'README.md'), recursive=True))


def test_the_readme_states_commands_and_links_the_rest():
  # Figures that change live in BENCHMARKS.md and the package's pages, so the front
  # page stays short; each relative link it makes points at a file.
  import re
  with open(os.path.join(ROOT, 'README.md')) as f:
    text = f.read()
  assert len(text.splitlines()) <= 450
  for path in readme_paths() + ['BENCHMARKS.md']:
    with open(os.path.join(ROOT, path)) as f:
      links = re.findall(r'\]\(([^)#:\s]+)(?:#[^)]*)?\)', f.read())
    missing = [link for link in links
               if not os.path.exists(os.path.join(ROOT, os.path.dirname(path), link))]
    assert not missing, f'{path} links to missing files: {missing}'


def bash_commands(path):
  """Every command of the file's ```bash blocks (continued lines joined)."""
  with open(os.path.join(ROOT, path)) as f:
    text = f.read()
  for block in re.findall(r'```bash\n(.*?)```', text, re.S):
    for command in block.replace('\\\n', ' ').splitlines():
      if command.strip() and not command.strip().startswith('#'):
        yield command.strip()


def config_of(argument: str, overrides) -> ml_collections.ConfigDict:
  """configs/<file>.py[:variant] with ``--config.<field>=<value>`` overrides applied."""
  file, _, variant = argument.partition(':')
  spec = importlib.util.spec_from_file_location('readme_config', os.path.join(ROOT, file))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(variant or None)
  for field, value in overrides:
    # launch/train.py reads config.sweep and sweep_metric in their string forms too
    value = sweep.legacy_flag(f'--config.{field}={value}').split('=', 1)[1]
    *parents, last = field.split('.')
    section = config
    for parent in parents:
      section = section[parent]
    if not isinstance(section[last], str):   # config_flags: a string field takes the text
      try:
        value = ast.literal_eval(value)
      except (ValueError, SyntaxError):
        pass
    if isinstance(section[last], float) and isinstance(value, int):
      value = float(value)
    section[last] = value
  return config


@pytest.mark.parametrize('path', readme_paths())
def test_every_readme_command_builds_and_validates(path):
  commands = list(bash_commands(path))
  for command in commands:
    for part in command.split('&&'):
      words = shlex.split(part)
      if 'launch/train.py' in words:
        config_flag = next(w for w in words if w.startswith('--config='))
        overrides = [w[len('--config.'):].split('=', 1) for w in words
                     if w.startswith('--config.')]
        config_lib.validate(config_of(config_flag[len('--config='):], overrides))
      elif 'launch/report.py' in words:
        kinds = [w.split('=', 1)[1] for w in words if w.startswith('--kind=')]
        assert all(kind in PAPER_TABLES for kind in kinds), (path, part)
      elif words[:2] == ['python', '-m'] and words[2] != 'pytest':
        assert importlib.util.find_spec(words[2]) is not None, (path, part)
  # Every configs/<file>.py:<variant> the README names builds and validates.
  with open(os.path.join(ROOT, path)) as f:
    for argument in set(re.findall(r'configs/\w+\.py:[\w.,]+\w', f.read())):
      config_lib.validate(config_of(argument, ()))


def test_a_cell_says_how_many_runs_it_averages_when_one_is_missing():
  """A diverged seed leaves no accuracy: the cell is over the others and says so, where
  it once printed the mean of the rest as if it were every seed's."""
  from fedjax_shift.report import cell_value, mean_std
  assert mean_std([0.5, 0.7]) == '60.00 ± 10.00'
  assert mean_std([0.5, None, 0.7, float('nan')]) == '60.00 ± 10.00 (2 of 4 runs)'
  assert mean_std([None, 0.25]) == '25.00 (1 of 2 runs)'
  assert mean_std([None, None]) == 'n/a'
  assert mean_std([float('nan'), None]) == 'n/a (not finite in 1 of 2 runs)'   # said, not n/a
  assert cell_value(mean_std([0.5, None, 0.7])) == 60.0   # the paper-claims check reads the mean


def test_a_table_parses_into_means_spreads_and_the_papers_numbers_and_draws(tmp_path):
  markdown = '\n'.join([
      'Some text.', '',
      '| Method | A | paper: A | B | seeds | claims |',
      '|---|---|---|---|---|---|',
      '| FedAvg | 60.00 ± 1.50 | 65.92 | 55.25 | 3 | — |',
      '| FedEvolve | **70.10 ± 0.40** | 84.75 | n/a | 3 (1 diverged) | > FedAvg ✓ |', '',
      '| Method | C |', '|---|---|', '| X | text |', ''])
  (table,) = report.parse_tables(markdown)        # the second table has no numbers
  assert table.rows == ['FedAvg', 'FedEvolve'] and table.columns == ['A', 'B']
  np.testing.assert_array_equal(table.means, [[60.0, 55.25], [70.1, np.nan]])
  np.testing.assert_array_equal(table.spreads, [[1.5, 0.0], [0.4, np.nan]])
  np.testing.assert_array_equal(table.paper, [[65.92, np.nan], [84.75, np.nan]])
  (path,) = figures.table_figures(markdown, str(tmp_path / 'table.png'))
  with open(path, 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'


WORKDIR_KINDS = [name for name in PAPER_TABLES.names() if PAPER_TABLES.get(name).from_workdirs]


def fake_workdir(path, pipeline='federated', benchmark='label_skew_corrupted', methods=('fedavg',),
                 **fields):
  """A finished workdir as launch/report.py reads it: config.json naming the pipeline
  and benchmark (``fields``: other dotted config fields; a benchmark's own data field in
  its section, as a config records it), one run per method with every accuracy column,
  and, for the atp pipeline, its top-level results.json."""
  from fedjax_shift.benchmarks import BENCHMARKS
  config = ml_collections.ConfigDict({'pipeline': pipeline, 'data': {'benchmark': benchmark}})
  for field, value in fields.items():
    section, name = field.split('.')
    if section == 'data' and name in BENCHMARKS.defaults(benchmark):
      config.data[benchmark] = {**config.data.get(benchmark, {}), name: value}
    else:
      config[section][name] = value
  metrics = {f'{model}/{split}/{stat}': 0.5 for model in ('global', 'personalized')
             for split in ('val', 'test') for stat in ('accuracy', 'client_accuracy')}
  for i, method in enumerate(methods):
    write_run(path, method, 0, metrics, config if i == 0 else None)
  if pipeline == 'atp':
    (path / 'results.json').write_text(json.dumps({'table1': {}, 'table3': {}}))
  return str(path)


@pytest.mark.parametrize('kind', WORKDIR_KINDS)
def test_a_table_refuses_workdirs_it_does_not_lay_out_naming_what_it_needs(kind, tmp_path):
  # A label-skew FedAvg workdir and a hetero-pipeline one: every table built from
  # workdirs refuses them in one paragraph (no table printed under invented labels).
  build = launch_module('report').build
  label_skew = fake_workdir(tmp_path / 'label_skew')
  hetero = fake_workdir(tmp_path / 'hetero', pipeline='hetero', benchmark='upfl',
                        methods=('fedtta',))
  for workdir in (label_skew, hetero):
    with pytest.raises(ValueError, match=rf'--kind={kind} lays out runs of the .*; {workdir} '
                                         rf'does not: it (is a run of|ran config.data.bench)'):
      build([workdir], kind, ['a'])


@pytest.mark.parametrize('kind, fields, problem', [
    ('fedins_backbones', {'methods': ('fedavg',), 'data.backbone_reserve': 0.5},
     r"it ran \['fedavg'\] only"),
    ('fedins_backbones', {'methods': ('fedins',), 'data.backbone_reserve': 0.0},
     'it leaves data.backbone_reserve unset'),
    ('fedicon_lodo', {'data.held_out_domain': ''}, 'it leaves data.held_out_domain unset'),
    ('fedevolve_straggler', {}, r"it ran \['fedavg'\] only"),
])
def test_a_table_refuses_a_workdir_of_its_benchmark_without_what_its_rows_need(
    kind, fields, problem, tmp_path):
  benchmark = {'fedins_backbones': 'mixed_domains', 'fedicon_lodo': 'digit_domains',
               'fedevolve_straggler': 'rotated_digits'}[kind]
  workdir = fake_workdir(tmp_path / 'run', benchmark=benchmark, **fields)
  with pytest.raises(ValueError, match=problem):
    launch_module('report').build([workdir], kind, ['a'])


def test_a_paper_table_named_at_train_time_must_lay_out_the_configs_benchmark():
  with pytest.raises(ValueError, match=r"config.paper_tables: 'fedtta' lays out runs on the "
                                       r"\['upfl'\] benchmark\(s\), not config.data.benchmark="
                                       r"'label_skew_corrupted'"):
    config_lib.validate(tiny_config(paper_tables='fedtta'))


def test_claims_of_short_runs_are_not_judged_and_wide_tables_fit_the_terminal():
  """A run shorter than its protocol (``paper_rounds``) or of one seed keeps each claim
  but says 'too short to judge' instead of ✓ / ✗; a table wider than the terminal is
  printed in parts of its columns, each led by the row labels."""
  table = ("| Method | A | paper: A | seeds | paper's claims, on our numbers |\n"
           "|---|---|---|---|---|\n"
           "| FedTTA | 9.40 | 9.9 | 3 | > FedAvg ✓; > Local ✗ (1 of 2) |\n"
           "| FedAvg | 9.24 | 9.1 | 3 | — |")
  assert report.unjudged_reason([{'rounds': 200, 'paper_rounds': 200, 'seeds': [0, 1]}]) == ''
  assert report.unjudged_reason([{'rounds': 3, 'paper_rounds': 200, 'seeds': [0, 1]},
                                 {'rounds': 200, 'paper_rounds': 200, 'seeds': [0]}]) == \
      "3 rounds of the protocol's 200, 1 seed"
  assert report.mark_unjudged(table, '') == table
  marked = report.mark_unjudged(table, '1 seed').splitlines()
  assert marked[2] == ('| FedTTA | 9.40 | 9.9 | 3 | > FedAvg; > Local: too short to judge '
                       '(1 seed) |') and marked[3] == table.splitlines()[3]
  assert report.fit_width(table, 200) == table
  parts = report.fit_width('caption\n\n' + table, 40).splitlines()
  assert parts[:3] == ['caption', '', '(columns 2–4 of 5)']
  assert parts[3] == '| Method | A | paper: A | seeds |'
  assert parts[8] == '(columns 5–5 of 5)' and parts[9] == "| Method | paper's claims, on our numbers |"
  assert parts[11] == '| FedTTA | > FedAvg ✓; > Local ✗ (1 of 2) |'


def test_a_table_names_the_paper_rows_its_runs_do_not_fill():
  """Given the workdirs of some methods only, a layout says which of the paper's rows
  it could not fill instead of dropping them silently."""
  numbers = {'source': 'Table 1', 'rows': {'FedAvg': {'A': 1.0}, 'FedTTA': {'A': 2.0},
                                           'FedTTA++': {'A': 3.0}}}
  text = report.paper_markdown(['Method', 'A'], [['FedAvg', '50.00']], numbers)
  assert text.endswith('\n\nRows the paper reports that these runs do not fill: FedTTA, '
                       'FedTTA++.')
  full = report.paper_markdown(['Method', 'A'], [[m, '1'] for m in numbers['rows']], numbers)
  assert 'do not fill' not in full
