"""Rebuilds the papers' tables from finished workdirs.

    python launch/report.py --workdirs=/tmp/atp_feature,/tmp/atp_label,/tmp/atp_hybrid
    python launch/report.py --kind=evolving --workdirs=/tmp/fe_inf,/tmp/fe_1,/tmp/fe_01 \
        --labels='Dir=inf,Dir=1.0,Dir=0.1'

    python launch/report.py --kind=straggler --workdirs=/tmp/fe_1,/tmp/fe_r01,/tmp/fe_r09 \
        --labels='0,0.1,0.9'

    python launch/report.py --kind=fedtta --workdirs=/tmp/fedtta,/tmp/fedtta_tent
    python launch/report.py --kind=fedtta_shift --workdirs=/tmp/s001,/tmp/s001_tent,/tmp/s05 \
        --labels='α=0.01,α=0.01,α=0.5'
    python launch/report.py --kind=fedicon_lodo --workdirs=/tmp/lodo_mnist,/tmp/lodo_synth

--kind=atp (test-time pipeline runs) merges their Table 1 columns (one shift per run,
or several) and Table 3 where a run trained α on several shifts. --kind=evolving
(configs/fedevolve.py runs) lays out FedEvolve's Table 1 / 2 / 3 / 4: one Client/Server
column pair per workdir; --kind=straggler its Table 6: one Client column per workdir.
--kind=fedtta (configs/fedtta.py runs) lays out FedTTA's Table 1, each row from the first
workdir that has it (the main run, then the TENT run of configs/fedtta.py:tent);
--kind=fedtta_shift its Table 2: one Test column per label (workdirs sharing a label
are merged: a shift<α> run and its tent,shift<α> run). --kind=fedicon_lodo lays out
FedICON's Table 2: one column per leave-one-domain-out run (configs/fedicon.py:lodo_<d>).
Mean ± std over the seeds each run used; --out writes markdown.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from fedjax_shift import metrics, report  # noqa: E402

_WORKDIRS = flags.DEFINE_list('workdirs', None, 'Test-time pipeline workdirs.')
_OUT = flags.DEFINE_string('out', '', 'Write the markdown here.')
_KIND = flags.DEFINE_enum('kind', 'atp', ['atp', 'evolving', 'straggler', 'fedtta',
                                                   'fedtta_shift', 'fedicon_lodo'],
                          'Which paper layout.')
_LABELS = flags.DEFINE_list('labels', [], 'Column labels, one per workdir (evolving).')
flags.mark_flags_as_required(['workdirs'])


def read_json(path: str):
  """A results/config file; an unreadable one is an error naming it."""
  return metrics.read_json(path, 'was its run interrupted while writing it? Re-run that '
                                 'workdir to rewrite it')


def load(workdirs):
  """(table1, table3, labels, shifts, seeds) merged over the workdirs' results.json."""
  table1, table3, labels, shifts, seeds = {}, {}, {}, [], []
  for workdir in workdirs:
    path = os.path.join(workdir, 'results.json')
    if not os.path.exists(path):
      raise FileNotFoundError(f'{path} not found: is {workdir!r} a finished test-time run?')
    results = read_json(path)
    config = read_json(os.path.join(workdir, 'config.json'))
    labels.update(config['tta']['label'])
    labels.update(results.get('labels', {}))   # with the learned-rates rows' labels
    for key, columns in results['table1'].items():
      for shift, per_seed in columns.items():
        if shift in table1.get(key, {}):
          raise ValueError(f'{workdir}: row {key!r} of the {shift} shift is also in an earlier '
                           f'workdir; pass each shift once')
        table1.setdefault(key, {})[shift] = {int(s): v for s, v in per_seed.items()}
        shifts += [shift] if shift not in shifts else []
        seeds += [int(s) for s in per_seed if int(s) not in seeds]
    for pair, rows in results['table3'].items():
      train, test = pair.split('->')
      table3[(train, test)] = {k: {int(s): v for s, v in r.items()} for k, r in rows.items()}
  order = [s for s in ('feature', 'label', 'hybrid') if s in shifts]
  return table1, table3, labels, order, sorted(seeds)


def load_evolving(workdirs, labels):
  """{label: [per (method, seed) results.json dicts]} of federated-pipeline runs
  (configs/fedevolve.py, configs/fedtta.py); labels default to the workdir names."""
  import glob
  labels = labels or [os.path.basename(os.path.normpath(w)) for w in workdirs]
  if len(labels) != len(workdirs):
    raise ValueError(f'--labels names {len(labels)} columns for {len(workdirs)} workdirs')
  out = {}
  for label, workdir in zip(labels, workdirs):
    paths = sorted(glob.glob(os.path.join(workdir, '*', 'seed_*', 'results.json')))
    if not paths:
      raise FileNotFoundError(f'no <method>/seed_<s>/results.json under {workdir!r}')
    runs = []
    for path in paths:
      runs.append(read_json(path))
    out[label] = runs
  return out


def load_groups(workdirs, labels):
  """{label: {workdir: runs}}: workdirs sharing a label are merged into one column
  (a shift<α> run and its tent,shift<α> run)."""
  labels = labels or [os.path.basename(os.path.normpath(w)) for w in workdirs]
  if len(labels) != len(workdirs):
    raise ValueError(f'--labels names {len(labels)} columns for {len(workdirs)} workdirs')
  groups = {}
  for label, workdir in zip(labels, workdirs):
    groups.setdefault(label, {})[workdir] = load_evolving([workdir], [workdir])[workdir]
  return groups


def main(argv):
  del argv
  workdirs = [w for w in _WORKDIRS.value if w.strip()]
  if not workdirs:
    sys.exit('launch/report.py: no workdirs given (--workdirs=DIR1,DIR2,...)')
  try:
    text = build(workdirs)
  except (ValueError, FileNotFoundError) as err:
    sys.exit(f'launch/report.py: {err}')
  print(text)
  if _OUT.value:
    with open(_OUT.value, 'w') as f:
      f.write(text + '\n')


def build(workdirs) -> str:
  """The markdown of ``--kind`` over ``workdirs``."""
  if _KIND.value == 'fedtta_shift':
    return report.upfl_shift_table(load_groups(workdirs, _LABELS.value))
  if _KIND.value == 'fedtta':
    runs = load_evolving(workdirs, [])
    return ('Last round\n\n' + report.upfl_table(runs) + '\n\nAt the round of best '
            'validation accuracy\n\n' + report.upfl_table(runs, best_validation=True))
  if _KIND.value == 'fedicon_lodo':
    domains = [read_json(os.path.join(w, 'config.json'))['data']['held_out_domain']
               for w in workdirs]
    if not all(domains):
      raise ValueError('--kind=fedicon_lodo reads leave-one-domain-out runs '
                       '(configs/fedicon.py:lodo_<domain>); a workdir has no held-out domain')
    return report.fedicon_lodo_table(dict(zip(domains, load_evolving(workdirs,
                                                                     domains).values())))
  if _KIND.value in ('evolving', 'straggler'):
    return report.evolving_table(load_evolving(workdirs, _LABELS.value),
                                 server=_KIND.value == 'evolving')
  return report.tta_tables(*load(workdirs))


if __name__ == '__main__':
  app.run(main)
