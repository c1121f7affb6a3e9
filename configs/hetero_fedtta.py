"""HeteroFedTTA (Ye et al., UPFL 2023 Sec. 3.4, Algorithm 2; Sec. 4.6, Fig. 5): FedTTA across
clients of three architectures (small / medium / big: MLPs by default, App. G Table 3's
LeNet-5 CNNs in the `lenet5` variant; each with its adaptation model), knowledge
exchanged as logits on a public unlabelled set, distilled with Eq. 14.

    python launch/train.py --config=configs/hetero_fedtta.py --workdir=/tmp/hetero
    python launch/train.py --config=configs/hetero_fedtta.py:lambda_sweep --workdir=/tmp/hetero_sweep

Protocol: the FedTTA UPFL split (configs/fedtta.py: embedded MNIST, 100 clients,
pathological 2 classes each, 50 % new clients, 85 : 15), every training client in every
round, τ = 20 local iterations of batch 64; η_inner 0.5, η_outer 0.1, η_adapt 0.005
(Sec. 4.6); the architectures assigned to clients in turn over a random order (App. G:
"with equal probability"). Public set: 500 of the 5,000 embedded digits, held out of every
client before partitioning (their labels unused); `data.upfl.public_source='uci_digits'` draws
it from the UCI digits instead (another writer population; measured: the ensemble's
knowledge collapses there: fedjax_shift/papers/fedtta/README.md). Fig. 5 plots CIFAR-10 test accuracy per
round for λ ∈ {0, 0.2, …, 1} (the `lambda_sweep` variant) next to heterogeneous TENT
(not built here); results.md has one row per λ, mean ± std over seeds.

Where we differ: the paper's architectures (App. G Table 3) are LeNet-5 CNNs, conv
16/32, 32/64 and 64/128 → MLP(512) → MLP(10), on CIFAR-10; by default small / medium /
big here are MLPs of 100 / 200 / 400 hidden units (two layers), cheap on a CPU, with
Table 3's g of 32 / 64 / 128; the `lenet5` variant uses Table 3's CNNs
(hetero_fedtta.base_model). The digest and new-client digest step counts are not given
(10 and 100 here); (ψ, φ) are stepped by the authors' meta-optimizer as in FedTTA
(configs/fedtta.py: each group clipped at global norm 10, momentum 0.9 on φ, weight
decay 1e-4; hetero_fedtta.clip_groups='joint' with adapt_momentum=0 and weight_decay=0
is one joint clip and plain SGD, which grows the ensemble's knowledge faster on this
split: fedjax_shift/papers/fedtta/README.md); 50 rounds. Each new client's distance from its initialisation
after digesting (ψ and g, relative) is recorded as new_clients/base_drift and
new_clients/adaptation_drift.

Variants: lambda_sweep (λ = 0, 0.2, …, 1), lenet5 (Table 3's CNNs), tiny, quick.
"""
import ml_collections

from fedjax_shift.config import apply_variant, base_config


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  c = base_config()
  c.pipeline = 'hetero'               # pipelines/hetero.py: the grouped round
  c.algorithms = ('hetero_fedtta',)
  c.data.benchmark = 'upfl'           # as configs/fedtta.py
  c.data.source = 'mnist_embedded'
  c.data.partition = 'pathological'
  c.data.classes_per_client = 2
  c.data.num_clients = 100
  c.data.upfl.public_source = 'holdout'   # D_p: digits held out of every client, labels
  c.data.upfl.public_examples = 500       # unused (10 % of the 5,000; the clients share
                                          # the rest)
  c.cohort_size = 50                  # every training client, every round
  c.weighting = 'uniform'             # Alg. 2: F = 1/N Σ_i f(D_p; ψ_i)
  c.rounds = 50
  c.model = ml_collections.ConfigDict({'name': 'mlp'})   # widths from hetero_fedtta.sizes
  c.client.optimizer = 'sgd'
  c.client.learning_rate = 0.1        # η_outer (Sec. 4.6)
  c.client.batch_size = 64
  c.client.local_steps = 20           # τ = 20
  c.client.local_epochs = 0
  c.eval_adapter_batch_size = 64      # a new client's ~50 examples: one adaptation batch
  c.eval_every = 10
  c.on_divergence = 'continue'
  return apply_variant(c, arg, VARIANTS, USAGE)


def _lambda_sweep(c: ml_collections.ConfigDict, match) -> None:
  c.hetero.kd_lambdas = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)   # Sec. 4.6


def _lenet5(c: ml_collections.ConfigDict, match) -> None:
  c.hetero_fedtta.base_model = 'lenet5'   # App. G Table 3: conv 5x5 → MLP(512) → MLP(10)


def _tiny(c: ml_collections.ConfigDict, match) -> None:
  c.data.num_clients = 12
  c.cohort_size = 6
  c.client.local_steps = 2
  c.data.upfl.public_examples = 40
  c.hetero_fedtta.public_batch_size = 20
  c.hetero_fedtta.digest_steps = 2
  c.hetero_fedtta.new_client_digest_steps = 3


VARIANTS = (('tiny', _tiny), ('lambda_sweep', _lambda_sweep), ('lenet5', _lenet5))
USAGE = 'lambda_sweep (Sec. 4.6), lenet5 (App. G Table 3)'
