"""ATP (Bao et al., NeurIPS 2023) and the test-time baselines of its Table 1, as one pipeline:
FedAvg pretraining on the source clients → α training (Algorithm 1) → every
adapter on the target clients → Table 1 (rows × shifts), Table 3 (α trained on
one shift, tested on another) and the learned α per module (Figure 4).

Variants (``--config=configs/atp.py:<variant>[,<more>]``):
  digits_feature | digits_label | digits_hybrid   one shift on the embedded MNIST digits
  digits                                          all three shifts (+ Table 3)
  fmnist_feature | fmnist_label | fmnist_hybrid | fmnist
        the digits protocol on the full Fashion-MNIST (70,000 images, Debian's
        dataset-fashion-mnist, offline): every client's images distinct, which 5,000
        digits cannot give; not the paper's dataset (CIFAR-10-C)
  cifar10c_feature | cifar10c_label | cifar10c_hybrid | cifar10c
        the paper's protocol on TFDS cifar10 (+ cifar10_corrupted for the targets)
  cnn        the ATP CNN instead of the CPU-sized BN-MLP on digits
  resnet18   Table 1's model: torchvision's ResNet-18 (7x7 stem, max-pool), FedAvg lr
             0.01, α 200 rounds (the release's *_resnet18.sh). The paper starts it from
             ImageNet weights: set --config.backbone.weights=<torchvision ResNet-18 .npz>
             (models/torchvision_resnet.py says how to write one); without it the
             model starts from a random initialisation. Use with cifar10c[_<shift>].
  fedprox | qffl   the pretraining algorithm of ATP Table 7
  learned    adds the learned-rates rows: Tent with one learned rate per BN
             layer, BN-Adapt with a learned prior strength, ATP-online with α trained
             through K online batches (config.learned; adapters/learned_rates.py)
  tta_baselines  adds the rows of the TTA benchmarks' baselines: SAR, CoTTA, RoTTA,
             NOTE, LAME, PL, conjugate PL (each at its own paper's defaults)
  time_limited   every online row that can also runs on the time-limited stream of
             Alfarra et al. (ICML 2024), C = 2 batches revealed per adapted one
             (config.tta.stream_rows, stream_rate): a table beside Table 1; name it
             after the row variants (tta_baselines,time_limited)
  quick      one seed, 40 pretraining / 40 α rounds
  tiny       seconds: 12 source / 4 target clients, 2 rounds each (tests)

What the digits protocol scales, and why: the paper's clients, sizes, rounds and
cohort are kept (240 source × 160 + 40, 60 target × 200, FedAvg 200 rounds, α 400
rounds, cohort 60); 5,000 embedded MNIST digits cannot give 60,000 distinct
images, so 4,000 feed the source clients and 1,000 (disjoint) the targets, and a
base image recurs at several clients (under different corruptions and severities;
counted in partition info). The model is a BatchNorm MLP (784-200-200-10, 14 ATP
modules) so that 3 shifts × 3 seeds finish on a 2-core CPU; ``cnn`` selects the
paper's ATP CNN (23 modules) at 28×28.
"""
import ml_collections

from fedjax_shift.benchmarks.atp_shift import SHIFTS
from fedjax_shift.adapters import ADAPTERS
from fedjax_shift.config import apply_variant, base_config

# ATP Table 1's rows in order: (key, label, adapter, test-time mode). Each adapter's
# hyperparameters (its paper's defaults) and the α training settings are the registered
# defaults: fedjax_shift/adapters/<name>.py (config.adapters), algorithms/atp.py
# (config.atp) and pipelines/atp.py (config.tta, config.learned).
TABLE1_ROWS = (('no_adapt', 'No adaptation', 'no_adapt', 'episodic'),
               ('bn_adapt', 'BN-Adapt', 'bn_adapt', 'episodic'),
               ('shot', 'SHOT', 'shot', 'online'),
               ('tent', 'Tent', 'tent', 'online'),
               ('eata', 'EATA', 'eata', 'online'),
               ('t3a', 'T3A', 't3a', 'online'),
               ('memo', 'MEMO', 'memo', 'episodic'),
               ('em', 'EM', 'em', 'episodic'),
               ('bbse', 'BBSE', 'bbse', 'episodic'),
               ('surgical', 'Surgical', 'surgical', 'online'),
               ('atp_batch', 'ATP-batch', 'atp', 'episodic'),
               ('atp_online', 'ATP-online', 'atp', 'online'))
# Further rows (variant tta_baselines): the baselines of the TTA benchmarks (TTAB, Zhao
# et al., ICML 2023; Alfarra et al., ICML 2024), each at its own paper's defaults.
TTA_BASELINE_ROWS = (('sar', 'SAR', 'sar', 'online'),
                     ('cotta', 'CoTTA', 'cotta', 'online'),
                     ('rotta', 'RoTTA', 'rotta', 'online'),
                     ('note', 'NOTE', 'note', 'online'),
                     ('lame', 'LAME', 'lame', 'episodic'),
                     ('pl', 'PL', 'pl', 'online'),
                     ('conjugate_pl', 'Conjugate PL', 'conjugate_pl', 'online'))
# time_limited: the online rows that can also run on the time-limited stream
# (config.tta.stream_rows), at C batches revealed per adapted batch.
STREAM_RATE = 2.0


def get_config(arg: str = 'digits_hybrid') -> ml_collections.ConfigDict:
  c = base_config()
  c.pipeline = 'atp'
  c.paper_tables = 'atp'             # launch/train.py prints Tables 1 and 3 beside the paper's
  c.tta.rows = tuple(key for key, _, _, _ in TABLE1_ROWS)   # drop keys to skip methods
  every_row = TABLE1_ROWS + TTA_BASELINE_ROWS
  c.tta.label = {key: label for key, label, _, _ in every_row}
  c.tta.adapter = {key: adapter for key, _, adapter, _ in every_row}
  c.tta.mode = {key: mode for key, _, _, mode in every_row}
  c.algorithms = ('fedavg',)          # the global model's training (ATP Table 7: fedprox, qffl)
  c.rounds = 200                      # ATP: FedAvg 200 rounds (CNN)
  c.cohort_size = 240                 # ATP release: FedAvg with every source client a round
                                      # (part_rate 1.0); α's cohort is atp.cohort_size, 60
  c.sampling = 'uniform'
  c.weighting = 'num_examples'
  c.client.learning_rate = 0.1        # ATP: SGD lr 0.1
  c.client.batch_size = 20            # ATP: batch 20
  c.client.local_epochs = 1
  c.eval_every = 50
  c.checkpoint_every = 50

  c.data.benchmark = 'atp_shift'      # fields: fedjax_shift/benchmarks/atp_shift.py
  c.data.source = 'mnist_embedded'
  c.data.num_clients = 240            # ATP: 240 source clients (+ 60 target clients:
                                      # config.data.atp_shift's defaults, hybrid shift)
  c.model.name = 'bn_mlp'
  c.model.hidden = (200, 200)
  # The baselines as the ATP release runs them for its Table 1 (src/options.py defaults
  # and src/algorithm/<Method>.py); every adapter keeps its own paper's defaults
  # elsewhere. lm_lr = 0.1 is the release's SGD rate of every gradient baseline.
  # Surgical: the block with the best one-step adapted accuracy on the source held-out
  # data, one SGD step per test batch from the global model (episodic), predicting after.
  c.adapters.surgical.select = 'source_accuracy'
  c.adapters.surgical.optimizer = 'sgd'
  c.adapters.surgical.learning_rate = 0.1
  c.adapters.surgical.predict = 'after'
  c.tta.mode.surgical = 'episodic'
  c.adapters.tent.optimizer = 'sgd'               # Tent.py: SGD lm_lr
  c.adapters.tent.learning_rate = 0.1
  c.adapters.shot.optimizer = 'sgd'               # SHOT.py: SGD lm_lr, shot_beta = 0
  c.adapters.shot.learning_rate = 0.1
  c.adapters.shot.pseudo_label_weight = 0.0
  c.adapters.em.num_iterations = 2                # em_epochs = 2
  c.adapters.memo.num_augmentations = 16          # memo_aug_size = 16
  c.adapters.memo.augmentation = 'crop_flip'      # preaugment_*: crop (pad 4) + flip
  c.adapters.memo.learning_rate = 0.1             # MEMO.py: SGD lm_lr
  c.adapters.t3a.filter_k = 201                   # t3p_filter_k = -1 (no filter): 201 ≥
                                                  # 200 test examples + 1 warm-up per class
  c.adapters.bbse.projection = 'simplex'          # BBSE.py: pinv, simplex, ε = 0.001
  c.adapters.bn_adapt.mixing = 'layerwise'        # ModifiedBatchNorm2d, unbiased variance
  return apply_variant(c, arg, VARIANTS, USAGE)


def _shift(c: ml_collections.ConfigDict, match) -> None:
  name, shift = match['name'], match['shift']
  c.tta.shifts = (shift,) if shift else SHIFTS
  c.data.atp_shift.shift = c.tta.shifts[0]
  if name == 'fmnist':   # 56,000 source and 14,000 target images: none drawn twice
    c.data.source = 'fashion_mnist'
    c.data.tfds_split = 'train+test'
  if name == 'cifar10c':
    c.data.source = 'tfds:cifar10'
    c.data.tfds_split = 'train'
    c.data.atp_shift.target_split = 'test'   # CIFAR-10-C rows are the CIFAR-10 test images
    c.data.atp_shift.target_corrupted_tfds = True
    c.model.name = 'atp_cnn'
    c.engine.unroll = True


def _cnn(c: ml_collections.ConfigDict, match) -> None:
  c.model = ml_collections.ConfigDict({'name': 'atp_cnn'})
  c.engine.unroll = True


def _resnet18(c: ml_collections.ConfigDict, match) -> None:
  # ATP Table 1: torchvision resnet18(pretrained=True) on 32x32 CIFAR-10(-C); the
  # release's pretrain_fedavg_resnet18.sh (lr 0.01) and atp_train_resnet18.sh (200 rounds)
  c.model = ml_collections.ConfigDict({'name': 'resnet18', 'stem': 'imagenet'})
  c.client.learning_rate = 0.01
  c.atp.rounds = 200
  c.engine.unroll = True


def _pretrain(c: ml_collections.ConfigDict, match) -> None:
  c.algorithms = (match[0],)


def _learned(c: ml_collections.ConfigDict, match) -> None:
  c.learned.rows = ('tent_learned', 'bn_adapt_learned', 'atp_online_k')


def _tta_baselines(c: ml_collections.ConfigDict, match) -> None:
  c.tta.rows = tuple(c.tta.rows) + tuple(key for key, _, _, _ in TTA_BASELINE_ROWS)


def _time_limited(c: ml_collections.ConfigDict, match) -> None:
  c.tta.stream_rows = tuple(key for key in c.tta.rows if c.tta.mode[key] == 'online' and
                            ADAPTERS.meta(c.tta.adapter[key]).get('streams'))
  c.tta.stream_rate = STREAM_RATE


def _quick(c: ml_collections.ConfigDict, match) -> None:
  c.rounds = 40
  c.atp.rounds = 40


def _tiny(c: ml_collections.ConfigDict, match) -> None:
  c.rounds = 2
  c.atp.rounds = 2
  c.cohort_size = 4
  c.atp.cohort_size = 4
  c.data.num_clients = 12
  shift = c.data.atp_shift
  shift.num_target_clients = 4
  shift.source_train = 16
  shift.source_heldout = 8
  shift.target_test = 12
  c.data.step_major_count = 8
  c.data.step_minor_count = 1
  c.tta.batch_size = 6
  c.model.hidden = (16,)
  c.adapters.memo.num_augmentations = 2
  c.adapters.eata.fisher_samples = 16
  c.adapters.cotta.num_augmentations = 2
  c.adapters.rotta.memory_size = 10     # one place per class at least
  c.adapters.note.memory_size = 6
  c.adapters.rotta.update_frequency = c.adapters.note.update_frequency = 6
  c.eval_every = 2


VARIANTS = ((r'(?P<name>digits|fmnist|cifar10c)(_(?P<shift>feature|label|hybrid))?', _shift),
            ('cnn', _cnn), ('resnet18', _resnet18), ('fedprox|qffl', _pretrain), ('learned', _learned),
            ('tta_baselines', _tta_baselines), ('time_limited', _time_limited), ('quick', _quick),
            ('tiny', _tiny))
USAGE = ('digits[_<shift>], fmnist[_<shift>], cifar10c[_<shift>] (shift in feature, label, '
         'hybrid), cnn, resnet18, '
         'fedprox, qffl, learned, tta_baselines, time_limited, quick, tiny')
