"""The ``PIPELINES`` registry and what every pipeline returns and records: ``Results``
(printed and written as results.md the same way for every pipeline), the hardware and
the compile clock each results.json records.

A pipeline is ``run(config, workdir) -> Results`` registered under the name that
``config.pipeline`` selects, with the config sections it owns (``defaults``), a
``check(config)`` of the fields it reads and ``run_dirs(config, workdir)``;
``fedjax_shift.pipelines.run`` validates (``run_config.py``), opens the workdir
(``opening.py``), runs it and writes ``results.md``.
"""
from __future__ import annotations

import os
import platform
import shutil
from typing import Any, Dict, NamedTuple, Optional, Tuple

import jax

from fedjax_shift import report
from fedjax_shift.registry import Registry


# name -> run(config, workdir) -> Results; ``check(config)`` validates what it reads;
# meta ``run_dirs(config, workdir)`` -> [(run_dir, run_config, own section[, depends_on])] names the
# run directories it will train, so their fingerprints are checked before anything.
PIPELINES: Registry = Registry('pipeline')


class Results(NamedTuple):
  """What a pipeline returns; ``launch/train.py`` prints every pipeline's the same way.

  Attributes:
    preamble: one paragraph: protocol, seeds, hardware.
    tables: markdown tables in order (results.md holds the preamble and these).
    files: paths the pipeline wrote besides results.md (csv, json, png).
    records: the per-run records, keyed by the pipeline ('results': one dict per
      method × seed for 'federated'; 'table1', 'table3' for 'atp').
    terminal: the tables ``launch/train.py`` prints, a summary (the paper's rows and
      columns where the run lays out a paper's table); () = every table.
  """
  preamble: str
  tables: Tuple[str, ...]
  files: Tuple[str, ...]
  records: Dict[str, Any]
  terminal: Tuple[str, ...] = ()


_COMPILE_EVENTS = ('/jax/core/compile/jaxpr_trace_duration',
                   '/jax/core/compile/jaxpr_to_mlir_module_duration',
                   '/jax/core/compile/backend_compile_duration')


_ACTIVE_CLOCKS: list = []


def _on_duration(event: str, seconds: float, **kwargs) -> None:
  if event in _COMPILE_EVENTS:
    for clock in _ACTIVE_CLOCKS:
      clock.seconds += seconds
      clock.compilations += event == _COMPILE_EVENTS[-1]


jax.monitoring.register_event_duration_secs_listener(_on_duration)


class CompileClock:
  """Seconds JAX spends tracing, lowering and compiling while the clock is active
  (``with CompileClock() as clock: ...; clock.seconds``), and the number of XLA
  compilations (``clock.compilations``); a persistent-cache hit costs only its
  tracing and lowering."""

  def __init__(self):
    self.seconds = 0.0
    self.compilations = 0

  def __enter__(self) -> 'CompileClock':
    _ACTIVE_CLOCKS.append(self)
    return self

  def __exit__(self, *exc) -> None:
    _ACTIVE_CLOCKS.remove(self)


def hardware() -> Dict[str, object]:
  devices = jax.devices()
  info = {'backend': jax.default_backend(), 'devices': [str(d) for d in devices],
          'device_kind': devices[0].device_kind, 'jax': jax.__version__,
          'host': platform.node(), 'cpu_count': os.cpu_count(),
          'processes': jax.process_count()}
  local = jax.local_devices()[0]
  stats = local.memory_stats() if hasattr(local, 'memory_stats') else None
  if stats and 'bytes_limit' in stats:
    info['device_memory_gb'] = round(stats['bytes_limit'] / 2 ** 30, 2)
  return info


def write_results(workdir: str, results: Results) -> str:
  """``results.md``: the preamble and every table. Returns its path."""
  path = os.path.join(workdir, 'results.md')
  with open(path, 'w') as f:
    f.write(results.preamble.rstrip() + '\n\n' + '\n\n'.join(t.rstrip() for t in results.tables)
            + '\n')
  return path


def format_results(results: Results, workdir: str, width: Optional[int] = None) -> str:
  """What ``launch/train.py`` prints for any pipeline: its ``terminal`` tables (else
  every table), a table wider than the terminal (``width`` characters; None: the
  terminal's, 120 off a terminal) in parts of its columns that fit; results.md has
  every table whole."""
  results_md = os.path.join(workdir, 'results.md')
  written = ', '.join([results_md] + [os.path.relpath(p, workdir) for p in results.files if p])
  width = width or shutil.get_terminal_size((120, 24)).columns
  shown = list(results.terminal or results.tables)
  tables = [report.fit_width(table, width) for table in shown]
  notes = ([f'every table of the run, the results of each method and split among them, is in '
            f'{results_md}'] if len(shown) < len(results.tables) else []) + (
      ['tables wider than the terminal are shown in parts of their columns; '
       f'{results_md} has them whole'] if tables != shown else [])
  note = ''.join(f'\n\n({text})' for text in notes)
  return ('\n' + '\n\n'.join([results.preamble] + tables) + note +
          f'\n\nwritten: {written}')
