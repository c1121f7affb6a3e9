"""FedBN (Li et al., ICLR 2021): BatchNorm layers stay local; personalised eval.

Needs a model with BatchNorm: the ATP CNN on 32x32 inputs.

    python launch/train.py --config=configs/fedbn.py:mnist_dir0.1 --workdir=/tmp/fedbn
"""
from fedjax_shift.config import apply_variant, base_config


def get_config(arg=None):
  config = base_config()
  config.algorithms = ('fedbn',)
  config.model.name = 'atp_cnn'
  config.data.image_size = 32
  config.engine.unroll = True  # convolutions in rolled scans are ~11x slower on XLA:CPU
  return apply_variant(config, arg)
