"""FedICON (and FedTHE) (Tan, Zhuang, Lyu, Chen, Dong & Long, NeurIPS 2023): the table layouts (tables.py, registered by
name), the paper's own numbers (numbers.py) and README.md (protocol, results,
diagnosis)."""
from fedjax_shift.papers.fedicon import tables  # noqa: F401
