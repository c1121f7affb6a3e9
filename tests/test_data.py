"""Data layer: sources, partitions, corruptions, stacking and validation."""
import numpy as np
import pytest

from fedjax_shift.benchmarks import build_benchmark
from fedjax_shift.data import corruptions, partitions, sources
from fedjax_shift.data.federated import stack_clients, validate
from helpers import tiny_config


def test_embedded_sources_are_real_digits():
  mnist = sources.mnist_embedded()
  assert mnist.x.shape == (5000, 28, 28, 1) and mnist.num_classes == 10
  np.testing.assert_array_equal(np.bincount(mnist.y), [500] * 10)
  assert 0.0 <= mnist.x.min() and mnist.x.max() == 1.0
  uci = sources.uci_digits()
  assert uci.x.shape == (1797, 28, 28, 1) and set(np.unique(uci.y)) == set(range(10))


def test_circle_follows_fedevolve_appendix_c2():
  """App. C.2: 30 Gaussians of standard deviation 0.6 centred on the half circle of
  radius 10 (means spread evenly over 0°–180°), label 1 inside the circle
  x² + y² ≤ 100; the circle variant draws 1,000 points per domain."""
  x, y = sources.circle(num_domains=30, points_per_domain=1000, seed=0)
  assert x.shape == (30, 1000, 2) and y.shape == (30, 1000)
  means = x.mean(1)
  np.testing.assert_allclose(np.linalg.norm(means, axis=-1), 10.0, atol=0.1)
  expected = np.deg2rad(np.linspace(0, 180, 30))
  np.testing.assert_allclose(means, 10.0 * np.stack([np.cos(expected), np.sin(expected)], -1),
                             atol=0.1)
  np.testing.assert_allclose(x.std(1), 0.6, rtol=0.1)
  np.testing.assert_array_equal(y, (x ** 2).sum(-1) <= 100.0)
  assert 0.4 < y.mean() < 0.6      # the boundary runs through every domain's centre
  from configs import fedevolve as fedevolve_configs
  data = fedevolve_configs.get_config('circle_dirinf').data.circle
  assert (data.points_per_domain, data.num_domains, data.circle_generator) == (
      1000, 30, 'gaussian')
  with pytest.raises(ValueError, match='data.circle_generator'):
    sources.circle(4, 10, 0, 'ring')


def test_circle_annulus_generator():
  x, y = sources.circle(num_domains=30, points_per_domain=100, seed=0, generator='annulus')
  assert x.shape == (30, 100, 2) and y.shape == (30, 100)
  radius = np.linalg.norm(x, axis=-1)
  assert radius.min() >= 4.0 and radius.max() <= 6.0
  np.testing.assert_array_equal(y, radius > 5.0)
  angles = np.degrees(np.arctan2(x[..., 1], x[..., 0]))
  assert angles.min() >= 0 and angles.max() <= 180  # a half circle
  assert np.all(np.diff(angles.mean(1)) > 0)  # domains move along the circle


@pytest.mark.parametrize('alpha', [0.1, 1.0, float('inf')])
def test_dirichlet_reproducible_and_assigns_every_example_once(alpha):
  labels = np.random.default_rng(0).integers(0, 10, 2000)
  a = partitions.dirichlet(labels, 20, alpha, np.random.default_rng(3))
  b = partitions.dirichlet(labels, 20, alpha, np.random.default_rng(3))
  assert all(np.array_equal(p, q) for p, q in zip(a, b))
  everything = np.sort(np.concatenate(a))
  np.testing.assert_array_equal(everything, np.arange(2000))
  c = partitions.dirichlet(labels, 20, alpha, np.random.default_rng(4))
  assert not all(np.array_equal(p, q) for p, q in zip(a, c))


def test_dirichlet_skew_grows_as_alpha_shrinks():
  labels = np.repeat(np.arange(10), 300)

  def mean_classes(alpha):
    parts = partitions.dirichlet(labels, 20, alpha, np.random.default_rng(0))
    return np.mean([len(np.unique(labels[p])) for p in parts])

  assert mean_classes(0.1) < mean_classes(1.0) < mean_classes(100.0)


def test_pathological_and_step_partitions():
  labels = np.repeat(np.arange(10), 100)
  parts = partitions.pathological(labels, 20, 2, np.random.default_rng(0))
  np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(1000))
  assert max(len(np.unique(labels[p])) for p in parts) <= 2
  step = partitions.step(labels, 4, 2, 20, 5, np.random.default_rng(0))
  partitions.check_disjoint(step)
  for p in step:
    counts = np.bincount(labels[p], minlength=10)
    assert sorted(counts.tolist()) == [5] * 8 + [20] * 2
  with pytest.raises(ValueError, match='runs out'):
    partitions.step(labels, 10, 2, 80, 5, np.random.default_rng(0))


@pytest.mark.parametrize('bad', [0.0, -1.0])
def test_dirichlet_rejects_nonpositive_alpha(bad):
  with pytest.raises(ValueError, match='alpha'):
    partitions.dirichlet(np.zeros(10, int), 2, bad, np.random.default_rng(0))


@pytest.mark.parametrize('channels', [1, 3])
@pytest.mark.parametrize('name', corruptions.ALL_CORRUPTIONS)
def test_corruptions_deterministic_shape_and_range(name, channels):
  x = np.random.default_rng(0).random((3, 16, 16, channels)).astype(np.float32)
  a = corruptions.corrupt(x, name, 3, seed=11)
  b = corruptions.corrupt(x, name, 3, seed=11)
  assert a.shape == x.shape and a.dtype == np.float32
  np.testing.assert_array_equal(a, b)
  assert a.min() >= 0.0 and a.max() <= 1.0
  assert not np.array_equal(a, x)  # every corruption changes the images
  if name == 'saturate':
    return  # CIFAR-10-C saturate is not monotone: severities 1-2 desaturate, 3-5 saturate
  # severity 5 moves the images at least as far as severity 1 (up to noise)
  d1 = np.abs(corruptions.corrupt(x, name, 1, 11) - x).mean()
  d5 = np.abs(corruptions.corrupt(x, name, 5, 11) - x).mean()
  assert d5 >= 0.8 * d1


def test_corruption_lists_match_reference():
  assert len(corruptions.SOURCE_CORRUPTIONS) == 15
  assert set(corruptions.HELDOUT_CORRUPTIONS) == {'speckle_noise', 'gaussian_blur', 'saturate',
                                                   'spatter'}


@pytest.mark.parametrize('severity', [0, 6, 2.5])
def test_corruption_severity_out_of_range(severity):
  with pytest.raises(ValueError, match='severity'):
    corruptions.corrupt(np.zeros((1, 8, 8, 1), np.float32), 'contrast', severity, 0)


def test_rotation_is_exact_for_right_angles():
  x = np.random.default_rng(0).random((2, 8, 8, 1)).astype(np.float32)
  np.testing.assert_allclose(sources.rotate(x, 90), np.rot90(x, 1, axes=(1, 2)), atol=1e-5)


def test_stack_and_validate():
  xs = [np.ones((2, 3, 3, 1)), np.ones((0, 3, 3, 1)), np.ones((4, 3, 3, 1))]
  ys = [np.array([0, 1]), np.array([], int), np.array([2, 2, 1, 0])]
  data = stack_clients(xs, ys)
  assert data.x.shape == (3, 4, 3, 3, 1)
  np.testing.assert_array_equal(data.num_examples, [2, 0, 4])
  np.testing.assert_array_equal(data.mask.sum(1), [2, 0, 4])
  validate(data, 3)
  bad_x = data.x.copy()
  bad_x[2, 1, 0, 0, 0] = np.nan
  with pytest.raises(ValueError, match='client 2.*NaN'):
    validate(data._replace(x=bad_x), 3)
  bad_y = data.y.copy()
  bad_y[0, 1] = 7
  with pytest.raises(ValueError, match='client 0.*label 7'):
    validate(data._replace(y=bad_y), 3)
  # NaN in padding is ignored (masked out everywhere)
  pad_x = data.x.copy()
  pad_x[0, 3] = np.nan
  validate(data._replace(x=pad_x), 3)


def test_benchmark_reproducible_disjoint_and_corrupted():
  config = tiny_config()
  a = build_benchmark(config.data, 0)
  b = build_benchmark(config.data, 0)
  for name in a.splits:
    np.testing.assert_array_equal(a.splits[name].x, b.splits[name].x)
  assert set(a.splits) == {'train', 'val', 'test', 'test_corrupted'}
  total = sum(int(s.num_examples.sum()) for n, s in a.splits.items() if n != 'test_corrupted')
  assert total == 5000  # every example assigned to exactly one client split
  np.testing.assert_array_equal(a.splits['test'].y, a.splits['test_corrupted'].y)
  assert not np.allclose(a.splits['test'].x, a.splits['test_corrupted'].x)
  # train/val/test images of one client never overlap
  tr, te = a.splits['train'], a.splits['test']
  for k in range(tr.num_clients):
    train_rows = {r.tobytes() for r in tr.client(k)[0]}
    assert not any(r.tobytes() in train_rows for r in te.client(k)[0])
  c = build_benchmark(config.data, 1)
  assert not np.array_equal(a.splits['train'].num_examples, c.splits['train'].num_examples)


def test_tfds_source_with_mock_data():
  import tensorflow_datasets as tfds
  with tfds.testing.mock_data(num_examples=12):
    src = sources.tfds_source('mnist', 'train')
    assert src.x.shape == (12, 28, 28, 1) and src.y.shape == (12,)
    assert src.x.dtype == np.float32 and src.x.max() <= 1.0
    cifar = sources.tfds_source('cifar10', 'test', max_examples=5)
    assert cifar.x.shape == (5, 32, 32, 3)
    config = tiny_config(**{'data.source': 'tfds:cifar10', 'data.num_clients': 2,
                            'data.min_examples_per_client': 1,
                            'data.corruptions': ('saturate',)})
    bench = build_benchmark(config.data, 0)
    assert bench.example_shape == (32, 32, 3)


@pytest.mark.parametrize('name', ['mnist', 'emnist', 'fashion_mnist', 'cifar10',
                                  'cifar10_corrupted/gaussian_noise_5', 'cifar10_1', 'cifar100',
                                  'svhn_cropped'])
def test_every_tfds_loader_with_mock_data(name):
  import tensorflow_datasets as tfds
  with tfds.testing.mock_data(num_examples=4):
    src = sources.tfds_source(name, 'test')
  assert src.x.ndim == 4 and src.x.shape[0] == 4 and src.x.shape[-1] in (1, 3)
  assert src.x.dtype == np.float32 and 0.0 <= src.x.min() and src.x.max() <= 1.0
  assert src.y.dtype == np.int32 and src.y.max() < src.num_classes


def test_tfds_missing_dataset_says_how_to_get_it(tmp_path):
  with pytest.raises(FileNotFoundError, match='tfds build cifar10'):
    sources.tfds_source('cifar10', 'train', data_dir=str(tmp_path))


def test_image_folders_read_images_as_users_store_them(tmp_path, monkeypatch):
  """16-bit greyscale PNGs keep their scale (1 of 65535, not clipped at 255), palette,
  greyscale and RGBA files convert to RGB, an EXIF-rotated JPEG is turned upright,
  hidden folders and files ('.ipynb_checkpoints', '__MACOSX', '._x.png') are no classes
  or images, and errors name the class folder and the file."""
  from PIL import Image
  from fedjax_shift.data import sources
  root = tmp_path / 'images'
  for name in ('cat', 'dog', '.ipynb_checkpoints', '__MACOSX'):
    (root / name).mkdir(parents=True)
  half = np.full((4, 4), 32768, np.uint16)                    # 16-bit mid-grey
  Image.fromarray(half).save(root / 'cat' / 'a16.png')
  palette = Image.new('P', (4, 4))
  palette.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
  palette.putpixel((0, 0), 1)
  palette.save(root / 'cat' / 'b_palette.png')
  Image.new('RGBA', (4, 4), (0, 0, 255, 10)).save(root / 'dog' / 'c_rgba.png')
  Image.new('L', (4, 4), 51).save(root / 'dog' / 'd_grey.png')
  tall = np.zeros((4, 2, 3), np.uint8)                        # stored 2 wide × 4 tall …
  tall[0, :, 0] = 255                                         # … red top row
  exif = Image.Exif()
  exif[0x0112] = 6                                            # "rotate 90° CW to view"
  Image.fromarray(tall).save(root / 'dog' / 'e_exif.jpg', exif=exif, quality=100)
  Image.new('RGB', (4, 4)).save(root / 'dog' / '._e_exif.png')   # a resource fork
  Image.new('RGB', (4, 4)).save(root / '.ipynb_checkpoints' / 'x.png')
  Image.new('RGB', (4, 4)).save(root / '__MACOSX' / 'y.png')
  src = sources.image_folder(str(root), 4)
  assert src.num_classes == 2 and src.class_names == ('cat', 'dog') and len(src.y) == 5
  np.testing.assert_allclose(src.x[0], 32768 / 65535, atol=1e-6)   # not 1.0
  np.testing.assert_allclose(src.x[1][0, 0], [1, 0, 0])            # the palette's red
  np.testing.assert_allclose(src.x[1][1, 1], [0, 0, 0])
  np.testing.assert_allclose(src.x[2][0, 0], [0, 0, 1])            # RGBA: alpha dropped
  np.testing.assert_allclose(src.x[3], 0.2)                         # grey 51 → RGB
  upright = sources.read_image(str(root / 'dog' / 'e_exif.jpg'), 4, 3)
  # Rotated 90° clockwise, the stored red top row becomes the right column.
  assert upright[:, -1, 0].mean() > 0.5 and upright[:, 0, 0].mean() < 0.3
  (root / 'dog' / 'f_broken.png').write_bytes(b'not a png')
  with pytest.raises(ValueError, match=r'dog/f_broken\.png: cannot be read'):
    sources.image_folder(str(root), 4)
  (root / 'dog' / 'f_broken.png').unlink()
  # An image of more pixels than PIL decodes (its decompression-bomb guard, here
  # lowered to 100 pixels): the file named, no PIL traceback.
  from PIL import Image
  Image.new('RGB', (30, 30)).save(root / 'dog' / 'g_huge.png')
  monkeypatch.setattr(Image, 'MAX_IMAGE_PIXELS', 100)
  with pytest.raises(ValueError, match=r'dog/g_huge\.png: cannot be read as an image: Image '
                                       r'size \(900 pixels\) exceeds .*Shrink or remove'):
    sources.image_folder(str(root), 4)
  monkeypatch.undo()
  (root / 'dog' / 'g_huge.png').unlink()
  from helpers import data_config
  from fedjax_shift.benchmarks import BENCHMARKS
  config = data_config(benchmark='small_clients', source='folder:images', data_dir=str(tmp_path),
                       image_size=4, client_sizes=(2, 2), test_examples=1, dirichlet_alpha=1.0,
                       images_per_class=3, num_clients=2)
  with pytest.raises(ValueError, match=r"class 0 \('cat'\) has only 2 examples"):
    BENCHMARKS.get('small_clients')(config, 0)


def test_a_thread_pool_reads_an_image_folder_as_one_file_after_another(tmp_path):
  """``read_images`` with several threads: the same array, in the same order, as one
  file after another (each read is the same function); an unreadable file among them
  is the error, naming it, whatever thread read it."""
  from PIL import Image
  rng = np.random.default_rng(3)
  files = []
  for i in range(23):
    files.append(str(tmp_path / f'{i:02d}.png'))
    Image.fromarray(rng.integers(0, 256, (5 + i % 4, 7, 3), dtype=np.uint8)).save(files[-1])
  serial = sources.read_images(files, 6, 3, workers=1)
  pooled = sources.read_images(files, 6, 3, workers=4)
  assert serial.shape == (23, 6, 6, 3) and serial.dtype == np.float32
  np.testing.assert_array_equal(pooled, serial)
  np.testing.assert_array_equal(pooled[11], sources.read_image(files[11], 6, 3))
  assert sources.read_workers(3) == 3 and sources.read_workers() >= 1
  (tmp_path / '17.png').write_bytes(b'not a png')
  with pytest.raises(ValueError, match=r'17\.png: cannot be read'):
    sources.read_images(files, 6, 3, workers=4)
