"""The test-time adaptation benchmark: every test-time adapter (BN-Adapt, Tent, EATA,
SHOT-IM, T3A, MEMO, LAME, PL, conjugate PL, SAR, CoTTA, RoTTA, NOTE; each at its own
paper's defaults, config.adapters) on a source model, under the 15 corruptions of
CIFAR-10-C at severity 5, episodic and online, on an i.i.d. test stream at batch 64,
16, 4 and 1 and on a label-shifted one (classes in time order, Dirichlet γ = 0.1) at
batch 64: TTAB's stresses (Zhao et al., ICML 2023) and Alfarra et al.'s method set
(ICML 2024); and Alfarra et al.'s time-limited i.i.d. stream at batch 64, where a method
of cost C (its time per batch over a forward pass) adapts on every ⌈C⌉-th batch. Each cell: accuracy averaged over the corruptions and on the worst one,
over seeds, and the milliseconds per test batch.

    python launch/train.py --config=configs/tta_bench.py --workdir=/tmp/tta_bench
    python launch/report.py --kind=tta_bench --workdirs=/tmp/tta_bench

Variants (``--config=configs/tta_bench.py:<variant>[,<more>]``):
  digits     (default) the embedded MNIST digits: 4,000 training images, 1,000 test
             images under every corruption
  fmnist     the full Fashion-MNIST (Debian's dataset-fashion-mnist, offline): its
             60,000 training and 10,000 test images
  federated  the source model trained by FedAvg over 20 clients, Dirichlet 0.1, instead
             of centrally (one client)
  cnn        the ATP CNN instead of the CPU-sized BatchNorm MLP
  quick      one seed, 10 rounds, the i.i.d. stream at batch 64 and 1 and the
             label-shifted one
  tiny       seconds: 24 test images, 3 corruptions, small memories (tests)

The source model trains centrally by default (one client holding every training
image, SGD 0.1, batch 64, one epoch a round for 20 rounds), as the TTA benchmarks
train theirs; the model is a BatchNorm MLP (784-200-200-10) so that every row × stream
× seed finishes on a 2-core CPU.
"""
import ml_collections

from fedjax_shift.config import apply_variant, base_config


def get_config(arg: str = 'digits') -> ml_collections.ConfigDict:
  c = base_config()
  c.pipeline = 'tta_bench'
  c.paper_tables = 'tta_bench'       # launch/train.py prints the benchmark's table
  c.algorithms = ('fedavg',)
  c.data.benchmark = 'tta_corruptions'   # fields: fedjax_shift/benchmarks/tta_corruptions.py
  c.data.source = 'mnist_embedded'
  c.data.num_clients = 1             # a centrally trained source model
  c.data.partition = 'iid'
  c.cohort_size = 1
  c.rounds = 20                      # epochs: one client, one local epoch a round
  c.client.learning_rate = 0.1
  c.client.batch_size = 64
  c.client.local_epochs = 1
  c.eval_every = 20
  c.checkpoint_every = 20
  c.model.name = 'bn_mlp'
  c.model.hidden = (200, 200)
  return apply_variant(c, arg, VARIANTS, USAGE)


def _digits(c: ml_collections.ConfigDict, match) -> None:
  del c, match


def _fmnist(c: ml_collections.ConfigDict, match) -> None:
  c.data.source = 'fashion_mnist'
  c.data.tfds_split = 'train'
  c.data.tta_corruptions.test_split = 'test'


def _federated(c: ml_collections.ConfigDict, match) -> None:
  c.data.num_clients = 20
  c.data.partition = 'dirichlet'
  c.data.dirichlet_alpha = 0.1
  c.cohort_size = 20


def _cnn(c: ml_collections.ConfigDict, match) -> None:
  c.model = ml_collections.ConfigDict({'name': 'atp_cnn'})
  c.engine.unroll = True


def _quick(c: ml_collections.ConfigDict, match) -> None:
  c.seeds = (0,)          # and 10 rounds (the shared quick)
  c.tta_bench.iid_batch_sizes = (64, 1)


def _tiny(c: ml_collections.ConfigDict, match) -> None:
  c.seeds = (0,)
  c.data.num_clients = c.cohort_size = 1   # still one client (the shared tiny sets 6)
  c.rounds = 2
  c.eval_every = c.checkpoint_every = 2
  c.model.hidden = (16,)
  bench = c.data.tta_corruptions
  bench.test_examples = 24
  bench.corruptions = ('gaussian_noise', 'fog', 'contrast')
  c.tta_bench.iid_batch_sizes = (8, 1)
  c.tta_bench.label_shift_batch_sizes = (8,)
  c.tta_bench.time_limited_batch_sizes = (8,)
  c.tta_bench.source_examples = 32
  c.adapters.memo.num_augmentations = 2
  c.adapters.eata.fisher_samples = 16
  c.adapters.cotta.num_augmentations = 2
  c.adapters.rotta.memory_size = 10     # one place per class at least
  c.adapters.note.memory_size = 6
  c.adapters.rotta.update_frequency = c.adapters.note.update_frequency = 8


VARIANTS = (('digits', _digits), ('fmnist', _fmnist), ('federated', _federated),
            ('cnn', _cnn), ('quick', _quick), ('tiny', _tiny))
USAGE = 'digits, fmnist, federated, cnn, quick, tiny'
