"""Rebuilds ATP's tables from one or more test-time workdirs.

    python launch/report.py --workdirs=/tmp/atp_feature,/tmp/atp_label,/tmp/atp_hybrid

merges their Table 1 columns (one shift per run, or several), and Table 3 where a run
trained α on several shifts, and prints the tables in ATP's layout (mean ± std over
the seeds each run used). --out writes them as markdown.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from fedjax_shift import report  # noqa: E402

_WORKDIRS = flags.DEFINE_list('workdirs', None, 'Test-time pipeline workdirs.')
_OUT = flags.DEFINE_string('out', '', 'Write the markdown here.')
flags.mark_flags_as_required(['workdirs'])


def load(workdirs):
  """(table1, table3, labels, shifts, seeds) merged over the workdirs' results.json."""
  table1, table3, labels, shifts, seeds = {}, {}, {}, [], []
  for workdir in workdirs:
    path = os.path.join(workdir, 'results.json')
    if not os.path.exists(path):
      raise FileNotFoundError(f'{path} not found: is {workdir!r} a finished test-time run?')
    with open(path) as f:
      results = json.load(f)
    with open(os.path.join(workdir, 'config.json')) as f:
      config = json.load(f)
    labels.update(config['tta']['label'])
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


def main(argv):
  del argv
  text = report.tta_tables(*load(_WORKDIRS.value))
  print(text)
  if _OUT.value:
    with open(_OUT.value, 'w') as f:
      f.write(text + '\n')


if __name__ == '__main__':
  app.run(main)
