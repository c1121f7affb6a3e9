"""Each paper this library reproduces, one folder each: its table layouts registered
by name (``report.PAPER_TABLES``), the paper's own numbers printed beside ours, its
probes, and a README with its protocol, results and diagnosis. The library under
these folders knows no paper by name. Adding a paper: one folder plus one import line
here.
"""
from fedjax_shift.papers import atp, fedevolve, fedicon, fedins, fedtta  # noqa: F401
