"""Name -> value registries that raise on unknown and duplicate names.

An entry may carry its config defaults (a method's hyperparameters with the paper's
values, a benchmark's ``config.data`` fields, a pipeline's sections) and a ``check``
of its config section; ``fedjax_shift.config.base_config`` fills the config from
the registries, so adding a method, adapter, benchmark or pipeline is one file.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Generic, Mapping, Optional, TypeVar

import ml_collections

T = TypeVar('T')


class Registry(Generic[T]):
  """A named table of values (algorithms, models, benchmarks) for config lookup."""

  def __init__(self, kind: str, common_defaults: Optional[Mapping[str, Any]] = None):
    """``common_defaults``: config fields every entry has (its own defaults override
    them), e.g. each method's own client learning rate."""
    self.kind = kind
    self._common = copy.deepcopy(dict(common_defaults or {}))
    self._entries: Dict[str, T] = {}
    self._defaults: Dict[str, dict] = {}
    self._checks: Dict[str, Optional[Callable]] = {}
    self._meta: Dict[str, dict] = {}

  def register(self, name: str, defaults: Optional[Mapping[str, Any]] = None,
               check: Optional[Callable] = None, **meta) -> Callable[[T], T]:
    """Decorator. ``defaults``: the entry's config fields and their default values;
    ``check(section)``: raises ValueError naming ``config.<field>`` on a bad value;
    ``meta``: anything else the caller looks up with ``meta(name)``."""
    def decorator(value: T) -> T:
      if name in self._entries:
        raise ValueError(f'{self.kind} {name!r} is registered twice')
      self._entries[name] = value
      self._defaults[name] = copy.deepcopy({**self._common, **dict(defaults or {})})
      self._checks[name] = check
      self._meta[name] = dict(meta)
      return value
    return decorator

  def unregister(self, name: str) -> None:
    """Removes an entry (tests that register toy entries clean up with this)."""
    self.get(name)
    for table in (self._entries, self._defaults, self._checks, self._meta):
      del table[name]

  def get(self, name: str, field: str = '') -> T:
    if name not in self._entries:
      where = f'{field}: ' if field else ''
      raise ValueError(f'{where}unknown {self.kind} {name!r}; choose from {self.names()}')
    return self._entries[name]

  def defaults(self, name: str) -> ml_collections.ConfigDict:
    """A fresh ConfigDict of the entry's default config fields."""
    self.get(name)
    return ml_collections.ConfigDict(copy.deepcopy(self._defaults[name]))

  def meta(self, name: str) -> dict:
    self.get(name)
    return self._meta[name]

  def check(self, name: str, section: ml_collections.ConfigDict, where: str,
            run_check: bool = True, known_fields_only: bool = True) -> None:
    """Raises ValueError for a field of ``section`` (config path ``where``) that the
    entry does not define (``known_fields_only``), then runs the entry's own
    ``check(section)`` (``run_check``)."""
    self.get(name)
    if known_fields_only:
      check_fields(section, self._defaults[name], where)
    if run_check and self._checks[name] is not None:
      self._checks[name](section)

  def names(self):
    return sorted(self._entries)

  def __contains__(self, name: str) -> bool:
    return name in self._entries


def require(condition: bool, field: str, message: str) -> None:
  """Raises ValueError('config.<field>: <message>') unless ``condition`` (every config
  check of the library reports this way)."""
  if not condition:
    raise ValueError(f'config.{field}: {message}')


def require_distinct(values, field: str, what: str = 'one run') -> None:
  """Refuses a tuple that names one run or column twice (``what``: what each entry
  stands for), naming ``config.<field>`` and the repeated values."""
  values = tuple(values)
  repeated = sorted({repr(v) for v in values if values.count(v) > 1})
  require(not repeated, field, f'names {", ".join(repeated)} more than once '
                               f'({list(values)}): each entry is {what}')


def check_fields(section: ml_collections.ConfigDict, defaults: Mapping[str, Any],
                 where: str) -> None:
  """Every field of ``section`` must be one of ``defaults`` (``where``: its config
  path, e.g. 'config.fedprox'); nested dicts in ``defaults`` are checked too."""
  for field in section.keys():
    if field not in defaults:
      raise ValueError(f'{where}.{field}: unknown field; {where} has '
                       f'{sorted(defaults) or "no fields"}')
    if isinstance(defaults[field], Mapping) and defaults[field] and \
        isinstance(section[field], (ml_collections.ConfigDict, Mapping)):
      check_fields(section[field], defaults[field], f'{where}.{field}')
