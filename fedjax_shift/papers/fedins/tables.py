"""FedIns' table layout (Feng, Yu, Liu, Xu, Khan & Zuo, "Towards Instance-adaptive
Inference for Federated Learning", ICCV 2023): Table 1 with the parameters each client
sends, with the paper's numbers beside ours. Registered as the paper table 'fedins'.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

from fedjax_shift.benchmarks.mixed_domains import domain_label
from fedjax_shift.papers.fedins import numbers
from fedjax_shift.report import (PAPER_TABLES, PaperTable, markdown, mean_std, paper_markdown,
                                 seeds_cell)


# FedIns Table 1 rows: (label, method, model). SOLO and FedBN are scored with
# each client's own model; FedBN on a ViT keeps its LayerNorms local (fedbn.local_norms).
FEDINS_ROWS = (
    ('SOLO', 'local', 'personalized'),
    ('FedAvg (w.Full)', 'fedavg', 'global'),
    ('FedProx', 'fedprox', 'global'),
    ('SCAFFOLD', 'scaffold', 'global'),
    ('FedBN', 'fedbn', 'personalized'),
    ('MOON', 'moon', 'global'),
    ('FedDC', 'feddc', 'global'),
    ('Federated SSF (Table 2: SSF)', 'fedins_ssf', 'global'),
    ('FedIns (SSF pool, batch query)', 'fedins_batch_query', 'global'),
    ('FedIns', 'fedins', 'global'),
)


def parameters_cell(count: int) -> str:
  """Parameters in the paper's unit: '85.80 M', '5.35 M'; small counts in full."""
  return f'{count / 1e6:.2f} M' if count >= 1e5 else f'{count:,}'


def fedins_table(results: List[Dict], domains: Sequence[str] = ()) -> str:
  """``fedins_rows`` as markdown."""
  return markdown(*fedins_rows(results, domains))


BEST_ROUND = 'Test, best round (authors\' selection)'
# FedIns' key-selection diagnostics (algorithms/fedins.py:selection_diagnostics).
SELECTION_COLUMNS = (('fedins/test/keys_used', 'keys used'),
                     ('fedins/test/chosen_cosine', 'chosen cos'),
                     ('fedins/test/purity', 'key purity'))


def best_round(run: Dict, key: str):
  """The highest ``key`` accuracy over the run's evaluated rounds (the authors' code
  reports the best test accuracy seen during training), or None."""
  values = [e[key] for e in run.get('evaluations', ()) if key in e]
  return max(values) if values else None


def fedins_rows(results: List[Dict], domains: Sequence[str] = ()):
  """FedIns Table 1 layout: rows = FEDINS_ROWS that were run; '# Com.cost' = the
  parameters a client uploads per round (from the update pytrees); accuracy (%) on the
  clients' test sets (all examples pooled) and per domain ('test_<domain>'), mean ± std
  over seeds, at the last round (our protocol); the best test accuracy over the
  evaluated rounds (the authors' code's selection, on the test set); and, for the pool
  methods, the key selection at the last round (keys chosen at least once, the chosen
  keys' mean cosine, the pooled purity over domains; '—' for the others)."""
  columns = [('test', 'Test (all domains)')] + [(f'test_{d}', d) for d in domains]
  rows = []
  for label, method, model in FEDINS_ROWS:
    runs = [r for r in results if r['algorithm'] == method]
    if not runs:
      continue
    uploads = {r.get('uploaded_parameters', 0) for r in runs}
    cost = '—' if uploads == {0} else ' / '.join(parameters_cell(u) for u in sorted(uploads))
    selection = []
    for key, _ in SELECTION_COLUMNS:
      values = [r['metrics'].get(key) for r in runs]
      selection.append('—' if all(v is None for v in values) else
                       mean_std(values, scale=1.0, digits=1 if 'keys' in key else 3))
    rows.append([label, cost] + [mean_std([r['metrics'].get(f'{model}/{split}/accuracy')
                                           for r in runs]) for split, _ in columns] +
                [mean_std([best_round(r, f'{model}/test/accuracy') for r in runs])] +
                selection + [seeds_cell(runs)])
  return (['Method', '# Com.cost'] + [label for _, label in columns] + [BEST_ROUND] +
          [label for _, label in SELECTION_COLUMNS] + ['seeds'], rows)


def fedins_tables(config, results: List[Dict]) -> str:
  """What launch/train.py prints for a configs/fedins.py run."""
  domains = (tuple(domain_label(d) for d in config.data.domains)
             if config.data.benchmark == 'mixed_domains' else ())
  return ('Our protocol in FedIns Table 1\'s layout: accuracy (%) on the clients\' test sets '
          '(pooled; then per domain), mean ± std over seeds, last round, then the best round '
          'as the authors\' code selects it; # Com.cost = parameters a client uploads per '
          'round; the pool methods\' key selection at the last round\n\n' + paper_markdown(
              *fedins_rows(results, domains), numbers.PAPER_NUMBERS.get(paper_key(config.data)),
              numbers.CLAIMS))


def paper_key(data_config) -> str:
  """The numbers.PAPER_NUMBERS key of the paper's Table 1 column for ``config.data``."""
  source = data_config.source
  if data_config.benchmark == 'mixed_domains':
    return 'Table 1 (DomainNet)'
  return {'tfds:cifar100': 'Table 1 (CIFAR-100)'}.get(source, 'Table 1 (Tiny-ImageNet)')


PAPER_TABLES.register('fedins', pipelines=('federated',))(
    PaperTable(lambda config, records: fedins_tables(config, records['results']), None,
               needs=('/test/accuracy',)))
