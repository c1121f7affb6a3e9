"""Test-time methods (``Adapter(init, step)``), one file each.

Registered so far: no_adapt, bn_adapt, tent. The rest of the ATP suite (EATA, SHOT,
T3A, MEMO, EM, BBSE, Surgical, ATP) is not written yet.
"""
from fedjax_shift.adapters.bn_adapt import bn_adapt, prior_weight
from fedjax_shift.adapters.no_adapt import no_adapt
from fedjax_shift.adapters.tent import tent
from fedjax_shift.registry import Registry

ADAPTERS: Registry = Registry('adapter')
for _name, _builder in [('no_adapt', no_adapt), ('bn_adapt', bn_adapt), ('tent', tent)]:
  ADAPTERS.register(_name)(_builder)
