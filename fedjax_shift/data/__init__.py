"""Federated data: sources, shifts, partitions and the stacked FederatedData layout."""
from fedjax_shift.data.federated import (FederatedData, FederatedDataset, partition_statistics,
                                         split_clients, stack_clients, validate)
from fedjax_shift.data import corruptions, partitions, sources
