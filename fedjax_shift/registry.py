"""Name -> value registries that raise on unknown and duplicate names.

An entry may carry its config defaults (a method's hyperparameters with the paper's
values, a benchmark's section ``config.data.<name>``, a pipeline's sections), the
``ranges`` those fields may take (a ``Range`` per field, checked before anything compiles) and a
``check`` of its config section for what a range cannot say (one field against
another); ``fedjax_shift.config.base_config`` fills the config from the registries,
so adding a method, adapter, benchmark or pipeline is one file.

    ALGORITHMS.register('fedprox', defaults={'mu': 0.01}, ranges={'mu': NONNEGATIVE})

A variant of an entry (an ablation, a paper's second setting) registers only what it
changes: its section holds those fields, the others follow the entry's own section
(``section(name, sections)`` is what its builder reads), and its ranges and check are
the entry's unless it gives its own.

    ALGORITHMS.register('fedtta_prox', variant_of='fedtta', defaults={'mu': 0.01})
"""
from __future__ import annotations

import copy
import math
from typing import (Any, Callable, Dict, Generic, Iterator, List, Mapping, NamedTuple,
                    Optional, Tuple, TypeVar)

import ml_collections

T = TypeVar('T')


class Range(NamedTuple):
  """The values a config field may take. ``accepts(value)`` says whether ``value`` is
  one; ``description`` completes "must be ..." in the error; ``invalid`` is a value
  outside the range (the registry test sets each field to it and expects a refusal)."""
  description: str
  accepts: Callable[[Any], bool]
  invalid: Any


def _is_number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def interval(low: Optional[float] = None, high: Optional[float] = None, *,
             low_open: bool = False, high_open: bool = False, integer: bool = False,
             infinite: bool = False) -> Range:
  """Numbers in [low, high] (``low_open``/``high_open``: that end excluded; None: no
  bound); ``integer``: whole numbers only; ``infinite``: +inf allowed too. NaN never."""
  def accepts(value) -> bool:
    if not _is_number(value) or math.isnan(value):
      return False
    if math.isinf(value):
      return infinite and value > 0 and high is None
    if integer and value != int(value):
      return False
    if low is not None and (value < low or (low_open and value == low)):
      return False
    return high is None or (value < high or (not high_open and value == high))
  kind = 'an integer' if integer else 'a number'
  bounds = []
  if low is not None:
    bounds.append(f'{">" if low_open else ">="} {low:g}')
  if high is not None:
    bounds.append(f'{"<" if high_open else "<="} {high:g}')
  description = ' '.join([kind] + [' and '.join(bounds)] * bool(bounds)) + \
      (' (or inf)' if infinite else '')
  if low is not None:
    invalid = low - 1 if integer or not low_open else low
  elif high is not None:
    invalid = high + 1 if integer or not high_open else high
  else:
    invalid = float('nan')
  return Range(description, accepts, invalid)


def one_of(*choices) -> Range:
  """Exactly one of ``choices`` (strings or numbers)."""
  invalid = 'unknown' if all(isinstance(c, str) for c in choices) else -12345
  return Range(f'one of {list(choices)}', lambda value: value in choices, invalid)


def sequence_of(item: Range, min_length: int = 0) -> Range:
  """A tuple or list, at least ``min_length`` long, of values in ``item``."""
  def accepts(value) -> bool:
    return (isinstance(value, (tuple, list)) and len(value) >= min_length and
            all(item.accepts(v) for v in value))
  at_least = f'at least {min_length} ' if min_length else ''
  return Range(f'a tuple of {at_least}values each {item.description}', accepts,
               (item.invalid,) * max(min_length, 1))


def registered(registry: 'Registry') -> Range:
  """A name registered in ``registry`` (looked up when checked, so entries registered
  later count)."""
  return Range(f'a registered {registry.kind} name', lambda value: value in registry,
               'no_such_name')


POSITIVE = interval(0, low_open=True)
NONNEGATIVE = interval(0)
FRACTION = interval(0, 1)                      # [0, 1]
OPEN_FRACTION = interval(0, 1, low_open=True)  # (0, 1]
POSITIVE_INT = interval(1, integer=True)
NONNEGATIVE_INT = interval(0, integer=True)
BOOL = Range('True or False', lambda value: isinstance(value, bool), 'yes')
TEXT = Range('a string', lambda value: isinstance(value, str), 3)


def leaf_paths(tree: Mapping[str, Any], prefix: str = '') -> Iterator[Tuple[str, Any]]:
  """(dotted path, value) of every leaf of nested mappings (an empty mapping is a leaf)."""
  for key, value in tree.items():
    if isinstance(value, Mapping) and value:
      yield from leaf_paths(value, f'{prefix}{key}.')
    else:
      yield f'{prefix}{key}', value


class Registry(Generic[T]):
  """A named table of values (algorithms, models, benchmarks) for config lookup."""

  def __init__(self, kind: str):
    self.kind = kind
    self._entries: Dict[str, T] = {}
    self._defaults: Dict[str, dict] = {}   # the whole section, a variant's included
    self._own: Dict[str, dict] = {}        # what the config's section holds
    self._variant_of: Dict[str, Optional[str]] = {}
    self._ranges: Dict[str, Dict[str, Range]] = {}
    self._checks: Dict[str, Optional[Callable]] = {}
    self._meta: Dict[str, dict] = {}

  def register(self, name: str, defaults: Optional[Mapping[str, Any]] = None,
               check: Optional[Callable] = None,
               ranges: Optional[Mapping[str, Range]] = None,
               variant_of: Optional[str] = None, **meta) -> Callable[[T], T]:
    """Decorator. ``defaults``: the entry's config fields and their default values;
    ``ranges``: {dotted field path: Range}, a path naming a nested mapping covering
    each of its leaves; ``check(section)``: raises ValueError naming
    ``config.<field>`` on what ranges cannot say; ``variant_of``: a registered entry
    whose section this one follows, ``defaults`` holding only the fields it changes
    or adds (a default equal to the entry's is refused: it would be a copy), ``ranges``
    added to the entry's, ``check`` the entry's unless given; ``meta``: anything else
    the caller looks up with ``meta(name)`` (not inherited)."""
    own = copy.deepcopy(dict(defaults or {}))
    whole, declared = own, dict(ranges or {})
    if variant_of is not None:
      self.get(variant_of)
      parent = self._defaults[variant_of]
      copies = sorted(field for field, value in own.items()
                      if field in parent and parent[field] == value)
      if copies:
        raise ValueError(f'{self.kind} {name!r}, a variant of {variant_of!r}, registers '
                         f'{copies} at the values of {variant_of!r}: a variant holds only '
                         f'what it changes')
      whole = _merged(copy.deepcopy(parent), own)
      declared = {**self._ranges[variant_of], **declared}
      check = check if check is not None else self._checks[variant_of]

    def decorator(value: T) -> T:
      if name in self._entries:
        raise ValueError(f'{self.kind} {name!r} is registered twice')
      self._entries[name] = value
      self._defaults[name] = whole
      self._own[name] = own
      self._variant_of[name] = variant_of
      self._ranges[name] = declared
      self._checks[name] = check
      self._meta[name] = dict(meta)
      return value
    return decorator

  def unregister(self, name: str) -> None:
    """Removes an entry (tests that register toy entries clean up with this)."""
    self.get(name)
    for table in (self._entries, self._defaults, self._own, self._variant_of, self._ranges,
                  self._checks, self._meta):
      del table[name]

  def ranges(self, name: str) -> Dict[str, Range]:
    """{dotted field path: Range} the entry declared."""
    self.get(name)
    return dict(self._ranges[name])

  def range_of(self, name: str, path: str) -> Optional[Range]:
    """The declared range covering field ``path`` (its own or a parent mapping's)."""
    ranges = self._ranges[name]
    parts = path.split('.')
    for end in range(len(parts), 0, -1):
      if '.'.join(parts[:end]) in ranges:
        return ranges['.'.join(parts[:end])]
    return None

  def undeclared(self, name: str) -> List[str]:
    """The entry's default fields (dotted leaf paths) that no declared range covers."""
    self.get(name)
    return [path for path, _ in leaf_paths(self._defaults[name])
            if self.range_of(name, path) is None]

  def check_ranges(self, name: str, section: Mapping[str, Any], where: str) -> None:
    """Raises ValueError naming ``<where>.<field>`` for a value of ``section`` outside
    its declared range."""
    for path, value in leaf_paths(dict(_plain(section))):
      declared = self.range_of(name, path)
      if declared is not None and not declared.accepts(value):
        raise ValueError(f'{where}.{path}: must be {declared.description}, got {value!r}')

  def get(self, name: str, field: str = '') -> T:
    if name not in self._entries:
      where = f'{field}: ' if field else ''
      raise ValueError(f'{where}unknown {self.kind} {name!r}; choose from {self.names()}')
    return self._entries[name]

  def defaults(self, name: str) -> ml_collections.ConfigDict:
    """A fresh ConfigDict of the entry's whole default section (a variant's: its
    entry's with its changes)."""
    self.get(name)
    return ml_collections.ConfigDict(copy.deepcopy(self._defaults[name]))

  def own_defaults(self, name: str) -> ml_collections.ConfigDict:
    """A fresh ConfigDict of the fields the config's section of ``name`` holds (a
    variant's: only what it changes)."""
    self.get(name)
    return ml_collections.ConfigDict(copy.deepcopy(self._own[name]))

  def variant_of(self, name: str) -> Optional[str]:
    """The entry ``name`` is a variant of (None: an entry of its own)."""
    self.get(name)
    return self._variant_of[name]

  def section(self, name: str, sections: Mapping[str, Any]) -> ml_collections.ConfigDict:
    """The section ``name``'s builder reads from ``sections`` (the config, or its
    ``adapters``): ``sections[name]``, a variant's over its entry's (recursively), as a
    new ConfigDict; values are not copied (a swept tracer stays one)."""
    self.get(name)
    own = _plain(sections[name]) if name in sections else {}
    parent = self._variant_of[name]
    if parent is None:
      return ml_collections.ConfigDict(own)
    return ml_collections.ConfigDict(_merged(_plain(self.section(parent, sections)), own))

  def meta(self, name: str) -> dict:
    self.get(name)
    return self._meta[name]

  def check(self, name: str, section: ml_collections.ConfigDict, where: str,
            run_check: bool = True, known_fields_only: bool = True) -> None:
    """Raises ValueError for a field of ``section`` (config path ``where``) that the
    entry does not define (``known_fields_only``) or whose value is outside its declared
    range, then runs the entry's own ``check(section)`` (``run_check``)."""
    self.get(name)
    if known_fields_only:
      check_fields(section, self._defaults[name], where)
    self.check_ranges(name, section, where)
    if run_check:
      self.run_check(name, section)

  def run_check(self, name: str, section: Mapping[str, Any]) -> None:
    """The entry's own ``check(section)``, where it registered one."""
    self.get(name)
    if self._checks[name] is not None:
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


def _plain(section) -> dict:
  """``section`` (a ConfigDict or mapping) as nested plain dicts."""
  if hasattr(section, 'to_dict'):
    return section.to_dict()
  return {key: _plain(value) if isinstance(value, Mapping) else value
          for key, value in section.items()}


def _merged(base: dict, changes: Mapping[str, Any]) -> dict:
  """``base`` with ``changes`` written over it, nested mappings merged field by field."""
  out = dict(base)
  for key, value in changes.items():
    if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
      out[key] = _merged(out[key], value)
    else:
      out[key] = value
  return out
