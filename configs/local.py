"""Local: each client trains alone (no communication); personalised eval only.

    python launch/train.py --config=configs/local.py:mnist_dir0.1 --workdir=/tmp/local
"""
from fedjax_shift.config import apply_variant, base_config


def get_config(arg=None):
  config = base_config()
  config.algorithms = ('local',)
  return apply_variant(config, arg)
