"""FedAvg-FT: FedAvg then one epoch of local fine-tuning per client (personalised).

    python launch/train.py --config=configs/fedavg_ft.py:mnist_dir0.1 --workdir=/tmp/fedavg_ft
"""
from fedjax_shift.config import apply_variant, base_config


def get_config(arg=None):
  config = base_config()
  config.algorithms = ('fedavg_ft',)
  config.fedavg_ft.epochs = 1  # one epoch of local fine-tuning
  return apply_variant(config, arg)
