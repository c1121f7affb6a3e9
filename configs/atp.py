"""ATP (atp.txt) and the test-time baselines of its Table 1, as one pipeline:
FedAvg pretraining on the source clients → α training (Algorithm 1) → every
adapter on the target clients → Table 1 (rows × shifts), Table 3 (α trained on
one shift, tested on another) and the learned α per module (Figure 4).

Variants (``--config=configs/atp.py:<variant>[,<more>]``):
  digits_feature | digits_label | digits_hybrid   one shift on the embedded MNIST digits
  digits                                          all three shifts (+ Table 3)
  cifar10c_feature | cifar10c_label | cifar10c_hybrid | cifar10c
        the paper's protocol on TFDS cifar10 (+ cifar10_corrupted for the targets)
  cnn        the ATP CNN instead of the CPU-sized BN-MLP on digits
  fedprox | qffl   the pretraining algorithm of ATP Table 7
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

from fedjax_shift.config import base_config
from fedjax_shift.data import corruptions

SHIFTS = ('feature', 'label', 'hybrid')
# Table 1's rows in order: (key, label, adapter, test-time mode).
ROWS = (('no_adapt', 'No adaptation', 'no_adapt', 'episodic'),
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


def adapter_configs() -> ml_collections.ConfigDict:
  """Each adapter's hyperparameters (its paper's defaults; REFERENCE.md)."""
  a = ml_collections.ConfigDict()
  a.no_adapt = ml_collections.ConfigDict()
  a.bn_adapt = ml_collections.ConfigDict({'prior_strength': 16.0})  # ATP code: p = 16/(16+B)
  a.tent = ml_collections.ConfigDict({'learning_rate': 1e-3,         # Tent: Adam 1e-3 (CIFAR)
                                      'predict': 'before'})          # ATP code: logits before
  a.eata = ml_collections.ConfigDict({
      'learning_rate': 0.005, 'momentum': 0.9,   # SGD on BN affine (our choice; a field)
      'entropy_margin': 0.4,                     # EATA: E0 = 0.4·ln C
      'redundancy_epsilon': 0.05,                # EATA: ε = 0.05
      'fisher_weight': 2000.0,                   # EATA: β = 2000
      'fisher_samples': 2000,                    # EATA: 2000 source samples
      'predict': 'before'})
  a.shot = ml_collections.ConfigDict({'learning_rate': 1e-3,         # Tent's optimizer
                                      'pseudo_label_weight': 0.3,    # SHOT: β = 0.3
                                      'predict': 'before'})          # ATP code: logits before
  a.t3a = ml_collections.ConfigDict({'filter_k': 100})               # T3A/DomainBed default K
  a.memo = ml_collections.ConfigDict({'num_augmentations': 32,       # MEMO: 32 augmentations
                                      'learning_rate': 0.005})       # MEMO: lr 0.005
  a.em = ml_collections.ConfigDict({'num_iterations': 100})          # Saerens EM iterations
  a.bbse = ml_collections.ConfigDict()
  a.surgical = ml_collections.ConfigDict({'learning_rate': 1e-3, 'predict': 'before',
                                          # Lee et al.: input-level shift → first block,
                                          # label (output-level) shift → last layer.
                                          'block': {'feature': 'first', 'label': 'head',
                                                    'hybrid': 'head'}})
  a.atp = ml_collections.ConfigDict()
  return a


def get_config(arg: str = 'digits_hybrid') -> ml_collections.ConfigDict:
  c = base_config()
  c.pipeline = 'test_time'
  c.algorithms = ('fedavg',)          # the global model's training (ATP Table 7: fedprox, qffl)
  c.rounds = 200                      # ATP: FedAvg 200 rounds (CNN)
  c.cohort_size = 60                  # 25 % of 240 source clients
  c.sampling = 'uniform'
  c.weighting = 'num_examples'
  c.client.learning_rate = 0.1        # ATP: SGD lr 0.1
  c.client.batch_size = 20            # ATP: batch 20
  c.client.local_epochs = 1
  c.eval_every = 50
  c.checkpoint_every = 50

  c.data.benchmark = 'atp_shift'
  c.data.source = 'mnist_embedded'
  c.data.shift = 'hybrid'
  c.data.num_clients = 240            # ATP: 240 source clients ...
  c.data.num_target_clients = 60      # ... and 60 target clients
  c.data.source_train = 160           # ATP: 160 train / 40 held-out per source client
  c.data.source_heldout = 40
  c.data.target_test = 200            # ATP: 200 unlabelled test samples per target
  c.data.target_data_fraction = 0.2   # ATP: 20 % of the data held out for targets
  c.data.target_split = ''            # a separate TFDS split for targets ('test' for CIFAR-10)
  c.data.target_corrupted_tfds = False  # targets from TFDS cifar10_corrupted
  c.data.source_corruptions = corruptions.SOURCE_CORRUPTIONS    # ATP: 15 source corruptions
  c.data.target_corruptions = corruptions.HELDOUT_CORRUPTIONS   # ATP: 4 held-out ones
  c.data.severities = (1, 2, 3, 4, 5)  # one severity per client, drawn uniformly
  c.data.step_major_classes = 2       # step_2_16: 2 major classes × 80, minors × 5
  c.data.step_major_count = 80
  c.data.step_minor_count = 5
  c.data.corruptions = ()
  c.model.name = 'bn_mlp'
  c.model.hidden = (200, 200)

  c.tta = ml_collections.ConfigDict()
  c.tta.shifts = ('hybrid',)          # Table 1 columns run by this config
  c.tta.batch_size = 20               # ATP: test batch 20
  c.tta.rows = tuple(key for key, _, _, _ in ROWS)   # drop keys to skip methods
  c.tta.label = ml_collections.ConfigDict({key: label for key, label, _, _ in ROWS})
  c.tta.adapter = ml_collections.ConfigDict({key: adapter for key, _, adapter, _ in ROWS})
  c.tta.mode = ml_collections.ConfigDict({key: mode for key, _, _, mode in ROWS})
  c.adapters = adapter_configs()

  for part in filter(None, (arg or '').split(',')):
    apply_part(c, part)
  return c


def apply_part(c: ml_collections.ConfigDict, part: str) -> None:
  name, _, shift = part.partition('_')
  if name in ('digits', 'cifar10c') and (shift in SHIFTS or not shift):
    c.tta.shifts = (shift,) if shift else SHIFTS
    c.data.shift = c.tta.shifts[0]
    if name == 'cifar10c':
      c.data.source = 'tfds:cifar10'
      c.data.tfds_split = 'train'
      c.data.target_split = 'test'          # CIFAR-10-C rows are the CIFAR-10 test images
      c.data.target_corrupted_tfds = True
      c.model.name = 'atp_cnn'
      c.engine.unroll = True
  elif part == 'cnn':
    c.model = ml_collections.ConfigDict({'name': 'atp_cnn'})
    c.engine.unroll = True
  elif part in ('fedprox', 'qffl'):
    c.algorithms = (part,)
  elif part == 'quick':
    c.seeds = (0,)
    c.rounds = 40
    c.atp.rounds = 40
  elif part == 'tiny':
    c.seeds = (0,)
    c.rounds = 2
    c.atp.rounds = 2
    c.cohort_size = 4
    c.atp.cohort_size = 4
    c.data.num_clients = 12
    c.data.num_target_clients = 4
    c.data.source_train = 16
    c.data.source_heldout = 8
    c.data.target_test = 12
    c.data.step_major_count = 8
    c.data.step_minor_count = 1
    c.tta.batch_size = 6
    c.model.hidden = (16,)
    c.adapters.memo.num_augmentations = 2
    c.adapters.eata.fisher_samples = 16
    c.eval_every = 2
    c.checkpoint_every = 1
    c.progress = False
  else:
    raise ValueError(f'configs/atp.py: unknown variant {part!r}; use digits[_<shift>], '
                     f'cifar10c[_<shift>] (shift in {SHIFTS}), cnn, fedprox, qffl, quick, tiny')
