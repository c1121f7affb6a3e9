"""FedAvg (McMahan et al. 2017) on label-skewed clients, clean + corrupted tests.

Reproduces: the FedAvg rows of the FedTHE-style benchmark (20 clients, Dirichlet
0.1, per-client 60/20/20 splits, corrupted test split at severity 5) on the
embedded MNIST digits. About a minute per seed on 2 CPU cores.

    python launch/train.py --config=configs/fedavg.py:mnist_dir0.1 --workdir=/tmp/fedavg

Variants (comma-separated): <source>_dir<alpha> | <source>_iid | <source>_path<k>
with source in mnist, uci (embedded), fashion_mnist (the full 70,000 images of
Debian's dataset-fashion-mnist, offline; or data.data_dir's IDX files) or cifar10, emnist
(TFDS);
'tiny' (seconds), 'quick' (one seed, 10 rounds).
"""
from fedjax_shift.config import apply_variant, base_config


def get_config(arg=None):
  config = base_config()
  config.algorithms = ('fedavg',)
  return apply_variant(config, arg)
