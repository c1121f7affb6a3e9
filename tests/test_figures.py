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
  shown = [ax for ax in figure.axes if ax.get_visible()]
  assert [ax.get_title() for ax in shown] == ['test', 'val', 'training loss']   # a panel each
  test, val, loss = shown
  assert figure.legends and inside(figure)
  (legend,) = figure.legends
  assert [t.get_text() for t in legend.get_texts()] == [f'method{m} global' for m in range(13)]
  for panel in (test, val):
    by_method = {}
    for line in panel.get_lines():
      by_method.setdefault(line.get_label().split()[0], set()).add(line.get_color())
    assert len(by_method) == 13 and all(len(c) == 1 for c in by_method.values())
    assert len({c for c in by_method.values() for c in c}) == 13     # no two methods share
  assert len(loss.get_lines()) == 13
  for panel in shown:
    assert list(panel.get_xticks()) == [1, 2, 3]                     # the evaluated rounds
  assert figure._suptitle.get_text() == 'toy, 3 rounds'


def test_a_run_evaluated_once_is_drawn_as_points_over_its_round(tmp_path, saved):
  """One evaluation (the last round of a short run): each entry a point over that round,
  the round's integer tick in the middle of the axis."""
  run = tmp_path / 'fedavg' / 'seed_0'
  run.mkdir(parents=True)
  (run / 'metrics.jsonl').write_text(''.join(json.dumps(record) + '\n' for record in (
      {'round': 1, 'loss': 2.0}, {'round': 2, 'loss': 1.5},
      {'round': 3, 'loss': 1.0, 'global/test/accuracy': 0.5, 'global+tent/test/accuracy': 0.6})))
  figures.plot_curves({'fedavg': [str(run)]}, str(tmp_path / 'curves.png'))
  (figure,) = saved
  test = figure.axes[0]
  assert test.get_title() == 'test' and list(test.get_xticks()) == [3]
  assert test.get_xlim() == (2.0, 4.0)
  assert sorted(line.get_label() for line in test.get_lines()) == ['fedavg global',
                                                                   'fedavg global+tent']
  assert list(figure.axes[1].get_xticks()) == [1, 2, 3]


def test_table_bars_colour_each_row_apart_and_keep_the_legend_inside(tmp_path, saved):
  rows = [f'| Method {i} | {50 + i}.00 ± 1.00 | {40 + i}.00 |' for i in range(13)]
  markdown = '\n'.join(['| Method | Test | paper: Test |', '|---|---|---|'] + rows)
  (path,) = figures.table_figures(markdown, str(tmp_path / 'table.png'))
  (figure,) = saved
  assert inside(figure)
  bars = [patch for patch in figure.axes[0].patches]
  assert len(bars) == 13 and len({tuple(np.round(b.get_facecolor(), 4)) for b in bars}) == 13


def test_each_table_of_a_report_is_a_figure_named_and_titled_by_its_caption(tmp_path, saved):
  """Two tables of one report (the last-round table and the best-round one, the same
  rows): two files, each named by the caption above its table and titled with it (the
  notes ``paper_markdown`` writes beside a table are not captions); one table: the path
  as given."""
  from fedjax_shift import report
  numbers = {'source': 'Table 1, MNIST', 'rows': {'A': {'Test': 90.0}, 'C': {'Test': 1.0}}}
  rows = [['A', '50.00 ± 1.00'], ['B', '40.00']]
  table = report.paper_markdown(['Method', 'Test'], rows, numbers)
  markdown = (f'Layout of Table 1: last round\n\n{table}\n\n'
              f'The same at the best round\n\n{table}\n')
  assert "Paper's numbers: Table 1, MNIST." in markdown and 'do not fill: C.' in markdown
  paths = figures.table_figures(markdown, str(tmp_path / 'report.png'))
  assert [os.path.basename(p) for p in paths] == ['report_layout_of_table_1_last_round.png',
                                                  'report_the_same_at_the_best_round.png']
  assert all(os.path.exists(p) for p in paths)
  assert [f._suptitle.get_text() for f in saved] == ['Layout of Table 1: last round',
                                                      'The same at the best round']
  untitled = '\n'.join(['| Method | Test |', '|---|---|', '| A | 1.00 |'])
  assert figures.table_figures(f'{untitled}\n\n{untitled}', str(tmp_path / 'u.png')) == [
      str(tmp_path / 'u_1.png'), str(tmp_path / 'u_2.png')]
  assert figures.table_figures(untitled, str(tmp_path / 'one.png')) == [str(tmp_path / 'one.png')]
