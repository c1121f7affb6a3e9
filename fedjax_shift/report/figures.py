"""Figures: accuracy and loss against rounds (one colour per method, one line style per
split, the seeds' spread as a band), ATP's α per module, and a paper table's numbers
beside the paper's.
"""
from __future__ import annotations

import logging
import os
from typing import Dict, List, Sequence, Tuple

import numpy as np

from fedjax_shift.metrics import read_metrics
from fedjax_shift.report import ParsedTable, parse_tables

log = logging.getLogger('fedjax_shift')


def new_plot(figsize=(6, 4), panels: int = 1):
  """(fig, ax) of a fresh matplotlib figure drawn off-screen (the Agg backend), laid
  out by matplotlib's constrained layout (a legend placed outside the axes stays
  inside the figure); ``panels`` > 1: ax is a list of that many side-by-side axes."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
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
  """Labels the axes, puts the legend to the right of the axes (inside the figure),
  adds a light grid and ``title``, writes ``path`` (120 dpi) and closes ``fig``;
  returns ``path``."""
  import matplotlib.pyplot as plt
  axes = list(ax) if isinstance(ax, (list, tuple, np.ndarray)) else [ax]
  axes[0].set_xlabel(xlabel)
  axes[0].set_ylabel(ylabel)
  for each in axes:
    each.grid(alpha=0.3)
  handles, labels = axes[0].get_legend_handles_labels()
  if handles:
    fig.legend(handles, labels, loc='outside right upper', fontsize=legend_size,
               ncol=legend_columns)
  if title:
    fig.suptitle(title, fontsize=8)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def draw_curves(run_dirs: Dict[str, List[str]], metric_suffix: str = 'accuracy',
                title: str = ''):
  """The figure of ``plot_curves`` (None when there is nothing to draw): accuracy and
  loss against the round, a colour per method, a line style per model/split, the mean
  over seeds with their spread (± std) as a band; integer round ticks."""
  from matplotlib.ticker import MaxNLocator
  curves, losses = {}, {}
  for method, dirs in run_dirs.items():
    for d in dirs:
      for record in read_metrics(os.path.join(d, 'metrics.jsonl')):
        for key, value in record.items():
          if key.endswith('/' + metric_suffix) and value is not None:
            curves.setdefault((method, key), {}).setdefault(record['round'], []).append(value)
        if record.get('loss') is not None:
          losses.setdefault(method, {}).setdefault(record['round'], []).append(record['loss'])
  if not curves:
    return None
  methods = list(dict.fromkeys(method for method, _ in curves))
  splits = list(dict.fromkeys(key for _, key in curves))
  colour = dict(zip(methods, colours(len(methods))))
  styles = ['-', '--', ':', '-.']
  fig, (ax, loss_ax) = new_plot((10, 4), panels=2)
  for (method, key), points in curves.items():
    rounds = sorted(points)
    mean = np.array([100 * np.mean(points[r]) for r in rounds])
    spread = np.array([100 * np.std(points[r]) for r in rounds])
    style = styles[splits.index(key) % len(styles)]
    ax.plot(rounds, mean, style, color=colour[method], marker='o' if len(rounds) <= 20 else None,
            markersize=3, label=f'{method} {key[:-len(metric_suffix) - 1]}')
    if spread.any():
      ax.fill_between(rounds, mean - spread, mean + spread, color=colour[method], alpha=0.15,
                      linewidth=0)
  for method, points in losses.items():
    rounds = sorted(points)
    loss_ax.plot(rounds, [np.mean(points[r]) for r in rounds], color=colour.get(method, 'k'),
                 marker='o' if len(rounds) <= 20 else None, markersize=3)
  loss_ax.set_xlabel('round')
  loss_ax.set_ylabel('training loss')
  for each in (ax, loss_ax):
    each.xaxis.set_major_locator(MaxNLocator(integer=True))
  ax.set_xlabel('round')
  ax.set_ylabel(f'{metric_suffix} (%)')
  return fig, (ax, loss_ax)


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
  legend_columns = 1 + sum(1 for _ in axes[0].get_lines()) // 16
  return save_plot(fig, axes, path, 'round', f'{metric_suffix} (%)',
                   legend_columns=legend_columns, title=title)


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
  return save_plot(fig, ax, path, '', ylabel, legend_size=6,
                   legend_columns=max(1, (rows + 1) // 8))


def table_figures(markdown: str, path: str) -> List[str]:
  """``table_figure`` of every table of ours in ``markdown``: ``path`` for the first,
  ``<stem>_<k>.png`` for the k-th after it. Returns the paths written."""
  stem, ext = os.path.splitext(path)
  return [table_figure(table, path if k == 0 else f'{stem}_{k + 1}{ext or ".png"}')
          for k, table in enumerate(parse_tables(markdown))]
