"""Figures: accuracy and loss against rounds (one colour per method, one line style per
split, the seeds' spread as a band), ATP's α per module, and a paper table's numbers
beside the paper's.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Dict, List, Sequence, Tuple, Union

import numpy as np

from fedjax_shift.metrics import read_metrics
from fedjax_shift.report import ParsedTable, parse_tables

log = logging.getLogger('fedjax_shift')


def new_plot(figsize=(6, 4), panels: Union[int, Tuple[int, int]] = 1):
  """(fig, ax) of a fresh matplotlib figure drawn off-screen (the Agg backend), laid
  out by matplotlib's constrained layout (a legend placed outside the axes stays
  inside the figure); ``panels`` > 1: ax is a list of that many side-by-side axes;
  (rows, columns): an array of axes in that grid."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  if isinstance(panels, tuple):
    return plt.subplots(*panels, figsize=figsize, layout='constrained', squeeze=False)
  return plt.subplots(1, panels, figsize=figsize, layout='constrained')


def colours(count: int) -> List[Tuple[float, ...]]:
  """``count`` distinct colours (RGBA): tab10 up to 10, tab20 up to 20, else evenly
  spaced along 'turbo', so that no two rows of a figure share one."""
  import matplotlib
  if count <= 10:
    return [matplotlib.colormaps['tab10'](i) for i in range(count)]
  if count <= 20:
    order = [2 * i for i in range(10)] + [2 * i + 1 for i in range(10)]   # darks first
    return [matplotlib.colormaps['tab20'](order[i]) for i in range(count)]
  return [matplotlib.colormaps['turbo'](v) for v in np.linspace(0.05, 0.95, count)]


def save_plot(fig, ax, path: str, xlabel: str, ylabel: str, legend_size: int = 6,
              legend_columns: int = 1, title: str = '') -> str:
  """Labels the first axes (where a label is given), puts the legend of every axes'
  labelled lines (each label once) to the right of the axes (inside the figure), adds a
  light grid and ``title``, writes ``path`` (120 dpi) and closes ``fig``; returns
  ``path``."""
  import matplotlib.pyplot as plt
  axes = list(ax) if isinstance(ax, (list, tuple, np.ndarray)) else [ax]
  if xlabel:
    axes[0].set_xlabel(xlabel)
  if ylabel:
    axes[0].set_ylabel(ylabel)
  for each in axes:
    each.grid(alpha=0.3)
  legend = {}
  for each in axes:
    for handle, label in zip(*each.get_legend_handles_labels()):
      legend.setdefault(label, handle)
  handles, labels = list(legend.values()), list(legend)
  if handles:
    fig.legend(handles, labels, loc='outside right upper', fontsize=legend_size,
               ncol=legend_columns)
  if title:
    fig.suptitle(title, fontsize=8)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def round_ticks(axis, rounds: Sequence[int]) -> None:
  """Integer round ticks on ``axis``: every evaluated round where there are at most
  12 (one round: a point in the middle of its axis), else integer ticks that fit."""
  from matplotlib.ticker import MaxNLocator
  rounds = sorted(set(rounds))
  if len(rounds) <= 12:
    axis.set_xticks(rounds)
    if len(rounds) == 1:
      axis.set_xlim(rounds[0] - 1, rounds[0] + 1)
  else:
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))


def draw_curves(run_dirs: Dict[str, List[str]], metric_suffix: str = 'accuracy',
                title: str = ''):
  """The figure of ``plot_curves`` (None when there is nothing to draw): small
  multiples, one panel per evaluated split (test, test_corrupted, val, …) of accuracy
  against the round and one of the training loss; a colour per method and model
  ('fedavg global', 'fedavg global+tent', …: the rows of the results table), the mean
  over seeds with their spread (± std) as a band; integer round ticks."""
  curves, losses = {}, {}
  for method, dirs in run_dirs.items():
    for d in dirs:
      for record in read_metrics(os.path.join(d, 'metrics.jsonl')):
        for key, value in record.items():
          if key.endswith('/' + metric_suffix) and value is not None:
            model, _, split = key[:-len(metric_suffix) - 1].rpartition('/')
            curves.setdefault(split, {}).setdefault(f'{method} {model}', {}).setdefault(
                record['round'], []).append(value)
        if record.get('loss') is not None:
          losses.setdefault(method, {}).setdefault(record['round'], []).append(record['loss'])
  if not curves:
    return None
  entries = list(dict.fromkeys(entry for lines in curves.values() for entry in lines))
  colour = dict(zip(entries, colours(len(entries))))
  method_colour = {}
  for entry in entries:   # the loss panel: a method's colour is its first entry's
    method_colour.setdefault(entry.split()[0], colour[entry])
  panels = len(curves) + 1
  columns = min(panels, 4)
  rows = -(-panels // columns)
  fig, axes = new_plot((3.2 * columns + 2.5, 2.8 * rows), panels=(rows, columns))
  axes = list(np.ravel(axes))
  for ax, (split, lines) in zip(axes, curves.items()):
    for entry, points in lines.items():
      rounds = sorted(points)
      mean = np.array([100 * np.mean(points[r]) for r in rounds])
      spread = np.array([100 * np.std(points[r]) for r in rounds])
      ax.plot(rounds, mean, color=colour[entry], marker='o' if len(rounds) <= 20 else None,
              markersize=3, label=entry)
      if spread.any():
        ax.fill_between(rounds, mean - spread, mean + spread, color=colour[entry],
                        alpha=0.15, linewidth=0)
    ax.set_title(split, fontsize=8)
    ax.set_ylabel(f'{metric_suffix} (%)')
    round_ticks(ax, [r for points in lines.values() for r in points])
  loss_ax = axes[len(curves)]
  for method, points in losses.items():
    rounds = sorted(points)
    loss_ax.plot(rounds, [np.mean(points[r]) for r in rounds],
                 color=method_colour.get(method, 'k'), marker='o' if len(rounds) <= 20 else None,
                 markersize=3)
  loss_ax.set_title('training loss', fontsize=8)
  round_ticks(loss_ax, [r for points in losses.values() for r in points] or [1])
  for ax in axes[len(curves) + 1:]:
    ax.set_visible(False)
  for ax in axes[max(panels - columns, 0):panels]:   # the panels with none below them
    ax.set_xlabel('round')
  return fig, axes[:len(curves) + 1]


def plot_curves(run_dirs: Dict[str, List[str]], path: str, metric_suffix: str = 'accuracy',
                title: str = '') -> str:
  """``draw_curves`` written to ``path``; '' (and no file: a stale one removed) when no
  run has an evaluated round to draw."""
  drawn = draw_curves(run_dirs, metric_suffix)
  if drawn is None:
    log.warning('%s: not drawn, no run has an evaluated round in its metrics.jsonl', path)
    if os.path.exists(path):
      os.remove(path)
    return ''
  fig, axes = drawn
  entries = {line.get_label() for ax in axes[:-1] for line in ax.get_lines()}
  return save_plot(fig, axes, path, '', '', legend_columns=1 + len(entries) // 24,
                   title=title)


def plot_alpha(alpha_by_shift: Dict[str, np.ndarray], names: Sequence[str], path: str,
               ylabel: str = 'adaptation rate α') -> str:
  """Per-module values (ATP's learned α, or any learned per-module rates) as one bar
  group per module, one colour per shift (ATP Figure 4's layout)."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  shifts = list(alpha_by_shift)
  width = 0.8 / max(len(shifts), 1)
  positions = np.arange(len(names))
  fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(names) + 2), 4))
  for i, shift in enumerate(shifts):
    ax.bar(positions + i * width, alpha_by_shift[shift], width, label=f'{shift} shift')
  short = [n.replace('params/', '').replace('batch_stats/', 'stats/').replace('encoder/', '')
           for n in names]
  ax.set_xticks(positions + 0.4 - width / 2)
  ax.set_xticklabels(short, rotation=90, fontsize=6)
  ax.set_ylabel(ylabel)
  ax.axhline(0, color='black', linewidth=0.5)
  ax.legend(fontsize=7)
  ax.grid(axis='y', alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def table_figure(table: ParsedTable, path: str, ylabel: str = 'accuracy (%)') -> str:
  """Grouped bars of ``table``: one group per column, one bar per row, the seeds'
  spread as error bars and the paper's value as a black tick on its bar."""
  rows, columns = len(table.rows), len(table.columns)
  fig, ax = new_plot((max(5.5, 2.4 + columns * (0.25 * rows + 0.4)), 3.6))
  width = 0.8 / rows
  for i, (label, colour) in enumerate(zip(table.rows, colours(rows))):
    x = np.arange(columns) + (i - (rows - 1) / 2) * width
    ax.bar(x, table.means[i], width, yerr=table.spreads[i], capsize=2, label=label,
           color=colour)
    ax.scatter(x, table.paper[i], marker='_', s=120, color='black', zorder=3,
               label='paper' if i == 0 and np.isfinite(table.paper).any() else None)
  ax.set_xticks(np.arange(columns))
  ax.set_xticklabels(table.columns, fontsize=7, rotation=20 if columns > 4 else 0)
  title = table.title if len(table.title) <= 120 else table.title[:117] + '…'
  return save_plot(fig, ax, path, '', ylabel, legend_size=6,
                   legend_columns=max(1, (rows + 1) // 8), title=title)


def slug(text: str, limit: int = 40) -> str:
  """``text`` as a file-name part: lower-case words joined by '_', at most ``limit``
  characters ('' for none)."""
  words = re.findall(r'[a-z0-9]+', text.lower())
  out = ''
  for word in words:
    if len(out) + len(word) + 1 > limit:
      break
    out = f'{out}_{word}' if out else word
  return out


def table_figures(markdown: str, path: str) -> List[str]:
  """``table_figure`` of every table of ours in ``markdown``, titled by the text line
  above it: one table at ``path``; several at ``<stem>_<its title's words>.png`` each
  (``<stem>_<k>`` for a table without a title; a name two tables share gets ``_<k>``).
  Returns the paths written."""
  tables = parse_tables(markdown)
  if len(tables) == 1:
    return [table_figure(tables[0], path)]
  stem, ext = os.path.splitext(path)
  names = [slug(table.title) or str(k + 1) for k, table in enumerate(tables)]
  names = [name if names.count(name) == 1 else f'{name}_{k + 1}'
           for k, name in enumerate(names)]
  return [table_figure(table, f'{stem}_{name}{ext or ".png"}')
          for table, name in zip(tables, names)]
