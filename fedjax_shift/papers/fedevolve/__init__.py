"""FedEvolve and FedEvp ("Federated Learning under Evolving Distribution Shifts", anonymous, 2024): the table layouts (tables.py, registered by
name), the paper's own numbers (numbers.py) and README.md (protocol, results,
diagnosis)."""
from fedjax_shift.papers.fedevolve import tables  # noqa: F401
