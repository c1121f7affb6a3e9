"""Training methods, one file each, looked up by name (``config.algorithms``).

Each file registers its builder in ``base.ALGORITHMS`` with its hyperparameters'
defaults (the paper's values, cited): ``builder(hparams, context) -> FederatedAlgorithm``
where ``hparams`` is the method's section ``config.<name>`` and ``context`` a
``base.BuildContext`` (module, optimizers, local schedule, benchmark info).
``base.build(name, config, module, max_examples, info)`` builds one from a config.
An ablation registers as a variant (``variant_of=``) holding only the fields it
changes; its builder reads ``ALGORITHMS.section(name, config)``, the method's section
with those changes (fedicon.py's variants, fedins.py's, fedtta.py's FedTTA-Prox).
Adding a method: one file plus one import line here.
"""
from fedjax_shift.algorithms import (afl, apfl, atp, ditto, fedadg, fedavg, fedavg_ft,  # noqa: F401
                                     fedbn, feddc, fedevolve, fedevp, fedicon, fedins, fedprox,
                                     fedrep, fedrod, fedsr, fedthe, fedtta, gma, hetero_fedtta,
                                     local, moon, odpfl_hn, qffl, scaffold)
from fedjax_shift.algorithms.base import ALGORITHMS, BuildContext, build  # noqa: F401
