"""FedProx (Li et al., MLSys 2020): FedAvg + (μ/2)‖w − w_global‖².

μ = 0.01 as in ATP Table 7's FedProx global model.

    python launch/train.py --config=configs/fedprox.py:mnist_dir0.1 --workdir=/tmp/fedprox
"""
from fedjax_shift.config import apply_variant, base_config


def get_config(arg=None):
  config = base_config()
  config.algorithms = ('fedprox',)
  config.fedprox.mu = 0.01  # ATP Table 7
  return apply_variant(config, arg)
