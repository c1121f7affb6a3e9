"""Benchmark cases by name. Each subject's module (``engine``, ``test_time``,
``sweeps``, ``data``, ``peers``) registers its cases with ``register``;
launch/benchmark.py runs one case per subprocess by name (``find``) and prints the
tables.

A name is a case's own ('round', 'tta_vmap') or a family's prefix ending in ':'
('algorithm:', 'sweep:'), whose cases carry their settings after it
('algorithm:fedins:head_pool=True', 'sweep:1000:host').
"""
from typing import Callable, Dict, NamedTuple, Union


class Case(NamedTuple):
  """run(name) -> the result dict ({'seconds', 'times', 'compile_s', …} or
  {'skipped': why}); label(name) -> the case's row name in the tables."""
  run: Callable[[str], dict]
  label: Callable[[str], str]


CASES: Dict[str, Case] = {}


def register(name: str, label: Union[str, Callable[[str], str]],
             run: Callable[[str], dict]) -> None:
  """Registers case ``name`` (a family: a prefix ending in ':') with its row ``label``
  (a string, or a function of the full name) and ``run``, a function of the full
  name."""
  if name in CASES:
    raise ValueError(f'benchmark case {name!r} is registered twice')
  CASES[name] = Case(run, label if callable(label) else (lambda _, text=label: text))


def find(name: str) -> Case:
  """The case of ``name``, its own or its family's (the prefix up to the first ':')."""
  if name in CASES:
    return CASES[name]
  family = name.split(':')[0] + ':'
  if ':' in name and family in CASES:
    return CASES[family]
  raise ValueError(f'--cases: unknown case {name!r}; choose from '
                   f'{", ".join(sorted(n + "…" if n.endswith(":") else n for n in CASES))}')
