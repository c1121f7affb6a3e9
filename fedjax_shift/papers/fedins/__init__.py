"""FedIns (Feng, Yu, Liu, Xu, Khan & Zuo, ICCV 2023): the table layouts (tables.py, registered by
name), the paper's own numbers (numbers.py) and README.md (protocol, results,
diagnosis)."""
from fedjax_shift.papers.fedins import tables  # noqa: F401
