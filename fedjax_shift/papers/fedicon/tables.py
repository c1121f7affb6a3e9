"""FedICON's table layouts (Tan, Zhuang, Lyu, Chen, Dong & Long, "Is Heterogeneity
Notorious? Taming Heterogeneity to Handle Test-Time Shift in Federated Learning",
NeurIPS 2023): the rows of Tables 1–4 over FedTHE's five test sets or per-domain
corrupted test sets, Table 2 (leave one domain out) and Table 5 (the components),
with the paper's numbers beside ours. Registered as the paper tables 'fedicon' and
'fedicon_lodo'.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

from fedjax_shift.benchmarks import data_view
from fedjax_shift.papers.fedicon import numbers
from fedjax_shift.report import (PAPER_TABLES, PaperTable, load_runs, markdown, mean_std,
                                 paper_markdown, run_config, seeds_cell)


def paper_key(data_config) -> str:
  """The numbers.PAPER_NUMBERS key of the paper's table closest to ``config.data``:
  Table 1 (Digit-5, per-domain corruption) for digit domains, Table 3 (CIFAR-10,
  FedTHE's test sets) for the label-skew benchmark at its Dirichlet level."""
  if data_config.benchmark == 'digit_domains':
    return 'Table 1 (Digit-5)'
  return f'Table 3 (CIFAR-10, Dir({data_config.dirichlet_alpha:g}))'


# FedICON Tables 1–4 rows (Sec. 5.1): (label, method, model key). Tent, EATA
# and T3A adapt FedAvg's global model ("we implement these TTA methods with the FedAvg
# framework"); FedTHE / FedTHE+ ensemble FedTHE's two heads; FedICON adapts each
# client's personalised model by Eq. 7.
FEDICON_ROWS = (
    ('Local', 'local', 'personalized'),
    ('FedAvg', 'fedavg', 'global'),
    ('FedAvg-FT', 'fedavg_ft', 'personalized'),
    ('FedProx', 'fedprox', 'global'),
    ('FedRep', 'fedrep', 'personalized'),
    ('FedBN', 'fedbn', 'personalized'),
    ('FedTHE', 'fedthe', 'personalized+fedthe'),
    ('FedTHE+', 'fedthe', 'personalized+fedthe_plus'),
    ('Tent', 'fedavg', 'global+tent'),
    ('EATA', 'fedavg', 'global+eata'),
    ('T3A', 'fedavg', 'global+t3a'),
    ('FedICON', 'fedicon', 'personalized+fedicon'),
    ('FedICON-us', 'fedicon_us', 'personalized+fedicon'),
)
# The FedTHE-style test sets (benchmarks/label_skew.py), in the papers' column order.
FEDICON_COLUMNS = (('test', 'In-distribution'), ('test_corrupted', 'Corrupted'),
                   ('test_ooc', 'Out-of-client'), ('test_natural', 'Natural shift'),
                   ('test_mixture', 'Mixture'))


def fedicon_columns(data_config) -> tuple:
  """(split, label) columns of FedICON's table for ``config.data``: FedTHE's five test
  sets (label_skew_corrupted); Table 1's corrupted test per domain and their average
  (digit_domains, covariate shift); Table 2's held-out domain (leave-one-domain-out).
  ``data_config``: ``data_view(config.data)``."""
  if data_config.benchmark != 'digit_domains':
    return FEDICON_COLUMNS
  if data_config.held_out_domain:
    return (('test', f'Held-out domain: {data_config.held_out_domain}'),
            ('test_own', 'Own domain'))
  return tuple((f'test_corrupted_{d}', d) for d in data_config.domains) + (
      ('test_corrupted', 'Average (corrupted)'), ('test', 'Clean'))


def fedicon_table(results: List[Dict], online: bool = False,
                  columns: Sequence[tuple] = FEDICON_COLUMNS) -> str:
  """``fedicon_rows`` as markdown."""
  return markdown(*fedicon_rows(results, online, columns))


def fedicon_rows(results: List[Dict], online: bool = False,
                 columns: Sequence[tuple] = FEDICON_COLUMNS):
  """FedICON's layout: rows = FEDICON_ROWS that were run, columns = those of the
  (split, label) ``columns`` the runs have; accuracy (%) over each test set's examples,
  mean ± std over seeds. ``online``: FedICON's adapter ran in its online variant (the
  rows say so)."""
  columns = [(split, label) for split, label in columns
             if any(f'{model}/{split}/accuracy' in r['metrics']
                    for r in results for _, _, model in FEDICON_ROWS)]
  rows = []
  for label, method, model in FEDICON_ROWS:
    runs = [r for r in results if r['algorithm'] == method]
    if not runs or not any(k.startswith(model + '/') for r in runs for k in r['metrics']):
      continue
    if online and model.endswith('+fedicon'):
      label += ' (online)'
    rows.append([label] + [mean_std([r['metrics'].get(f'{model}/{split}/accuracy')
                                     for r in runs]) for split, _ in columns] +
                [seeds_cell(runs)])
  return ['Method'] + [label for _, label in columns] + ['seeds'], rows


# FedICON Table 5's variants: (label, method, model key, local invariance extraction,
# global invariance sharing), each with and without test-time adaptation (the fedicon
# adapter: '<model>+fedicon'). Without extraction the objective is cross-entropy and
# "global invariance sharing ... [shares] the learnable parameters of the local model"
# (Sec. 5.3), so the paper's two CE cells are Local and FedAvg: 34.00 and 55.04 are
# Table 4's Local and FedAvg means. The CE rows that share only the encoder (the head
# local) are ours, kept as extra rows.
FEDICON_ABLATION = (
    ('Local', 'local', 'personalized', False, False),
    ('FedAvg (the whole model shared)', 'fedavg', 'global', False, True),
    ('FedICON without sharing', 'fedicon_no_sharing', 'personalized', True, False),
    ('FedICON', 'fedicon', 'personalized', True, True),
    ('extra: CE, no sharing, separate head epoch', 'fedicon_ce_no_sharing', 'personalized',
     False, False),
    ('extra: CE, encoder shared, head local', 'fedicon_ce', 'personalized', False, True),
)
# The methods only the ablation runs (their presence prints Table 5).
ABLATION_ONLY = ('fedicon_no_sharing', 'fedicon_ce_no_sharing', 'fedicon_ce')
TABLE5 = 'Table 5 (Digit-5)'


def fedicon_ablation_table(results: List[Dict], split: str = 'test_corrupted') -> str:
  """FedICON Table 5 layout: one row per variant and test-time choice that was run,
  accuracy (%) on ``split`` (the covariate-shift test sets), mean ± std over seeds, and
  the paper's number where its cell is known (numbers.PAPER_NUMBERS[TABLE5])."""
  mark = lambda on: '✓' if on else ''
  paper = numbers.PAPER_NUMBERS[TABLE5]['rows']
  rows = []
  for label, method, model, extraction, sharing in FEDICON_ABLATION:
    runs = [r for r in results if r['algorithm'] == method]
    for tta, key in ((False, model), (True, f'{model}+fedicon')):
      values = [r['metrics'].get(f'{key}/{split}/accuracy') for r in runs]
      if not any(v is not None for v in values):
        continue
      cell = ' / '.join('✓' if on else '–' for on in (extraction, sharing, tta))
      paper_value = ('' if label.startswith('extra') or cell not in paper
                     else f'{paper[cell]["Accuracy"]:.2f}')
      rows.append([label, mark(extraction), mark(sharing), mark(tta), mean_std(values),
                   paper_value])
  return markdown(['Variant', 'Local invariance extraction', 'Global invariance sharing',
                   'Test-time adaptation', f'Accuracy ({split})', 'Paper'], rows)


def fedicon_tables(config, results: List[Dict]) -> str:
  """What launch/train.py prints for a configs/fedicon.py run (and Table 5's layout when
  it ran the ablations)."""
  text = ('FedICON layout (the rows of its Tables 1–4): accuracy (%) on each client\'s test '
          'sets (all examples pooled), mean ± std over seeds; last round\n\n' +
          paper_markdown(*fedicon_rows(
              results, online='fedicon:online' in tuple(config.eval_adapters),
              columns=fedicon_columns(data_view(config.data))),
              numbers.PAPER_NUMBERS.get(paper_key(config.data)), numbers.CLAIMS,
              lambda label: label.replace(' (online)', '')))
  if any(r['algorithm'] in ABLATION_ONLY for r in results):
    text += ('\n\nFedICON Table 5 layout: the components (test-time adaptation = the '
             'fedicon adapter on the personalised model)\n\n' + fedicon_ablation_table(results))
  return text


def fedicon_lodo_table(runs_by_domain: Dict[str, List[Dict]]) -> str:
  """FedICON Table 2 layout: one column per held-out domain (each a leave-one-domain-out
  run of configs/fedicon.py:lodo_<domain>), its 'test' split (the held-out domain dealt
  to the clients); rows = FEDICON_ROWS; mean ± std over seeds."""
  domains = list(runs_by_domain)
  rows = []
  for label, method, model in FEDICON_ROWS:
    cells, found = [], False
    for domain in domains:
      values = [r['metrics'].get(f'{model}/test/accuracy') for r in runs_by_domain[domain]
                if r['algorithm'] == method]
      found |= any(v is not None for v in values)
      cells.append(mean_std(values))
    if found:
      rows.append([label] + cells)
  return markdown(['Method'] + [f'Held out: {d}' for d in domains], rows)




def lodo_from_workdirs(workdirs: Sequence[str], labels: Sequence[str] = ()) -> str:
  """Table 2: one column per leave-one-domain-out run (configs/fedicon.py:lodo_<d>)."""
  del labels
  domains = [data_view(run_config(w).data).held_out_domain for w in workdirs]
  if not all(domains):
    raise ValueError('--kind=fedicon_lodo reads leave-one-domain-out runs '
                     '(configs/fedicon.py:lodo_<domain>); a workdir has no held-out domain')
  return fedicon_lodo_table(dict(zip(domains, load_runs(workdirs, domains).values())))


PAPER_TABLES.register('fedicon', pipelines=('federated',))(
    PaperTable(lambda config, records: fedicon_tables(config, records['results']), None,
               needs=('/accuracy',)))
PAPER_TABLES.register('fedicon_lodo', pipelines=('federated',), benchmarks=('digit_domains',),
                       fields={'data.held_out_domain': 'configs/fedicon.py:lodo_<domain>'})(
    PaperTable(None, lodo_from_workdirs, needs=('/test/accuracy',)))
