"""Test-time methods (``Adapter(init, step)``), one file each, looked up by name.

Each file exposes a constructor with explicit arguments (``tent(module, lr, …)``),
which ``register_constructor`` registers as it is: the section ``config.adapters.<name>``
is the signature's defaults, the papers' values, written once; ``from_context`` gives
the parameters a ``SourceContext`` holds (C, the test batch size, BBSE's confusion
matrix, ATP's learned α, EATA's source data for its Fisher), and a NamedTuple default
gives its fields (FedICON's ``ContrastiveTTA``). FedTTA's section, whose step size and
ε follow the trained method, registers ``build(module, hparams, context)`` with its
settings' defaults (``Adaptation``). A second setting of an
adapter registers as its variant, holding what it changes (FedTHE+ of FedTHE,
FedTTA++ of FedTTA). Adapters that keep test examples (RoTTA's and NOTE's memories)
take their shape from the context, and learn every F examples inside a batch
(``common.learn_every``); an adapter that skips batches says which (``took_step``:
SAR, PL, RoTTA, NOTE), and one that needs a stream of some length names the fields
that set it (``stream_floor``: NOTE's memory, a memory's update period), so a shorter
stream is refused before compiling. Adding an adapter: one file plus one import line
here.
"""
from fedjax_shift.adapters import (atp, bbse, bn_adapt, conjugate_pl, cotta, eata, em,  # noqa: F401
                                   fedicon, fedthe, fedtta, lame, memo, no_adapt, note, odpfl_hn,
                                   pseudo_label, rotta, sar, shot, surgical, t3a, tent)
from fedjax_shift.core.test_time import ADAPTERS, Adapter, SourceContext  # noqa: F401
