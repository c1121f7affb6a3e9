"""The backbone study's data: a reserve of each real digit domain for the pretrained
backbone that no client holds, the configs that use it, and its report."""
import hashlib

import numpy as np
import pytest

from configs import fedins as fedins_config
from fedjax_shift.benchmarks import build_benchmark, check_data
from fedjax_shift.data import digit_domains, sources
from fedjax_shift.pipelines import pretrain
from helpers import write_run


def _hashes(images):
  """One digest per image of [N, H, W, C] (rounded to 1e-4, so a float copy matches)."""
  return {hashlib.sha1(np.round(np.asarray(image), 4).tobytes()).hexdigest()
          for image in images}


def test_pool_parts_are_disjoint_cover_the_pool_and_do_not_depend_on_the_call():
  pool = np.arange(100, 300)
  backbone = digit_domains.pool_part(pool, 0.3, 'backbone')
  clients = digit_domains.pool_part(pool, 0.3, 'clients')
  assert len(backbone) == 60 and len(clients) == 140        # round(0.3 · 200)
  assert not set(backbone) & set(clients)
  assert set(backbone) | set(clients) == set(pool)
  np.testing.assert_array_equal(digit_domains.pool_part(pool, 0.3, 'backbone'), backbone)
  np.testing.assert_array_equal(digit_domains.pool_part(pool, 0.0, 'all'), pool)
  np.testing.assert_array_equal(digit_domains.pool_part(pool, 0.3, 'all'), pool)
  with pytest.raises(ValueError, match='needs a reserve > 0'):
    digit_domains.pool_part(pool, 0.0, 'backbone')


def test_without_a_reserve_a_domain_draws_as_before():
  """reserve 0: the mnist domain is rng.permutation(first half)[:count], as it always was
  (every earlier table keeps its data)."""
  src = sources.mnist_embedded()
  expected = np.random.default_rng(5).permutation(digit_domains.mnist_halves(src.y)[0])[:50]
  got = digit_domains.domain('mnist', 50, np.random.default_rng(5))
  np.testing.assert_array_equal(got.y, src.y[expected])
  np.testing.assert_array_equal(got.x[..., 0], src.x[expected][..., 0])


def test_no_client_holds_an_image_of_the_backbones_reserve():
  """configs/fedins.py:backbone_mnist+uci+synth: the backbone's real images (mnist and
  uci reserve) and every client image of those domains (train and test) are disjoint;
  the backbone gets the whole reserve (half of each pool) when asked for more."""
  config = fedins_config.get_config('backbone_mnist+uci+synth')
  assert config.data.mixed_domains.backbone_reserve == 0.5
  config.backbone.examples = 5000       # more than a reserve holds: all of it
  rng = np.random.default_rng([config.backbone.seed, 91])
  data_dir = config.data.data_dir or None
  reserve = {name: digit_domains.domain(name, 5000, rng, data_dir, 0.5, 'backbone')
             for name in ('mnist', 'uci')}
  assert len(reserve['mnist'].y) == round(0.5 * len(digit_domains.mnist_halves(
      sources.mnist_embedded().y)[0]))
  (train_x, _), (held_x, _) = pretrain.source_data(config)
  backbone = _hashes(np.concatenate([train_x, held_x]))
  assert _hashes(reserve['mnist'].x) <= backbone and _hashes(reserve['uci'].x) <= backbone
  bench = build_benchmark(config.data, 0)
  for split in ('train', 'test'):
    data = bench.splits[split]
    client_images = _hashes(data.x[data.mask])
    assert not client_images & _hashes(reserve['mnist'].x)
    assert not client_images & _hashes(reserve['uci'].x)
  # without the reserve the same draw of clients does meet the backbone's mnist images
  config.data.mixed_domains.backbone_reserve = 0.0
  shared = build_benchmark(config.data, 0).splits['train']
  assert _hashes(shared.x[shared.mask]) & _hashes(reserve['mnist'].x)


def test_reserve_fields_are_checked_before_anything_trains():
  config = fedins_config.get_config('backbone_mnist')
  config.data.mixed_domains.backbone_reserve = 1.0
  with pytest.raises(ValueError,
                     match=r'data.mixed_domains.backbone_reserve: must be a number >= 0 and < 1'):
    check_data(config.data)
  config.data.mixed_domains.backbone_reserve = 0.5
  config.data.mixed_domains.domains = ('mnist', 'folder:usps')
  with pytest.raises(ValueError,
                     match=r"data.mixed_domains.backbone_reserve: .*\['folder:usps'\] cannot be"):
    check_data(config.data)
  config = fedins_config.get_config('backbone_mnist+svhn')
  with pytest.raises(ValueError, match=r"backbone.domains: .*\['svhn'\] have none"):
    pretrain.check_backbone(config)


def test_pretraining_fingerprint_records_the_reserve_only_when_set():
  assert pretrain.backbone_fields(fedins_config.get_config('backbone_mnist'))[
      'backbone_reserve'] == 0.5
  assert 'backbone_reserve' not in pretrain.backbone_fields(fedins_config.get_config())


def test_backbone_report_gives_paired_seed_differences_per_domain_and_a_plot(tmp_path):
  """Two coverages × two seeds (binary fractions, so the sums are exact); FedIns −
  FedAvg per seed: (0.625 − 0.5, 0.75 − 0.5) = (12.5, 25) points → 18.75 ± 6.25;
  FedIns − SSF: (0.625 − 0.6875, 0.75 − 0.6875) = (−6.25, 6.25) → 0.00 ± 6.25."""
  from fedjax_shift.papers.fedins import tables
  workdirs = []
  for coverage, domains in (('synth', ('synth',)), ('all four', ('mnist', 'uci', 'mnistm',
                                                                  'synth'))):
    config = fedins_config.get_config('backbone_' + '+'.join(domains))
    workdir = tmp_path / coverage.replace(' ', '_')
    for method, accuracies in (('fedavg', (0.5, 0.5)), ('fedins_ssf', (0.6875, 0.6875)),
                               ('fedins', (0.625, 0.75))):
      for seed, accuracy in enumerate(accuracies):
        metrics = {f'global/{split}/accuracy': accuracy for split in
                   ('test', 'test_mnist', 'test_uci', 'test_mnistm', 'test_synth')}
        write_run(workdir, method, seed, metrics, config=config)
    workdirs.append(str(workdir))
  text = tables.backbones_from_workdirs(workdirs, ['synth', 'all four'])
  assert ('| Backbone pretrained on | backbone domains | all: FedIns − FedAvg | '
          'all: FedIns − SSF |') in text
  assert '| all four | mnist, uci, mnistm, synth | 18.75 ± 6.25 | 0.00 ± 6.25 |' in text
  assert text.rstrip().endswith('| 2 |')
  assert (tmp_path / 'backbones.png').stat().st_size > 0
