"""Training methods, looked up by name (``config.algorithm``).

Each entry is ``builder(config, module, max_examples) -> FederatedAlgorithm``.
"""
from fedjax_shift.algorithms.apfl import apfl
from fedjax_shift.algorithms.ditto import ditto
from fedjax_shift.algorithms.fedavg import fedavg
from fedjax_shift.algorithms.fedavg_ft import fedavg_ft
from fedjax_shift.algorithms.fedbn import fedbn
from fedjax_shift.algorithms.fedevolve import fedevolve
from fedjax_shift.algorithms.fedevp import fedevp
from fedjax_shift.algorithms.fedprox import fedprox
from fedjax_shift.algorithms.fedrep import fedrep
from fedjax_shift.algorithms.fedrod import fedrod
from fedjax_shift.algorithms.fedsr import fedsr
from fedjax_shift.algorithms.gma import gma
from fedjax_shift.algorithms.local import local
from fedjax_shift.algorithms.qffl import qffl
from fedjax_shift.registry import Registry

ALGORITHMS: Registry = Registry('algorithm')
for _name, _builder in [('fedavg', fedavg), ('fedprox', fedprox), ('fedbn', fedbn),
                        ('fedavg_ft', fedavg_ft), ('local', local), ('qffl', qffl),
                        ('fedevolve', fedevolve), ('fedevp', fedevp),
                        ('ditto', ditto), ('fedrep', fedrep), ('apfl', apfl),
                        ('fedrod', fedrod), ('gma', gma), ('fedsr', fedsr)]:
  ALGORITHMS.register(_name)(_builder)
