"""Test-time methods (``Adapter(init, step)``), one file each, looked up by name.

Each file exposes a constructor with explicit arguments (``tent(module, lr, …)``)
and registers ``build(module, hparams, context) -> Adapter`` in
``core.test_time.ADAPTERS`` with its paper's defaults; ``hparams`` is the method's
section ``config.adapters.<name>`` and ``context`` a ``SourceContext`` (the global
model, labelled source held-out examples for EATA's Fisher and BBSE's confusion
matrix, ATP's learned α). Adding an adapter: one file plus one import line here.
"""
from fedjax_shift.adapters import (atp, bbse, bn_adapt, eata, em, fedicon, fedthe, fedtta, memo,  # noqa: F401
                                   no_adapt, odpfl_hn, shot, surgical, t3a, tent)
from fedjax_shift.core.test_time import ADAPTERS, Adapter, SourceContext  # noqa: F401
