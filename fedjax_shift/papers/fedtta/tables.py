"""FedTTA's table layouts (Ye, Chen, Wang, Li & Gao, "UPFL: Unsupervised Personalized
Federated Learning towards New Clients", arXiv 2023): Table 1 (validation on the
training clients, test on new clients) and Table 2 (degrees of shift), with the
paper's numbers beside ours. Registered as the paper tables 'fedtta' and
'fedtta_shift'.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

from fedjax_shift.papers.fedtta import numbers
from fedjax_shift.report import (PAPER_TABLES, PaperTable, column_labels, load_runs, markdown,
                                 mean_std, paper_markdown, run_config)

# config.data.source -> the paper's dataset name (numbers.PAPER_NUMBERS keys).
DATASETS = {'mnist_embedded': 'MNIST', 'tfds:mnist': 'MNIST', 'tfds:cifar10': 'CIFAR-10',
            'tfds:cifar100': 'CIFAR-100', 'tfds:fashion_mnist': 'Fashion-MNIST',
            'fashion_mnist': 'Fashion-MNIST',
            'tfds:emnist': 'FEMNIST'}


# FedTTA Table 1 rows: (label, method, validation model, test model).
# Validation: the training clients' held-out 15 %; test: the new clients. A personalised
# method (FedPer) is validated with each training client's own model and tested as
# PFL-Sampled / PFL-Ensemble; TENT is FedAvg adapted by the paper's TENT
# (configs/fedtta.py:tent); the adapted rows adapt on the validation data too
# (config.eval_adapter_splits).
UPFL_ROWS = (
    ('FedAvg', 'fedavg', 'global', 'global'),
    ('FedProx', 'fedprox', 'global', 'global'),
    ('SCAFFOLD', 'scaffold', 'global', 'global'),
    ('AFL', 'afl', 'global', 'global'),
    ('FedGMA', 'gma', 'global', 'global'),
    ('FedADG', 'fedadg', 'global', 'global'),
    ('FedSR', 'fedsr', 'global', 'global'),
    ('PFL-Sampled', 'fedper', 'personalized', 'pfl_sampled'),
    ('PFL-Ensemble', 'fedper', 'personalized', 'pfl_ensemble'),
    ('ODPFL-HN', 'odpfl_hn', 'global+odpfl_hn', 'global+odpfl_hn'),
    ('TENT', 'fedavg', 'global+tent', 'global+tent'),
    ('FedTTA', 'fedtta', 'global+fedtta', 'global+fedtta'),
    ('FedTTA-Prox', 'fedtta_prox', 'global+fedtta', 'global+fedtta'),
    ('FedTTA++', 'fedtta_prox', 'global+fedtta_pp', 'global+fedtta_pp'))


def at_best_validation(run: Dict, val_key: str, test_key: str):
  """(validation, test) accuracy of ``run`` at its evaluated round of highest
  ``val_key`` (the earliest such round), from results.json's 'evaluations'; the last
  round's when the run has none."""
  evaluations = [e for e in run.get('evaluations', ()) if val_key in e and test_key in e]
  if not evaluations:
    return run['metrics'].get(val_key), run['metrics'].get(test_key)
  best = max(evaluations, key=lambda e: (e[val_key], -e['round']))
  return best[val_key], best[test_key]


def upfl_cells(runs_by_workdir: Dict[str, List[Dict]], method: str, val_key: str,
               test_key: str, best_validation: bool = False):
  """(Validation, Test) cells of one FedTTA table row from the first workdir whose runs
  of ``method`` have ``test_key`` (or diverged), or None when none does."""
  for runs in runs_by_workdir.values():
    mine = [r for r in runs if r['algorithm'] == method and test_key in r['metrics']]
    diverged = [r for r in runs if r['algorithm'] == method and 'diverged' in r]
    if mine or diverged:
      pairs = [at_best_validation(r, val_key, test_key) if best_validation else
               (r['metrics'].get(val_key), r['metrics'][test_key]) for r in mine]
      note = f' ({len(diverged)} of {len(mine) + len(diverged)} diverged)' if diverged else ''
      return mean_std([v for v, _ in pairs]), mean_std([t for _, t in pairs]) + note
  return None


def upfl_table(runs_by_workdir: Dict[str, List[Dict]], column: str = '',
               best_validation: bool = False) -> str:
  """``upfl_rows`` as markdown."""
  return markdown(*upfl_rows(runs_by_workdir, column, best_validation))


def upfl_rows(runs_by_workdir: Dict[str, List[Dict]], column: str = '',
              best_validation: bool = False):
  """FedTTA Table 1 layout for one dataset: Validation and Test accuracy (%), mean ± std
  over seeds, at the last round or (``best_validation``, the paper's protocol) at each
  run's evaluated round of best validation accuracy of that row's model.
  ``runs_by_workdir``: workdir -> per (method, seed) results dicts; a row is read from
  the first workdir whose runs of its method have its test column (so FedAvg comes
  from the main run, TENT from the run of configs/fedtta.py:tent). Rows no run has are left out."""
  header = ['Method', f'{column} Validation'.strip(), f'{column} Test'.strip()]
  rows = []
  for label, method, val_model, test_model in UPFL_ROWS:
    cells = upfl_cells(runs_by_workdir, method, f'{val_model}/val/accuracy',
                       f'{test_model}/test/accuracy', best_validation)
    if cells:
      rows.append([label, *cells])
  return header, rows


def upfl_shift_table(groups: Dict[str, Dict[str, List[Dict]]],
                     best_validation: bool = False) -> str:
  """``upfl_shift_rows`` as markdown."""
  return markdown(*upfl_shift_rows(groups, best_validation))


def upfl_shift_rows(groups: Dict[str, Dict[str, List[Dict]]], best_validation: bool = False):
  """FedTTA Table 2 layout (degrees of shift): per row the Validation accuracy (of the
  first group that has the row) and one Test column per group — e.g. the new clients'
  Dirichlet α of configs/fedtta.py:shift<α> runs. ``groups``: column label -> the
  {workdir: runs} merged for it (as ``upfl_table``'s argument)."""
  header = ['Method', 'Validation'] + [f'Test ({label})' for label in groups]
  rows = []
  for label, method, val_model, test_model in UPFL_ROWS:
    cells = [upfl_cells(runs, method, f'{val_model}/val/accuracy',
                        f'{test_model}/test/accuracy', best_validation)
             for runs in groups.values()]
    if any(cells):
      validation = next(c[0] for c in cells if c)
      rows.append([label, validation] + [c[1] if c else 'n/a' for c in cells])
  return header, rows


def fedtta_tables(config, results: List[Dict]) -> str:
  """What launch/train.py prints for a configs/fedtta.py run: the rows of FedTTA's
  Table 1 it has (launch/report.py --kind=fedtta merges the TENT run into it)."""
  return table1({'run': results}, config.data.source, paper_key(config.data.source))


def paper_key(source: str) -> str:
  """The numbers.PAPER_NUMBERS key of the paper's Table 1 column for ``source``."""
  return f'Table 1 ({DATASETS.get(source, source)})'


def table1(runs_by_workdir, column: str, key: str) -> str:
  """Table 1 at the last round and at each run's round of best validation accuracy,
  each with the paper's column ``key`` beside ours."""
  paper = numbers.PAPER_NUMBERS.get(key)
  last_word = lambda label: label.split(' ')[-1]
  return ('FedTTA Table 1 layout: accuracy (%) mean ± std over seeds; Validation = the '
          'training clients\' held-out data, Test = the new clients; last round\n\n' +
          paper_markdown(*upfl_rows(runs_by_workdir, column), paper, numbers.CLAIMS,
                         last_word) +
          '\n\nThe same at each run\'s evaluated round of best validation accuracy (the '
          'paper\'s protocol; every config.eval_every rounds)\n\n' +
          paper_markdown(*upfl_rows(runs_by_workdir, column, best_validation=True), paper,
                         numbers.CLAIMS, last_word))




def from_workdirs(workdirs: Sequence[str], labels: Sequence[str] = ()) -> str:
  """Table 1 from finished configs/fedtta.py runs, each row from the first workdir
  that has it (the main run, then the TENT run of configs/fedtta.py:tent)."""
  del labels
  source = run_config(workdirs[0]).data.source
  return table1(load_runs(workdirs, workdirs), '', paper_key(source))


def shift_from_workdirs(workdirs: Sequence[str], labels: Sequence[str] = ()) -> str:
  """Table 2: one Test column per label (labels like 'α=0.01'; workdirs sharing a
  label are merged: a shift<α> run and its tent,shift<α> run)."""
  groups = {}
  for label, workdir in zip(column_labels(workdirs, labels), workdirs):
    groups.setdefault(label, {})[workdir] = load_runs([workdir], [workdir])[workdir]
  source = DATASETS.get(run_config(workdirs[0]).data.source, '')
  return paper_markdown(*upfl_shift_rows(groups), numbers.PAPER_NUMBERS.get(
      f'Table 2 ({source})'), numbers.CLAIMS)


PAPER_TABLES.register('fedtta', pipelines=('federated',), benchmarks=('upfl',))(
    PaperTable(lambda config, records: fedtta_tables(config, records['results']),
               from_workdirs, needs=('/val/accuracy', '/test/accuracy')))
PAPER_TABLES.register('fedtta_shift', pipelines=('federated',), benchmarks=('upfl',))(
    PaperTable(None, shift_from_workdirs, needs=('/val/accuracy', '/test/accuracy')))
