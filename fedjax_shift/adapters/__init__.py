"""Test-time methods (``Adapter(init, step)``), one file each, looked up by name.

Each file exposes a constructor with explicit arguments (``tent(module, lr, …)``).
Where those arguments are the method's config fields, or fields and what the source
context gives (bbse, em, memo, no_adapt, odpfl_hn, shot, t3a, tent),
``register_constructor`` registers it as it is: the section ``config.adapters.<name>``
is the signature's defaults, the papers' values, written once (``from_context``: C,
BBSE's confusion matrix). The others register ``build(module, hparams, context) ->
Adapter`` in ``core.test_time.ADAPTERS`` with their paper's defaults, ``hparams``
being the section and ``context`` a ``SourceContext`` (the global model, labelled
source held-out examples for EATA's Fisher, ATP's learned α). A second setting of an
adapter registers as its variant, holding what it changes (FedTHE+ of FedTHE,
FedTTA++ of FedTTA). Adding an adapter: one file plus one import line here.
"""
from fedjax_shift.adapters import (atp, bbse, bn_adapt, eata, em, fedicon, fedthe, fedtta, memo,  # noqa: F401
                                   no_adapt, odpfl_hn, shot, surgical, t3a, tent)
from fedjax_shift.core.test_time import ADAPTERS, Adapter, SourceContext  # noqa: F401
