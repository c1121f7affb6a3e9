"""Rebuilds a paper's table from finished workdirs, with the paper's numbers beside ours.

    python launch/report.py --kind=atp --workdirs=/tmp/atp_feature,/tmp/atp_label,/tmp/atp_hybrid
    python launch/report.py --kind=fedevolve --workdirs=/tmp/fe_inf,/tmp/fe_1,/tmp/fe_01 \
        --labels='Dir=inf,Dir=1.0,Dir=0.1'
    python launch/report.py --kind=fedtta --workdirs=/tmp/fedtta,/tmp/fedtta_tent

``--kind`` names a registered paper table (``fedjax_shift.report.PAPER_TABLES``; each
paper's folder under fedjax_shift/papers/ registers its own and says what its
workdirs and labels are); without it, the first workdir's ``config.paper_tables``.
``--labels`` names one column per workdir where the layout has one column per run.
``--out`` also writes the markdown to a file; ``--figure=PATH.png`` draws each table
as grouped bars (the seeds' spread as error bars, the paper's number as a tick).

    python launch/report.py --tensorboard=/tmp/fedevolve_circle

writes anew the TensorBoard event files of every run under the named workdirs from
their metrics.jsonl (a run writes them as it trains; this rebuilds them) and prints
the ``tensorboard --logdir`` command.

    python launch/report.py --sweep=/tmp/fedtta_tuned

prints the whole grid of a hyperparameter sweep (``config.sweep``): every method ×
point with its validation accuracy and test accuracies, the selected point marked.
"""
import os
import sys
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from fedjax_shift import papers  # noqa: E402,F401  (registers the papers' tables)
from fedjax_shift.report import (PAPER_TABLES, check_workdirs, mark_unjudged,  # noqa: E402
                                 read_sweep, rebuild_event_files, run_config, unjudged_reason)
from fedjax_shift.report.figures import table_figures  # noqa: E402
from fedjax_shift.report.sweeps import sweep_grid_table, sweep_state, workdir_notes  # noqa: E402

_WORKDIRS = flags.DEFINE_list('workdirs', [], 'Finished workdirs, one per run or column.')
_TENSORBOARD = flags.DEFINE_list('tensorboard', [], 'Workdirs whose TensorBoard event files '
                                 'to rebuild from their metrics.jsonl (no table).')
_SWEEP = flags.DEFINE_list('sweep', [], 'Workdirs of hyperparameter sweeps whose whole grid '
                           'to print (no paper table).')
_OUT = flags.DEFINE_string('out', '', 'Write the markdown here.')
_KIND = flags.DEFINE_string('kind', '', 'A registered paper table (default: the first '
                            "workdir's config.paper_tables).")
_LABELS = flags.DEFINE_list('labels', [], 'Column labels, one per workdir.')
_FIGURE = flags.DEFINE_string('figure', '', 'Also draw each table as grouped bars here (.png; '
                              'a second table goes to <stem>_2.png, ...).')


def build(workdirs: Sequence[str], kind: str = '', labels: Sequence[str] = ()) -> str:
  """The markdown of paper table ``kind`` over ``workdirs``."""
  if not kind:
    path = os.path.join(workdirs[0], 'config.json')
    kind = run_config(workdirs[0]).get('paper_tables', '') if os.path.exists(path) else ''
    if not kind:
      raise ValueError(f'{workdirs[0]} names no config.paper_tables; pass --kind, one of '
                       f'{PAPER_TABLES.names()}')
  table = PAPER_TABLES.get(kind, '--kind')
  if table.from_workdirs is None:
    raise ValueError(f'--kind={kind} is printed by launch/train.py after a run; tables built '
                     f'from workdirs: ' + str([n for n in PAPER_TABLES.names()
                                                if PAPER_TABLES.get(n).from_workdirs]))
  check_workdirs(kind, workdirs)
  return mark_unjudged(table.from_workdirs(list(workdirs), list(labels)),
                       unjudged_reason([run_config(w).to_dict() for w in workdirs]))


def main(argv):
  del argv
  if _TENSORBOARD.value:
    try:
      for workdir in _TENSORBOARD.value:
        print(f'{workdir}: {len(rebuild_event_files(workdir))} runs\' event files rebuilt')
    except (ValueError, FileNotFoundError, OSError) as err:
      sys.exit(f'launch/report.py: {err}')
    if len(_TENSORBOARD.value) == 1:
      print(f'tensorboard --logdir {_TENSORBOARD.value[0]}')
    else:
      print('tensorboard --logdir_spec=' + ','.join(
          f'{os.path.basename(os.path.normpath(w))}:{w}' for w in _TENSORBOARD.value))
    return
  if _SWEEP.value:
    for workdir in _SWEEP.value:
      try:
        record = read_sweep(workdir)
      except ValueError as err:
        sys.exit(f'launch/report.py: {err}')
      if record is None:
        sys.exit(f'launch/report.py: {sweep_state(workdir)}')
      print(f'{workdir}: selected on {record["metric"]} ({record["select"]})')
      print(sweep_grid_table(record))
    return
  workdirs = [w for w in _WORKDIRS.value if w.strip()]
  if not workdirs:
    sys.exit('launch/report.py: no workdirs given (--workdirs=DIR1,DIR2,...)')
  try:
    text = build(workdirs, _KIND.value, _LABELS.value)
  except (ValueError, FileNotFoundError) as err:
    sys.exit(f'launch/report.py: {err}')
  for workdir in workdirs:
    for note in workdir_notes(workdir):
      print(f'launch/report.py: note: {note}', file=sys.stderr)
  print(text)
  if _OUT.value:
    with open(_OUT.value, 'w') as f:
      f.write(text + '\n')
  if _FIGURE.value:
    for path in table_figures(text, _FIGURE.value):
      print(f'figure: {path}')


if __name__ == '__main__':
  app.run(main)
