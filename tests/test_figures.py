"""The figures the pipelines and launch/report.py write, checked on the figure that is
saved (not its pixels): the legend inside the figure, one colour per method or row
(13 rows: more than a 10-colour cycle has), integer round ticks."""
import json
import os

import matplotlib
import numpy as np
import pytest

from fedjax_shift.report import figures

matplotlib.use('Agg')


@pytest.fixture
def saved(monkeypatch):
  """The figures ``save_plot`` writes, kept open for inspection."""
  import matplotlib.pyplot as plt
  figures, close = [], plt.close
  monkeypatch.setattr(plt, 'close', figures.append)
  yield figures
  for figure in figures:
    close(figure)


def inside(figure) -> bool:
  figure.canvas.draw()
  box = figure.bbox
  return all(box.x0 - 1 <= e.x0 and e.x1 <= box.x1 + 1 and box.y0 - 1 <= e.y0 and
             e.y1 <= box.y1 + 1 for e in (legend.get_window_extent() for legend in
                                          figure.legends))


def test_curves_colour_each_method_apart_and_keep_the_legend_inside(tmp_path, saved):
  run_dirs = {}
  for m in range(13):
    for seed in range(2):
      run = tmp_path / f'method{m}' / f'seed_{seed}'
      run.mkdir(parents=True)
      (run / 'metrics.jsonl').write_text(''.join(json.dumps(
          {'round': r, 'loss': 1.0 / r, 'global/test/accuracy': 0.1 * r + 0.01 * seed,
           'global/val/accuracy': 0.1 * r}) + '\n' for r in range(1, 4)))
      run_dirs.setdefault(f'method{m}', []).append(str(run))
  path = figures.plot_curves(run_dirs, str(tmp_path / 'curves.png'), title='toy, 3 rounds')
  assert os.path.getsize(path) > 0
  (figure,) = saved
  accuracy, loss = figure.axes
  assert figure.legends and inside(figure)
  by_method = {}
  for line in accuracy.get_lines():
    by_method.setdefault(line.get_label().split()[0], set()).add(line.get_color())
  assert len(by_method) == 13 and all(len(c) == 1 for c in by_method.values())
  assert len({c for c in by_method.values() for c in c}) == 13     # no two methods share
  assert {line.get_linestyle() for line in accuracy.get_lines()} == {'-', '--'}   # per split
  assert len(loss.get_lines()) == 13
  ticks = [t for t in accuracy.get_xticks() if 1 <= t <= 3]
  assert ticks and all(float(t).is_integer() for t in ticks)
  assert figure._suptitle.get_text() == 'toy, 3 rounds'


def test_table_bars_colour_each_row_apart_and_keep_the_legend_inside(tmp_path, saved):
  rows = [f'| Method {i} | {50 + i}.00 ± 1.00 | {40 + i}.00 |' for i in range(13)]
  markdown = '\n'.join(['| Method | Test | paper: Test |', '|---|---|---|'] + rows)
  (path,) = figures.table_figures(markdown, str(tmp_path / 'table.png'))
  (figure,) = saved
  assert inside(figure)
  bars = [patch for patch in figure.axes[0].patches]
  assert len(bars) == 13 and len({tuple(np.round(b.get_facecolor(), 4)) for b in bars}) == 13
