"""Name -> value registries that raise on unknown and duplicate names."""
from __future__ import annotations

from typing import Callable, Dict, Generic, TypeVar

T = TypeVar('T')


class Registry(Generic[T]):
  """A named table of values (algorithms, models, benchmarks) for config lookup."""

  def __init__(self, kind: str):
    self.kind = kind
    self._entries: Dict[str, T] = {}

  def register(self, name: str) -> Callable[[T], T]:
    def decorator(value: T) -> T:
      if name in self._entries:
        raise ValueError(f'{self.kind} {name!r} is registered twice')
      self._entries[name] = value
      return value
    return decorator

  def get(self, name: str, field: str = '') -> T:
    if name not in self._entries:
      where = f'{field}: ' if field else ''
      raise ValueError(f'{where}unknown {self.kind} {name!r}; choose from {self.names()}')
    return self._entries[name]

  def names(self):
    return sorted(self._entries)

  def __contains__(self, name: str) -> bool:
    return name in self._entries
