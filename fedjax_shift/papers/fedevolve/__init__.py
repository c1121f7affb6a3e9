"""fedevolve: its table layouts (tables.py), the paper's numbers (numbers.py); README.md."""
from fedjax_shift.papers.fedevolve import tables  # noqa: F401
