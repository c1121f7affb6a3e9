"""Named benchmark protocols, one file each, registered in ``base.BENCHMARKS``
(``config.data.benchmark``): which data, shift, partition and splits a run uses.
``config.data`` holds the fields every benchmark reads and one section of each
benchmark's own (``config.data.<benchmark>.<field>``); ``build_benchmark(config.data,
seed)`` checks and builds the chosen one from ``data_view`` (the two, flat).
Adding a benchmark: one file plus one import line here.
"""
from fedjax_shift.benchmarks import (atp_shift, digit_domains, evolving,  # noqa: F401
                                     label_skew, mixed_domains, small_clients,
                                     tta_corruptions, upfl)
from fedjax_shift.benchmarks.base import (BENCHMARKS, DATA_DEFAULTS,  # noqa: F401
                                          EMBEDDED_SOURCES, PARTITIONS, Benchmark,
                                          build_benchmark, check_data, data_sections,
                                          data_view, load_source, nested_data,
                                          sections_with)
