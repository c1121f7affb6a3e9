"""The Digit-5-style benchmark made offline (data/digit_domains.py,
benchmarks/digit_domains.py)."""
import numpy as np
import pytest

from fedjax_shift.benchmarks import BENCHMARKS
from fedjax_shift.data import digit_domains, sources
from tests.helpers import data_config

DOMAINS = ('mnist', 'uci', 'mnistm', 'synth')


def build(**fields):
  config = data_config(benchmark='digit_domains', domain_examples=60,
                       corruptions=('gaussian_noise', 'contrast'), **fields)
  BENCHMARKS.check('digit_domains', config, 'config.data', known_fields_only=False)
  return BENCHMARKS.get('digit_domains')(config, 0)


@pytest.mark.parametrize('name', DOMAINS)
def test_every_domain_is_28x28_colour_in_unit_range_with_ten_classes(name):
  src = digit_domains.domain(name, 50, np.random.default_rng(0))
  assert src.x.shape == (50, 28, 28, 3) and src.x.dtype == np.float32
  assert 0.0 <= src.x.min() and src.x.max() <= 1.0
  assert set(np.unique(src.y)) <= set(range(10))


def test_generated_domains_follow_the_generator():
  for name in ('mnistm', 'synth'):
    a = digit_domains.domain(name, 20, np.random.default_rng(3))
    b = digit_domains.domain(name, 20, np.random.default_rng(3))
    np.testing.assert_array_equal(a.x, b.x)


def test_mnistm_blends_other_digits_than_the_mnist_domain(monkeypatch):
  mnist = sources.mnist_embedded()
  grey = lambda x: {image[..., 0].tobytes() for image in x}
  first, second = (grey(mnist.x[half]) for half in digit_domains.mnist_halves(mnist.y))
  plain = digit_domains.domain('mnist', 300, np.random.default_rng(0))
  # without the texture, a blend is its digit: which MNIST digits mnistm used
  monkeypatch.setattr(digit_domains, 'mnistm', lambda digits, rng: digits)
  unblended = digit_domains.domain('mnistm', 300, np.random.default_rng(0))
  assert grey(plain.x) <= first and grey(unblended.x) <= second
  # and both domains hold every class
  assert set(plain.y) == set(unblended.y) == set(range(10))


def test_synth_renders_the_requested_digit_shapes():
  labels = np.array([1, 8] * 10)
  images = digit_domains.synth(labels, np.random.default_rng(0))
  # an 8 covers more of the frame than a 1: the stroke differs from the background
  # on more pixels
  contrast = np.abs(images - np.median(images, axis=(1, 2), keepdims=True)).sum(-1)
  covered = (contrast > 0.3).mean((1, 2))
  assert covered[labels == 8].mean() > covered[labels == 1].mean()


def test_covariate_benchmark_has_one_client_per_domain_and_groups_them():
  bench = build()
  assert bench.info['client_domain'] == list(DOMAINS)
  assert bench.info['client_groups'] == {name: [k] for k, name in enumerate(DOMAINS)}
  assert set(bench.splits) == {'train', 'val', 'test', 'test_corrupted'}
  # every test example corrupted, by a corruption drawn for it: both kinds per client
  counts = bench.info['corruption_counts_per_client']
  for k in range(4):
    n = int(bench.splits['test'].num_examples[k])
    assert sum(counts[k]) == n and min(counts[k]) > 0
    corrupted, clean = bench.splits['test_corrupted'].x[k, :n], bench.splits['test'].x[k, :n]
    assert all(not np.allclose(a, b) for a, b in zip(corrupted, clean))


def test_per_domain_metrics_pool_only_that_domains_clients():
  from fedjax_shift.core.evaluation import summarize
  sums = {'correct': np.array([3.0, 1.0, 8.0]), 'loss': np.array([1.0, 2.0, 3.0]),
          'count': np.array([4.0, 2.0, 10.0])}
  flat = summarize({'global': {'test': sums}}, {'a': [0, 1], 'b': [2]})
  assert flat['global/test/accuracy'] == 12 / 16
  assert flat['global/test_a/accuracy'] == 4 / 6 and flat['global/test_b/accuracy'] == 0.8
  assert flat['global/test_a/client_accuracy'] == (0.75 + 0.5) / 2


def test_leave_one_domain_out_keeps_the_held_out_domain_from_every_client():
  bench = build(held_out_domain='synth')
  assert bench.info['client_domain'] == ['mnist', 'uci', 'mnistm']
  rows = lambda split: {x.tobytes() for k in range(split.num_clients)
                        for x in split.x[k, :int(split.num_examples[k])]}
  held_out = rows(bench.splits['test'])
  assert len(held_out) == 60
  for name in ('train', 'val', 'test_own'):
    assert not rows(bench.splits[name]) & held_out


def test_bad_domains_name_the_field():
  with pytest.raises(ValueError, match=r'data\.domains.*usps'):
    build(domains=('mnist', 'usps'))
  with pytest.raises(ValueError, match=r'data\.held_out_domain'):
    build(held_out_domain='svhn')
  with pytest.raises(ValueError, match=r'data\.domains'):
    build(domains=('mnist',))


def test_a_user_folder_is_a_domain(tmp_path):
  from PIL import Image
  rng = np.random.default_rng(0)
  for digit in range(10):
    (tmp_path / 'usps' / str(digit)).mkdir(parents=True)
    for i in range(3):
      pixels = (rng.random((16, 16)) * 255).astype(np.uint8)
      Image.fromarray(pixels).save(tmp_path / 'usps' / str(digit) / f'{i}.png')
  src = digit_domains.domain('folder:usps', 20, np.random.default_rng(1), str(tmp_path))
  assert src.x.shape == (20, 28, 28, 3) and 0 <= src.x.min() and src.x.max() <= 1
  assert set(src.y) <= set(range(10))
  bench = build(domains=('mnist', 'folder:usps'), data_dir=str(tmp_path))
  assert bench.info['client_domain'] == ['mnist', 'folder:usps']
  with pytest.raises(FileNotFoundError, match='config.data.domains: folder:mnistm_real'):
    digit_domains.domain('folder:mnistm_real', 5, rng, str(tmp_path))
