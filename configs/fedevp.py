"""FedEvp alone (FedEvolve paper Sec. 4.2); variants as configs/fedevolve.py.

    python launch/train.py --config=configs/fedevp.py:circle_dirinf --workdir=/tmp/fedevp
"""
from configs import fedevolve


def get_config(arg: str = 'rmnist_dirinf'):
  config = fedevolve.get_config(arg)
  config.algorithms = ('fedevp',)
  return config
