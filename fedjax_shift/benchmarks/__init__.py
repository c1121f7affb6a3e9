"""Named benchmark protocols, one file each, registered in ``base.BENCHMARKS``
(``config.data.benchmark``): which data, shift, partition and splits a run uses.
Adding a benchmark: one file plus one import line here.
"""
from fedjax_shift.benchmarks import (atp_shift, digit_domains, evolving,  # noqa: F401
                                     label_skew, mixed_domains, small_clients, upfl)
from fedjax_shift.benchmarks.base import (BENCHMARKS, DATA_DEFAULTS,  # noqa: F401
                                          EMBEDDED_SOURCES, PARTITIONS, Benchmark, load_source)
