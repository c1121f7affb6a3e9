"""Offline file sources: IDX folders (Fashion-MNIST, MNIST, EMNIST's binary release),
LEAF's FEMNIST JSON with its writers as clients, and image folders keeping their
channels. Every file here is written by the test; the one slow test reads Debian's
Fashion-MNIST when the package is installed."""
import gzip
import json
import os
import struct

import numpy as np
import pytest
from helpers import data_config

from fedjax_shift.benchmarks import BENCHMARKS, build_benchmark, load_source
from fedjax_shift.data import partitions, sources


def write_idx(path, array, code=0x08):
  """``array`` as an IDX file: two zero bytes, the type code, the rank, the sizes
  big-endian, then the values (gzip when ``path`` ends in .gz)."""
  header = bytes([0, 0, code, array.ndim]) + struct.pack(f'>{array.ndim}I', *array.shape)
  payload = header + np.ascontiguousarray(array).astype(array.dtype.newbyteorder('>')).tobytes()
  opener = gzip.open if str(path).endswith('.gz') else open
  with opener(path, 'wb') as f:
    f.write(payload)


def write_fashion_mnist_like(folder):
  """Fashion-MNIST's four files at its sizes (60,000 + 10,000 images of 28 × 28, labels
  cycling 0..9: 7,000 per class), random pixels."""
  rng = np.random.default_rng(0)
  for stem, count in (('train', 60000), ('t10k', 10000)):
    write_idx(os.path.join(folder, f'{stem}-images-idx3-ubyte'),
              rng.integers(0, 256, (count, 28, 28)).astype(np.uint8))
    write_idx(os.path.join(folder, f'{stem}-labels-idx1-ubyte'),
              (np.arange(count) % 10).astype(np.uint8))


@pytest.fixture(scope='module')
def fashion_mnist_like(tmp_path_factory):
  folder = tmp_path_factory.mktemp('fashion_mnist')
  write_fashion_mnist_like(str(folder))
  return str(folder)


def write_idx_folder(folder, prefix='', test_stem='t10k', gz=True, train=6, test=4, seed=0):
  """A folder of the four standard files: [train, test] images [n, 5, 3] and labels
  0..9; returns the arrays written."""
  rng = np.random.default_rng(seed)
  os.makedirs(folder, exist_ok=True)
  arrays = {}
  for stem, count in (('train', train), (test_stem, test)):
    images = rng.integers(0, 256, (count, 5, 3)).astype(np.uint8)
    labels = (np.arange(count) % 10).astype(np.uint8)
    end = '.gz' if gz else ''
    write_idx(os.path.join(folder, f'{prefix}{stem}-images-idx3-ubyte{end}'), images)
    write_idx(os.path.join(folder, f'{prefix}{stem}-labels-idx1-ubyte{end}'), labels)
    arrays[stem] = (images, labels)
  return arrays


@pytest.mark.parametrize('gz', [True, False])
def test_read_idx_round_trips_header_types_and_shapes(tmp_path, gz):
  end = '.gz' if gz else ''
  images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
  write_idx(tmp_path / f'a{end}', images)
  out = sources.read_idx(str(tmp_path / f'a{end}'))
  assert out.dtype == np.uint8 and out.shape == (2, 3, 4)
  np.testing.assert_array_equal(out, images)
  # A big-endian int32 file (type 0x0C) comes back as native int32 of the same values.
  values = np.array([[-1, 70000], [3, 4]], np.int32)
  write_idx(tmp_path / 'b', values, code=0x0C)
  np.testing.assert_array_equal(sources.read_idx(str(tmp_path / 'b')), values)


def test_read_idx_names_a_truncated_or_foreign_file(tmp_path):
  write_idx(tmp_path / 'a', np.zeros((4, 2, 2), np.uint8))
  data = (tmp_path / 'a').read_bytes()
  (tmp_path / "a").write_bytes(data[:-3])   # 16 header bytes + 16 values, 3 cut
  with pytest.raises(ValueError, match=r"a: 29 bytes, but its header \(4, 2, 2\) of uint8 needs 32"):
    sources.read_idx(str(tmp_path / 'a'))
  (tmp_path / 'b').write_bytes(b'\x89PNG....')
  with pytest.raises(ValueError, match=r"b: not an IDX file \(header '89504e47'\)"):
    sources.read_idx(str(tmp_path / 'b'))


def test_idx_source_keeps_grey_one_channel_and_scales_by_255(tmp_path):
  arrays = write_idx_folder(tmp_path)
  x, y = sources.idx_arrays(str(tmp_path), 'train+test')
  assert x.dtype == np.uint8 and x.shape == (10, 5, 3, 1) and not x.flags.writeable
  np.testing.assert_array_equal(x[:6, ..., 0], arrays['train'][0])   # train first
  np.testing.assert_array_equal(x[6:, ..., 0], arrays['t10k'][0])
  src = sources.idx_source(str(tmp_path), 'test')
  assert src.x.dtype == np.float32 and src.x.shape == (4, 5, 3, 1) and src.num_classes == 4
  np.testing.assert_allclose(src.x[..., 0], arrays['t10k'][0] / 255.0)
  np.testing.assert_array_equal(src.y, [0, 1, 2, 3])
  assert sources.idx_source(str(tmp_path), 'train', num_classes=10, max_examples=2).x.shape[0] == 2


def test_idx_source_reads_emnist_names_and_transposes_their_images(tmp_path):
  arrays = write_idx_folder(tmp_path, prefix='emnist-balanced-', test_stem='test', gz=False)
  x, _ = sources.idx_arrays(str(tmp_path), 'test')
  # EMNIST's release stores each image transposed: [n, 5, 3] on disk, [n, 3, 5] upright.
  np.testing.assert_array_equal(x[..., 0], arrays['test'][0].transpose(0, 2, 1))


def test_missing_idx_files_are_one_message_with_the_package(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"holds no IDX files of split 'train\+test'.*"
                                              r"apt-get install dataset-fashion-mnist"):
    sources.idx_arrays(str(tmp_path / 'nowhere'), 'train+test')
  write_idx_folder(tmp_path)
  os.remove(tmp_path / 't10k-labels-idx1-ubyte.gz')
  with pytest.raises(FileNotFoundError, match=r't10k-images-idx3-ubyte\.gz has no labels file'):
    sources.idx_arrays(str(tmp_path), 'test')


def test_fashion_mnist_source_reads_data_dir_and_names_the_debian_path(tmp_path, monkeypatch):
  write_idx_folder(tmp_path / 'fm', train=30, test=10)
  src = load_source(data_config(source='fashion_mnist', data_dir=str(tmp_path / 'fm'),
                                tfds_split='train+test'))
  assert src.x.shape == (40, 5, 3, 1) and src.num_classes == 10
  # The default folder is Debian's; without the package the message says what to install.
  monkeypatch.setattr(sources, 'FASHION_MNIST_DIR', str(tmp_path / 'absent'))
  with pytest.raises(FileNotFoundError, match=r"source='fashion_mnist'.*absent.*"
                                              r"apt-get install dataset-fashion-mnist"):
    load_source(data_config(source='fashion_mnist'))
  with pytest.raises(ValueError, match=r"data.data_dir.*source='idx' reads the files"):
    load_source(data_config(source='idx'))
  with pytest.raises(ValueError, match=r"data.tfds_split: data.source='idx' reads "
                                       r"\['train', 'test', 'train\+test'\], got 'validation'"):
    load_source(data_config(source='idx', data_dir=str(tmp_path / 'fm'), tfds_split='validation'))


def test_fashion_mnist_variant_builds_a_label_skew_run_on_idx_files(tmp_path):
  from fedjax_shift.config import apply_variant, base_config
  write_idx_folder(tmp_path, train=60, test=20)
  config = apply_variant(base_config(), 'fashion_mnist_path2,tiny')
  assert config.data.source == 'fashion_mnist' and config.data.partition == 'pathological'
  config.data.data_dir = str(tmp_path)
  config.data.min_examples_per_client = 1
  bench = build_benchmark(config.data, 0)
  assert bench.example_shape == (5, 3, 1)
  assert sum(int(s.num_examples.sum()) for s in bench.splits.values()
             if s is not bench.splits.get('test_corrupted')) == 60


def test_image_folder_keeps_grey_one_channel_unless_asked(tmp_path):
  from PIL import Image
  for name, value in (('a', 10), ('b', 200)):
    os.makedirs(tmp_path / name)
    Image.new('L', (4, 4), value).save(tmp_path / name / 'x.png')
  grey = sources.image_folder(str(tmp_path), 4)
  assert grey.x.shape == (2, 4, 4, 1)
  np.testing.assert_allclose(grey.x[:, 0, 0, 0], [10 / 255, 200 / 255], atol=1e-6)
  assert sources.image_folder(str(tmp_path), 4, channels=3).x.shape == (2, 4, 4, 3)
  Image.new('RGB', (4, 4), (255, 0, 0)).save(tmp_path / 'b' / 'y.png')
  assert sources.image_folder(str(tmp_path), 4).x.shape == (3, 4, 4, 3)   # one colour image
  src = load_source(data_config(source='folder:.', data_dir=str(tmp_path), image_size=4,
                                channels=1))
  assert src.x.shape == (3, 4, 4, 1)


def write_leaf(folder, writers_by_file, seed=0):
  """LEAF's layout: folder/{train,test}/*.json of {users, num_samples, user_data}."""
  rng = np.random.default_rng(seed)
  for split, files in writers_by_file.items():
    os.makedirs(os.path.join(folder, split), exist_ok=True)
    for i, writers in enumerate(files):
      users = list(writers)
      user_data = {w: {'x': rng.random((n, 784)).round(3).tolist(),
                       'y': rng.integers(0, 62, n).tolist()} for w, n in writers.items()}
      with open(os.path.join(folder, split, f'all_data_{i}.json'), 'w') as f:
        json.dump({'users': users, 'num_samples': list(writers.values()),
                   'user_data': user_data}, f)


def test_leaf_femnist_reads_writers_as_groups(tmp_path):
  write_leaf(tmp_path, {'train': [{'f0_b': 3, 'f0_a': 2}, {'f1_c': 4}],
                        'test': [{'f0_b': 1, 'f0_a': 1}, {'f1_c': 2}]})
  src = sources.leaf_femnist(str(tmp_path), 'train+test')
  assert src.x.shape == (13, 28, 28, 1) and src.num_classes == 62
  # Writers sorted by name: f0_a = 0, f0_b = 1, f1_c = 2; train rows first, then test.
  np.testing.assert_array_equal(src.groups, [1] * 3 + [0] * 2 + [2] * 4 + [1, 0] + [2] * 2)
  assert len(sources.leaf_femnist(str(tmp_path), 'test').y) == 4
  with pytest.raises(FileNotFoundError, match=r"no LEAF JSON files in .*train"):
    sources.leaf_femnist(str(tmp_path / 'x'), 'train')


def test_natural_partition_gives_each_client_one_whole_writer():
  groups = np.array([2, 0, 1, 2, 0, 2, 3])
  parts = partitions.natural(groups, 4, np.random.default_rng(0))
  assert sorted(map(tuple, parts)) == [(0, 3, 5), (1, 4), (2,), (6,)]
  parts = partitions.natural(groups, 2, np.random.default_rng(0))
  assert len(parts) == 2 and all(len(set(groups[p])) == 1 for p in parts)
  with pytest.raises(ValueError, match='the source has 4 writers'):
    partitions.natural(groups, 5, np.random.default_rng(0))


def test_femnist_writers_become_upfl_clients(tmp_path):
  write_leaf(tmp_path, {'train': [{f'w{i}': 5 + i for i in range(6)}],
                        'test': [{f'w{i}': 2 for i in range(6)}]})
  config = data_config(benchmark='upfl', source='femnist', data_dir=str(tmp_path),
                       tfds_split='train+test', partition='natural', num_clients=4)
  bench = BENCHMARKS.get('upfl')(config, 0)
  sizes = sorted(int(bench.splits['train'].num_examples[k] + bench.splits['val'].num_examples[k])
                 for k in range(2)) + sorted(bench.splits['test'].num_examples.tolist())
  writer_sizes = {7 + i for i in range(6)}   # each writer's 5 + i train and 2 test
  assert set(sizes) <= writer_sizes and len(set(sizes)) == 4
  with pytest.raises(ValueError, match=r"data.partition.*needs a source of writers"):
    BENCHMARKS.get('upfl')(data_config(benchmark='upfl', partition='natural'), 0)


def test_atp_fmnist_variant_gives_every_client_distinct_images(fashion_mnist_like):
  """configs/atp.py:fmnist_label: 240 source clients × (160 + 40) and 60 targets × 200
  from 70,000 images (56,000 source, 14,000 target). No source image is drawn twice
  (the 5,000 digits reuse most); a target pool class holds 1,400 images, which the
  random major classes of step_2_16 (80 each) can exceed: 47 of 12,000 draws here."""
  import importlib
  from fedjax_shift.benchmarks import build_benchmark
  config = importlib.import_module('configs.atp').get_config('fmnist_label')
  config.data.data_dir = fashion_mnist_like
  data = build_benchmark(config.data, 0)
  reused = data.info['reused_examples']
  assert (reused['source_train'], reused['source_heldout']) == (0, 0)
  assert reused['target'] < 0.01 * 60 * 200
  assert data.source.splits['train'].num_examples.tolist() == [160] * 240
  assert data.target.num_examples.tolist() == [200] * 60
  train = data.source.splits['train']
  digests = {hash(x.tobytes()) for k in range(240) for x in train.x[k][train.mask[k]]}
  assert len(digests) == 240 * 160


def test_fedevolve_rfmnist_variant_rotates_the_full_fashion_mnist(fashion_mnist_like):
  """configs/fedevolve.py:rfmnist_dir1.0: RMNIST's 12 domains over 70,000 images
  (~5,833 each, against ~417 of the 5,000 digits)."""
  import importlib
  from fedjax_shift.benchmarks import build_benchmark
  config = importlib.import_module('configs.fedevolve').get_config('rfmnist_dir1.0')
  assert config.data.source == 'fashion_mnist'
  config.data.data_dir = fashion_mnist_like
  bench = build_benchmark(config.data, 0)
  total = sum(int(split.num_examples.sum()) for split in bench.splits.values())
  assert total >= 11 * 5833   # the source domains (and the target's) hold every image


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(sources.FASHION_MNIST_DIR),
                    reason='needs Debian\'s dataset-fashion-mnist package')
def test_debian_fashion_mnist_is_the_full_dataset():
  x, y = sources.idx_arrays(sources.FASHION_MNIST_DIR, 'train+test')
  assert x.shape == (70000, 28, 28, 1) and x.dtype == np.uint8
  np.testing.assert_array_equal(np.bincount(y[:60000]), [6000] * 10)
  np.testing.assert_array_equal(np.bincount(y[60000:]), [1000] * 10)


def test_a_tfds_source_without_tensorflow_datasets_names_the_extra(monkeypatch):
  """tensorflow-datasets is the 'tfds' extra (pyproject.toml): not in the base install,
  which the quick start needs alone; a TFDS source read without it is one message
  naming the extra (launch/train.py: a refusal, exit 2, no traceback)."""
  import importlib.util
  import re
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, 'pyproject.toml')) as f:
    text = f.read()
  base, extras = text.split('[project.optional-dependencies]')
  assert 'tensorflow-datasets' not in base and 'array_record' not in base
  assert re.search(r'^tfds = \["tensorflow-datasets>=[\d.]+", "array_record>=[\d.]+"\]', extras,
                   re.M) and '"fedjax_shift[tfds]"' in extras    # dev: the TFDS path's tests
  monkeypatch.setitem(sys.modules, 'tensorflow_datasets', None)   # import fails
  find_spec = importlib.util.find_spec
  with pytest.raises(sources.MissingExtra, match=r"the TFDS dataset 'cifar10' is read with "
                                                 r"tensorflow-datasets, .*pip install -e '\.\[tfds\]'"):
    sources.tfds_source('cifar10', 'train')
  with pytest.raises(sources.MissingExtra, match='domainnet/real'):
    sources.tfds_class_ids('domainnet/real', ('bird',))
  # a config naming a TFDS source is refused by its check, before any data is built
  from fedjax_shift import config as config_lib
  from helpers import tiny_config
  monkeypatch.setattr(importlib.util, 'find_spec', lambda name, *a: None if name ==
                      'tensorflow_datasets' else find_spec(name, *a))
  with pytest.raises(sources.MissingExtra, match=r"'cifar10' is read with tensorflow-datasets"):
    config_lib.validate(tiny_config(**{'data.source': 'tfds:cifar10'}))
  from helpers import launch_module
  train = launch_module('train')
  assert issubclass(sources.MissingExtra, train.REFUSED) and sources.MissingExtra in \
      train.USER_ERRORS
