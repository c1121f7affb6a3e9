"""FedTTA and HeteroFedTTA (Ye, Chen, Wang, Li & Gao, arXiv 2023): the table layouts (tables.py, registered by
name), the paper's own numbers (numbers.py) and README.md (protocol, results,
diagnosis)."""
from fedjax_shift.papers.fedtta import tables  # noqa: F401
