"""Every registered hyperparameter declares its range, and a value outside it is refused
before anything compiles, naming the field."""
import copy
import math

import ml_collections
import pytest

import fedjax_shift.config  # noqa: F401  (registers every entry)
from fedjax_shift import registry
from fedjax_shift.algorithms.base import ALGORITHMS
from fedjax_shift.benchmarks.base import BENCHMARKS
from fedjax_shift.core.test_time import ADAPTERS
from fedjax_shift.pipelines.base import PIPELINES

REGISTRIES = {'algorithm': (ALGORITHMS, 'config.{name}'),
              'adapter': (ADAPTERS, 'config.adapters.{name}'),
              'benchmark': (BENCHMARKS, 'config.data'),
              'pipeline': (PIPELINES, 'config')}


def entries():
  for kind, (table, where) in REGISTRIES.items():
    for name in table.names():
      yield pytest.param(table, name, where.format(name=name), id=f'{kind}-{name}')


def declared_fields():
  for kind, (table, where) in REGISTRIES.items():
    for name in table.names():
      for path, _ in registry.leaf_paths(dict(table.defaults(name).to_dict())):
        yield pytest.param(table, name, where.format(name=name), path,
                           id=f'{kind}-{name}-{path}')


@pytest.mark.parametrize('table, name, where', list(entries()))
def test_every_field_declares_its_range_and_its_default_is_inside(table, name, where):
  assert table.undeclared(name) == [], f'{where}: fields without a declared range'
  table.check_ranges(name, table.defaults(name), where)   # the defaults pass


@pytest.mark.parametrize('table, name, where, path', list(declared_fields()))
def test_a_value_outside_the_range_is_refused_naming_the_field(table, name, where, path):
  section = table.defaults(name).to_dict()
  node = section
  *parents, leaf = path.split('.')
  for key in parents:
    node = node[key]
  declared = table.range_of(name, path)
  node[leaf] = copy.deepcopy(declared.invalid)
  with pytest.raises(ValueError, match=f'{where}.{path}: must be'.replace('.', r'\.')):
    table.check_ranges(name, ml_collections.ConfigDict(section), where)


@pytest.mark.parametrize('declared, inside, outside', [
    (registry.POSITIVE, (1e-9, 3, 1e9), (0, -1.0, math.inf, math.nan, True, '1')),
    (registry.FRACTION, (0, 0.5, 1), (-0.1, 1.01, math.nan)),
    (registry.POSITIVE_INT, (1, 7), (0, 1.5, -2)),
    (registry.interval(0, infinite=True), (0, math.inf), (-1, -math.inf, math.nan)),
    (registry.interval(0, 1, high_open=True), (0, 0.999), (1, -0.5)),
    (registry.one_of('sgd', 'adam'), ('sgd',), ('Adam', 1)),
    (registry.sequence_of(registry.POSITIVE_INT, 1), ((1, 2), [3]), ((), (0,), 3)),
    (registry.BOOL, (True, False), (1, 'yes')),
    (registry.TEXT, ('', 'x'), (3, None)),
])
def test_ranges_accept_and_refuse_by_their_description(declared, inside, outside):
  for value in inside:
    assert declared.accepts(value), (declared.description, value)
  for value in outside:
    assert not declared.accepts(value), (declared.description, value)
  assert not declared.accepts(declared.invalid)


def test_an_adapter_rate_out_of_range_stops_the_run_before_training(tmp_path):
  """Gradient ascent labelled Tent: refused by validation, before any data is built."""
  from configs import atp as atp_config
  from fedjax_shift import pipelines
  config = atp_config.get_config('tiny')
  config.adapters.tent.learning_rate = -1.0
  with pytest.raises(ValueError, match=r'config\.adapters\.tent\.learning_rate: must be'):
    pipelines.validate(config, str(tmp_path))
