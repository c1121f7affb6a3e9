"""FedIns (Feng et al., ICCV 2023) against its Table 1 baselines, on intra-client heterogeneous digits.

    python launch/train.py --config=configs/fedins.py --workdir=/tmp/fedins
    python launch/train.py --config=configs/fedins.py:quick --workdir=/tmp/fedins_quick

Rows (fedjax_shift/papers/fedins/tables.py FEDINS_ROWS): SOLO (= local), FedAvg full fine-tuning, FedProx (μ = 0.001),
SCAFFOLD, FedBN (LayerNorms local), MOON (μ = 1), FedDC (α = 0.01), Federated SSF
(Table 2's "SSF": one SSF set), FedIns. Columns: '# Com.cost' (parameters a client uploads per round, read off the
update pytrees) and accuracy on each client's test set, pooled and per domain.

Protocol: benchmarks/mixed_domains.py — 5 clients with FedIns' CIFAR-100 client sizes
(123, 209, 168, 222, 278 images), each a Dirichlet(1) mixture of four digit domains
(MNIST, UCI, MNIST-M-style, SynthDigits-style), 100 test images each from its own
mixture. Every method starts from one backbone pretrained here (pipelines/pretrain.py:
config.backbone.weights='pretrain', 10 epochs of Adam on 30,000 generated SynthDigits
renders per run directory) and trains with SGD lr 0.01, batch 32 (Sec. 4.1), every
client every round; M = 25, C = 3.

Where we differ: a ViT of width 64, depth 4, 4 heads, patches of 7 (CPU-sized; variant
`vit_b16` gives ViT-B/16's shape, for a GPU and a user's ImageNet-21K .npz) pretrained
on SynthDigits instead of ImageNet-21K; 30 rounds of 2 local epochs instead of 300 of
10 (variant `paper`). At width 64, 25 SSF sets are not small next to the backbone
(the SSF sets grow with the width, the backbone with its square): the communication
ratio of the paper (5.35 M of 85.80 M) holds for ViT-B/16 (variant vit_b16; the
parameter count is a test), not for this ViT.

Variants: quick (one seed, 10 rounds), paper (300 rounds, 10 local epochs), vit_b16
(ViT-B/16 at 224 px), and Table 1's datasets as the authors' code builds them (each needs
the prepared data in --config.data.data_dir): domainnet (FedBN's 10 DomainNet classes,
six clients of 26 images, one domain each, tested on its domain's test split),
cifar100 (the first 10 images of each class dealt to five clients by Dirichlet(0.2) per
class, the global model tested on the test split), tiny_imagenet (the same from
Tiny-ImageNet's train folders under data_dir, tested on its whole val folder). At
32 px and patch 4 for the CPU ViT, 224 px with vit_b16; with the authors' training
augmentation (client.augmentation: flip and ±15° rotation on cifar100, ±30° on
domainnet, none on tiny_imagenet).
ablation (Table 2's rows we have: SSF; SSF pool without the instance query; SSF pool),
per_image (the authors' release: one SGD step per image for the SSF methods, the
baselines at batch 32), per_image_all (every method one step per image: its
config.client_overrides.<method>.batch_size = 1),
pool_<M> (pool size M), top_<C> (C chosen SSFs), alpha_<a> (domain Dirichlet α),
backbone_<d1+d2…> (the backbone study: the backbone pretrained on those domains, the real
ones from a reserve of half of each real domain that no client holds), tiny.
"""
import ml_collections

from fedjax_shift.config import apply_variant, base_config


def vit_model() -> ml_collections.ConfigDict:
  """The CPU-sized ViT of this config (a 28×28 digit is 4×4 patches of 7)."""
  return ml_collections.ConfigDict({'name': 'vit', 'patch_size': 7, 'width': 64, 'depth': 4,
                                    'heads': 4, 'mlp_dim': 128})


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  c = base_config()
  c.algorithms = ('local', 'fedavg', 'fedprox', 'scaffold', 'fedbn', 'moon', 'feddc',
                  'fedins_ssf', 'fedins')
  c.data.benchmark = 'mixed_domains'
  c.model = vit_model()
  c.backbone.weights = 'pretrain'
  c.cohort_size = 5                   # every client every round
  c.weighting = 'num_examples'        # Eq. 8: weighted by |D_k| (the authors' code: uniform)
  c.rounds = 30
  c.eval_every = 5
  c.client.optimizer = 'sgd'
  c.client.learning_rate = 0.01       # Sec. 4.1: SGD lr 0.01
  c.client.batch_size = 32            # Sec. 4.1: batch 32
  c.client.local_epochs = 2
  c.fedprox.mu = 0.001                # Sec. 4.2: FedProx μ = 0.001
  c.fedbn.local_norms = 'all'         # no BatchNorm in a ViT: its LayerNorms stay local
  c.moon.mu = 1.0                     # Sec. 4.2: MOON μ = 1
  c.feddc.alpha = 0.01                # Sec. 4.2: FedDC α = 0.01
  c.paper_tables = 'fedins'
  return apply_variant(c, arg, VARIANTS,
                       'quick, paper, vit_b16, domainnet, cifar100, tiny_imagenet, ablation, '
                       'per_image, per_image_all, '
                       'pool_<M>, '
                       'top_<C>, alpha_<a>, backbone_<d1+d2...>, tiny')


def _quick(c: ml_collections.ConfigDict, match=None) -> None:
  c.seeds = (0,)
  c.rounds = 10


def _paper(c: ml_collections.ConfigDict, match=None) -> None:
  c.rounds = 300                      # Sec. 4.2: 300 rounds of 10 local epochs
  c.client.local_epochs = 10


def _vit_b16(c: ml_collections.ConfigDict, match=None) -> None:
  """ViT-B/16's shape (patch 16, width 768, depth 12, 12 heads, MLP 3072) on 224×224
  inputs (the authors resize every dataset to 224): set config.backbone.weights to a
  ViT-B/16 .npz and config.data to a TFDS benchmark (no such data is offline here)."""
  c.model = ml_collections.ConfigDict({'name': 'vit', 'patch_size': 16, 'width': 768,
                                       'depth': 12, 'heads': 12, 'mlp_dim': 3072})
  c.data.image_size = 224


# FedBN's 10-class DomainNet subset, which the FedIns authors' code reads.
FEDBN_DOMAINNET_CLASSES = ('bird', 'feather', 'headphones', 'ice_cream', 'teapot', 'tiger',
                           'whale', 'windmill', 'wine_glass', 'zebra')


def _cpu_patches(c: ml_collections.ConfigDict) -> None:
  """32-pixel images in patches of 4 for the CPU ViT (vit_b16 keeps its 224 / 16)."""
  if c.model.patch_size != 16:
    c.data.image_size = 32
    c.model.patch_size = 4


def _domainnet(c: ml_collections.ConfigDict, match=None) -> None:
  """Feature shift (Table 1, DomainNet) as the authors' code: FedBN's 10 classes, six
  clients of 26 images, client k holding domain k alone, each tested on its domain's
  test split."""
  mixed = c.data.mixed_domains
  mixed.domains = tuple(f'tfds:domainnet/{d}' for d in ('clipart', 'infograph', 'painting',
                                                        'quickdraw', 'real', 'sketch'))
  mixed.classes = FEDBN_DOMAINNET_CLASSES
  mixed.client_domains = 'one_each'
  mixed.client_sizes = (26,) * 6
  mixed.domain_examples = 500
  mixed.test_split = 'test'
  c.cohort_size = 6
  c.client.augmentation = ('horizontal_flip', 'rotate30')  # their train transform
  _cpu_patches(c)


def _cifar100(c: ml_collections.ConfigDict, match=None) -> None:
  """Label shift (Table 1, CIFAR-100) as the authors' code: the first 10 images of each
  class dealt to five clients by Dirichlet(0.2) per class (1,000 images; the paper's
  sizes 123–278 are one such draw), the global model tested on the whole test split."""
  c.data.benchmark = 'small_clients'
  c.data.source = 'tfds:cifar100'
  c.data.dirichlet_alpha = 0.2
  c.data.small_clients.images_per_class = 10
  c.data.num_clients = 5
  c.data.small_clients.test_split = 'test'
  c.client.augmentation = ('horizontal_flip', 'rotate15')  # their train transform
  _cpu_patches(c)


def _tiny_imagenet(c: ml_collections.ConfigDict, match=None) -> None:
  """Label shift (Table 1, Tiny-ImageNet) from the dataset's train folders
  (<data_dir>/tiny-imagenet-200/train/<wnid>/images/): the first 10 images of each of
  the 200 classes dealt to five clients by Dirichlet(0.2) per class, the global model
  tested on the whole val folder (10,000 images, dealt over the clients; read in the
  download's layout, images/ with val_annotations.txt, or in class folders, labels
  matched to the train classes by wnid), as the authors' code (their ImageFolder of
  val/; no training augmentation, as theirs)."""
  c.data.benchmark = 'small_clients'
  c.data.source = 'folder:tiny-imagenet-200/train'
  # the authors' test set: all of val/
  c.data.small_clients.test_split = 'folder:tiny-imagenet-200/val'
  c.data.dirichlet_alpha = 0.2
  c.data.small_clients.images_per_class = 10
  c.data.num_clients = 5
  _cpu_patches(c)


def _ablation(c: ml_collections.ConfigDict, match=None) -> None:
  """Table 2 (the SSF rows; the prompt rows are not built): SSF, the SSF pool chosen
  once per batch instead of per instance, FedIns."""
  c.algorithms = ('fedins_ssf', 'fedins_batch_query', 'fedins')


# The SSF methods (federated SSF, the pool without the instance query, FedIns).
SSF_METHODS = ('fedins_ssf', 'fedins_batch_query', 'fedins')


def _per_image(c: ml_collections.ConfigDict, match) -> None:
  """The authors' release schedule: its pool_train takes one SGD step per image (batch
  1, ~32× the paper's text's steps per epoch) for the SSF methods; '_all' gives every
  method the same schedule (the fair comparison), else the baselines keep Sec. 4.1's
  batch 32 as the release's FedAvg does."""
  for name in (c.algorithms if match['all'] else SSF_METHODS):
    c.client_overrides[name] = {'batch_size': 1}


def _pool(c: ml_collections.ConfigDict, match) -> None:
  c.fedins.pool_size = int(match['size'])
  c.fedins.top_c = min(c.fedins.top_c, c.fedins.pool_size)


def _top(c: ml_collections.ConfigDict, match) -> None:
  c.fedins.top_c = int(match['count'])


def _alpha(c: ml_collections.ConfigDict, match) -> None:
  c.data.mixed_domains.domain_alpha = float(match['alpha'])


# The backbone study's reserve: half of each real digit domain (mnist, uci, mnistm) is kept
# for pretraining and never dealt to a client, at every coverage level alike.
BACKBONE_RESERVE = 0.5


def _backbone(c: ml_collections.ConfigDict, match) -> None:
  """The backbone pretrained on the named domains ('+'-joined; the real ones from their
  reserve, synth from new renders), the clients drawing from the rest."""
  c.data.mixed_domains.backbone_reserve = BACKBONE_RESERVE
  c.backbone.domains = tuple(match['domains'].split('+'))


def _tiny(c: ml_collections.ConfigDict, match=None) -> None:
  """Seconds-long runs for tests: a 2-block ViT of width 16, 40 pretraining renders."""
  c.seeds = (0,)
  c.rounds = 2
  c.eval_every = 2
  c.checkpoint_every = 1
  c.progress = False
  c.model.width = 16
  c.model.depth = 1
  c.model.mlp_dim = 24
  c.data.mixed_domains.domain_examples = 60
  for benchmark in ('mixed_domains', 'small_clients'):
    c.data[benchmark].client_sizes = (12, 20, 16)
    c.data[benchmark].test_examples = 8
  c.cohort_size = 3
  c.client.batch_size = 8
  c.client.local_epochs = 1
  c.backbone.examples = 40
  c.backbone.epochs = 1
  c.backbone.batch_size = 16
  c.fedins.pool_size = 4   # the batch-query ablation's too (SSF's own pool is 1)


VARIANTS = (('quick', _quick), ('paper', _paper), ('vit_b16', _vit_b16),
            ('domainnet', _domainnet), ('cifar100', _cifar100),
            ('tiny_imagenet', _tiny_imagenet),
            ('ablation', _ablation), (r'per_image(?P<all>_all)?', _per_image),
            (r'pool_(?P<size>\d+)', _pool),
            (r'top_(?P<count>\d+)', _top), (r'alpha_(?P<alpha>[\d.]+)', _alpha),
            (r'backbone_(?P<domains>[a-z]+(?:\+[a-z]+)*)', _backbone), ('tiny', _tiny))
