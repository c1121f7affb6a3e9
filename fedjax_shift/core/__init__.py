"""The engine: algorithm protocol, compiled round, local training, evaluation."""
from fedjax_shift.core.algorithm import ClientData, ClientOutput, FederatedAlgorithm
from fedjax_shift.core.local import LocalSchedule, local_train
from fedjax_shift.core.round import (HostStore, RoundConfig, build_round, client_mesh,
                                     round_key, sample_cohort, stack_client_states)
