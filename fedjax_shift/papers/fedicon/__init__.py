"""fedicon: its table layouts (tables.py), the paper's numbers (numbers.py); README.md."""
from fedjax_shift.papers.fedicon import tables  # noqa: F401
