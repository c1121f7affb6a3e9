"""Config validation: bad input fails before compilation, naming the field."""
import os

import numpy as np
import pytest

from fedjax_shift import config as config_lib
from fedjax_shift import pipelines
from fedjax_shift.pipelines import federated as experiment
from helpers import tiny_config


@pytest.mark.parametrize('field,value,pattern', [
    ('algorithms', ('fedavg', 'nope'), r"config.algorithms: unknown algorithm 'nope'.*fedavg"),
    ('model.name', 'vgg99', r"config.model.name: unknown model 'vgg99'.*atp_cnn"),
    ('data.source', 'imagenet', r"config.data.source: unknown source 'imagenet'"),
    ('data.source', 'tfds:imagenet', r'config.data.source'),
    ('data.benchmark', 'nope', r'config.data.benchmark: unknown benchmark'),
    ('data.partition', 'zipf', r'config.data.partition: unknown partition'),
    ('cohort_size', 7, r'config.cohort_size: must be in \[1, data.num_clients=6\]'),
    ('cohort_size', 0, r'config.cohort_size'),
    ('client.learning_rate', 0.0, r'config.client.learning_rate: must be > 0'),
    ('client.learning_rate', -0.1, r'config.client.learning_rate'),
    ('server.learning_rate', 0.0, r'config.server.learning_rate'),
    ('client.batch_size', 0, r'config.client.batch_size: must be >= 1'),
    ('data.label_skew_corrupted.severity', 6,
     r'config.data.label_skew_corrupted.severity: must be an integer in 1..5'),
    ('data.label_skew_corrupted.severity', 0, r'config.data.label_skew_corrupted.severity'),
    ('data.dirichlet_alpha', 0.0, r'config.data.dirichlet_alpha: must be > 0'),
    ('data.dirichlet_alpha', -1.0, r'config.data.dirichlet_alpha'),
    ('data.label_skew_corrupted.corruptions', ('fog', 'rain'),
     r"config.data.label_skew_corrupted.corruptions: must be a tuple .*'rain'"),
    ('sampling', 'roundrobin', r'config.sampling'),
    ('straggler_prob', 1.5, r'config.straggler_prob'),
    ('client.optimizer', 'lbfgs', r'config.client.optimizer'),
    ('server.optimizer', 'yogi', r'config.server.optimizer'),
    ('data.store', 'disk', r'config.data.store'),
    ('engine.backend', 'pmap', r'config.engine.backend: unknown'),
    ('engine.client_chunk', -1, r'config.engine.client_chunk: must be >= 0'),
    ('client.momentum', 1.5, r'config.client.momentum: must be in \[0, 1\), got 1.5'),
    ('client.weight_decay', -0.1, r'config.client.weight_decay: must be >= 0'),
    ('server.momentum', 1.5, r'config.server.momentum: must be in \[0, 1\)'),
    ('server.beta2', 1.0, r'config.server.beta2: must be in \[0, 1\)'),
    ('engine.example_buckets', (64, 32), r'config.engine.example_buckets: must be strictly '
                                         r'ascending'),
    ('engine.example_buckets', (0, 32), r'config.engine.example_buckets: every bucket must '
                                        r'be a positive'),
    ('engine.example_shapes', 0, r'config.engine.example_shapes: must be >= 1'),
    ('engine.max_scanned', 0.5, r'config.engine.max_scanned: must be 0 \(no grouping\) or >= 1'),
])
def test_bad_config_names_field(field, value, pattern):
  config = tiny_config(**{field: value})
  with pytest.raises(ValueError, match=pattern):
    config_lib.validate(config)


def test_unwritable_workdir(tmp_path):
  blocker = tmp_path / 'a_file'
  blocker.write_text('x')
  with pytest.raises(ValueError, match='workdir'):
    config_lib.validate(tiny_config(), str(blocker / 'sub'))


def test_unknown_variant():
  with pytest.raises(ValueError, match="unknown config variant 'mnist_dirichlet'"):
    config_lib.apply_variant(config_lib.base_config(), 'mnist_dirichlet')


def test_variants_parse():
  config = config_lib.apply_variant(config_lib.base_config(), 'uci_dir1.0')
  assert config.data.source == 'uci_digits' and config.data.dirichlet_alpha == 1.0
  config = config_lib.apply_variant(config_lib.base_config(), 'mnist_path2')
  assert config.data.partition == 'pathological' and config.data.classes_per_client == 2
  config = config_lib.apply_variant(config_lib.base_config(), 'cifar10_dirinf')
  assert config.data.source == 'tfds:cifar10' and np.isinf(config.data.dirichlet_alpha)


def test_validation_happens_before_any_work(tmp_path, monkeypatch):
  calls = []
  monkeypatch.setattr(experiment, 'train_and_evaluate', lambda *a: calls.append(a))
  with pytest.raises(ValueError, match='cohort_size'):
    pipelines.run(tiny_config(cohort_size=100), str(tmp_path))
  assert not calls and not os.path.exists(tmp_path / 'config.json')


def test_more_clients_than_examples_is_a_clear_error(tmp_path):
  config = tiny_config(**{'data.num_clients': 6000, 'cohort_size': 2})
  with pytest.raises(ValueError, match='5000 examples cannot give 6000 clients'):
    pipelines.run(config, str(tmp_path))


def test_client_clip_norm_clips_the_global_norm_before_decay_and_the_step():
  """SGD(η) after a clip at c: a gradient g of norm |g| > c steps by −η·g·c/|g|, and
  weight decay λ adds λ·w after the clip (torch's clip_grad_norm_, then SGD's
  weight_decay). A traced c of 0 leaves g as it is."""
  import jax.numpy as jnp
  import ml_collections
  from fedjax_shift.algorithms.base import check_client, client_optimizer
  params = {'w': jnp.array([1.0, 2.0])}
  grads = {'w': jnp.array([3.0, 4.0])}          # |g| = 5
  client = config_lib.base_config().client
  client.learning_rate, client.clip_norm, client.weight_decay = 0.1, 1.0, 0.5
  opt = client_optimizer(client)
  updates, _ = opt.update(grads, opt.init(params), params)
  expected = -0.1 * (np.array([3.0, 4.0]) / 5.0 + 0.5 * np.array([1.0, 2.0]))
  np.testing.assert_allclose(updates['w'], expected, rtol=1e-6)
  swept = ml_collections.ConfigDict({**client.to_dict(), 'weight_decay': 0.0,
                                     'clip_norm': jnp.float32(0.0)})   # a swept zero: no clip
  opt = client_optimizer(swept)
  np.testing.assert_allclose(opt.update(grads, opt.init(params), params)[0]['w'],
                             [-0.3, -0.4], rtol=1e-6)
  client.clip_norm = -1.0
  with pytest.raises(ValueError, match='client.clip_norm: must be >= 0'):
    check_client(client)


def test_fields_added_at_their_old_value_leave_fingerprints_as_they_were():
  """client.clip_norm and gma.global_learning_rate at their old behaviour (0: no clip;
  η_g 1) are not among a run's fields, so a workdir recorded before them resumes; set,
  they are recorded."""
  from fedjax_shift.pipelines import fingerprints
  config = config_lib.apply_variant(config_lib.base_config(), 'tiny')
  config.algorithms = ('gma',)
  fields = fingerprints.run_fields(config, 'gma')
  assert 'client.clip_norm' not in fields and 'gma.global_learning_rate' not in fields
  config.client.clip_norm = 10.0
  config.gma.global_learning_rate = 1.5
  fields = fingerprints.run_fields(config, 'gma')
  assert fields['client.clip_norm'] == '10.0' and fields['gma.global_learning_rate'] == '1.5'


def test_a_config_loads_by_its_path_from_any_directory(tmp_path, monkeypatch):
  """``config.load`` reads what ``--config=`` reads: the repository's configs from
  another directory (a sibling-importing one too, fedevp.py), a file of the working
  directory first, and a missing file is named with the configs there are."""
  monkeypatch.chdir(tmp_path)
  tiny = config_lib.load('configs/default.py:tiny')
  assert (tiny.rounds, tiny.seeds) == (3, (0,)) and config_lib.load('default.py').rounds == 30
  assert config_lib.load('configs/fedevp.py:tiny').algorithms == ('fedevp',)
  (tmp_path / 'configs').mkdir()
  (tmp_path / 'configs' / 'default.py').write_text(
      'from fedjax_shift.config import base_config\n'
      'def get_config(arg=""):\n  c = base_config()\n  c.rounds = 7\n  return c\n')
  assert config_lib.load('configs/default.py').rounds == 7   # the working directory's own
  with pytest.raises(FileNotFoundError, match=r"no config file 'configs/nope.py' here .* nor "
                                              r"in the repository's configs .*'default.py'"):
    config_lib.load('configs/nope.py')


def test_each_benchmark_reads_the_shared_data_fields_and_its_own_section():
  """config.data: the fields every benchmark reads and one section per benchmark; what
  a benchmark reads (``data_view``) is the shared fields and its section's, flat, and
  changing another benchmark's section changes neither that nor the run's fields."""
  from fedjax_shift.benchmarks import BENCHMARKS, DATA_DEFAULTS, data_view
  from fedjax_shift.pipelines import fingerprints
  config = tiny_config()
  assert set(config.data.keys()) == set(DATA_DEFAULTS) | set(BENCHMARKS.names())
  view = data_view(config.data)
  assert set(view.keys()) == set(DATA_DEFAULTS) | set(BENCHMARKS.defaults(
      'label_skew_corrupted'))
  assert view.severity == config.data.label_skew_corrupted.severity == 5
  fields = fingerprints.run_fields(config, 'fedavg')
  assert fields['data.severity'] == '5' and not any(
      key.startswith(('data.upfl', 'data.label_skew_corrupted')) for key in fields)
  config.data.upfl.public_examples = 7           # another benchmark's section
  config.data.digit_domains.severity = 2
  assert data_view(config.data).to_dict() == view.to_dict()
  assert fingerprints.run_fields(config, 'fedavg') == fields
  config.data.label_skew_corrupted.severity = 3  # its own
  assert fingerprints.run_fields(config, 'fedavg')['data.severity'] == '3'


def test_a_benchmark_field_beside_the_shared_ones_is_refused_naming_its_section(tmp_path):
  """Set as ``config.data.<field>`` (as configs wrote it before the sections), a
  benchmark's field would be read by no benchmark: refused, naming where it lives; a
  benchmark's error about its own field names its section."""
  config = tiny_config()
  config.data.severity = 3
  with pytest.raises(ValueError, match=r'config.data.severity: not a field every benchmark '
                                       r'reads; .* config.data.label_skew_corrupted.severity'):
    config_lib.validate(config)
  config = tiny_config(**{'data.benchmark': 'upfl', 'data.partition': 'pathological'})
  config.data.upfl.new_client_fraction = 1.0
  with pytest.raises(ValueError, match=r'^config.data.upfl.new_client_fraction: '):
    config_lib.validate(config)


def test_a_data_config_recorded_flat_reads_back_with_its_benchmarks_section(tmp_path):
  """config.json of a run recorded before the sections: ``report.run_config`` moves its
  benchmark's fields into their section (the other benchmarks' recorded fields dropped),
  so what the benchmark reads is what it read then."""
  import json
  from fedjax_shift import report
  from fedjax_shift.benchmarks import DATA_DEFAULTS, data_view
  config = tiny_config(**{'data.label_skew_corrupted.severity': 2})
  flat = {**data_view(config.data).to_dict(), 'public_examples': 500, 'num_domains': 12}
  (tmp_path / 'config.json').write_text(json.dumps({**config.to_dict(), 'data': flat}))
  recorded = report.run_config(str(tmp_path))
  assert set(recorded.data.keys()) == set(DATA_DEFAULTS) | {'label_skew_corrupted'}
  assert recorded.data.label_skew_corrupted.severity == 2
  as_json = lambda data: json.dumps(data_view(data).to_dict(), sort_keys=True)   # tuples: lists
  assert as_json(recorded.data) == as_json(config.data)
