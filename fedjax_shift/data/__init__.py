"""Federated data: sources, shifts, partitions, the compact ClientStore of a population and
the padded FederatedData layout of a cohort."""
from fedjax_shift.data.federated import (FederatedData, FederatedDataset, partition_statistics,
                                         split_clients, stack_clients, validate)
from fedjax_shift.data import corruptions, partitions, sources, store
from fedjax_shift.data.store import ClientStore
