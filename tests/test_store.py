"""The compact client store: each client's examples once, gathered by offsets.

A round trained on a ClientStore must equal the round on the padded FederatedData of
the same clients to float rounding (the gather produces the same floats: a palette
lookup of the stored codes), through the grouped device round, the host store, the
loop backend, several rounds per call and vmapped seeds; and memory follows the
examples.
"""
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import build_method, grouped, run_rounds, tiny_config
from fedjax_shift.algorithms import ALGORITHMS
from fedjax_shift.core.round import (HostStore, RoundConfig, build_round, cohort_capacity,
                                     cohort_store, expected_cohort_rows, round_key)
from fedjax_shift.data import federated, store as client_store

NUM_CLASSES = 3
SIZES = [2, 19, 5, 11, 0, 3, 7, 13]   # skewed, one client without data


def skewed_clients(sizes=SIZES, shape=(4, 4, 1), seed=0):
  """(padded FederatedData, ClientStore) of the same clients: uint8 pixels k/255."""
  rng = np.random.default_rng(seed)
  xs = [(rng.integers(0, 256, (n,) + shape) / 255).astype(np.float32) for n in sizes]
  ys = [rng.integers(0, NUM_CLASSES, n).astype(np.int32) for n in sizes]
  return (federated.stack_clients(xs, ys, example_shape=shape),
          client_store.from_clients(xs, ys, shape))


def test_the_store_holds_each_example_once_in_its_source_bytes():
  padded, stored = skewed_clients()
  # 60 examples of 16 uint8 pixels + 60 int32 labels + 9 offsets + 8 counts + the
  # 256-entry float32 palette; the padded layout holds 8 × 19 × 16 float32 pixels.
  assert stored.x.dtype == np.uint8 and stored.x.shape == (60, 4, 4, 1)
  assert stored.nbytes == 60 * 16 + 60 * 4 + 9 * 4 + 8 * 4 + 256 * 4
  assert padded.x.nbytes == 8 * 19 * 16 * 4
  np.testing.assert_array_equal(stored.offsets, np.cumsum([0] + SIZES))
  assert stored.max_examples == 19


def test_padding_a_store_gives_back_the_padded_layout_bit_for_bit():
  padded, stored = skewed_clients()
  for a, b in zip(stored.padded(), padded):
    np.testing.assert_array_equal(a, b)
  back = client_store.compact(padded)
  np.testing.assert_array_equal(back.x, stored.x)
  np.testing.assert_array_equal(back.palette, stored.palette)
  taken = stored.take([3, 4, 1], pad_to=20)
  np.testing.assert_array_equal(taken.x[:, :19], padded.x[[3, 4, 1]])
  assert not taken.mask[:, 19].any()


def test_inputs_with_more_than_256_values_stay_float32():
  rng = np.random.default_rng(1)
  xs = [rng.normal(size=(n, 3)).astype(np.float32) for n in (200, 100)]
  stored = client_store.from_clients(xs, [np.zeros(200), np.ones(100)])
  assert stored.palette is None and stored.x.dtype == np.float32
  np.testing.assert_array_equal(stored.client(1)[0], xs[1])
  few = client_store.from_clients([np.array([[0.5], [-2.0], [0.5]])], [np.zeros(3)])
  # 2 distinct values: codes into a sorted palette [-2.0, 0.5].
  np.testing.assert_array_equal(few.palette, [-2.0, 0.5])
  np.testing.assert_array_equal(few.x[:, 0], [1, 0, 1])


def test_gather_inside_jit_equals_the_host_take():
  _, stored = skewed_clients()
  rows = jnp.array([1, 4, 6])
  gathered = jax.jit(lambda s, r: client_store.gather_clients(s, r, 13))(
      jax.device_put(stored), rows)
  host = stored.take(np.asarray(rows))
  np.testing.assert_array_equal(gathered.x, host.x[:, :13])
  np.testing.assert_array_equal(gathered.y, host.y[:, :13])
  np.testing.assert_array_equal(gathered.mask, host.mask[:, :13])


@pytest.mark.parametrize('name', ['fedavg', 'fedprox', 'scaffold', 'ditto', 'fedbn',
                                  'atp', 'fedtta'])
def test_a_grouped_round_on_the_store_equals_the_padded_round(name):
  model = 'bn_mlp' if ALGORITHMS.meta(name).get('batch_norm', True) else 'mlp'
  config = tiny_config(**{'model.name': model, 'client.batch_size': 3})
  padded, stored = skewed_clients()
  _, algorithm, server, clients = build_method(name, config, padded, NUM_CLASSES)
  round_config = grouped(padded, 7, 3, straggler_prob=0.3, straggler_max_steps=2)
  round_device = build_round(algorithm, round_config)[0]
  a = run_rounds(round_device, server, clients, padded)
  b = run_rounds(round_device, server, clients, jax.device_put(stored))
  np.testing.assert_array_equal(a.metrics['cohort'], b.metrics['cohort'])
  chex.assert_trees_all_close(a.server_state, b.server_state, atol=1e-6)
  chex.assert_trees_all_close(a.client_states, b.client_states, atol=1e-6)


def test_host_store_loop_backend_and_round_scan_on_the_store_equal_the_padded_round():
  config = tiny_config(**{'model.name': 'mlp', 'client.batch_size': 3})
  padded, stored = skewed_clients()
  _, fedavg, server, clients = build_method('fedavg', config, padded, NUM_CLASSES)
  round_config = grouped(padded, 5, 2)
  round_device, round_host = build_round(fedavg, round_config)
  reference = run_rounds(round_device, server, clients, padded, rounds=3, seed=9)
  seed_key = jax.random.key(9)
  host = HostStore(stored, seed_key, round_config)
  s, c = server, clients
  for r in range(3):
    cohort, ids = host.cohort(r)
    assert isinstance(cohort, client_store.ClientStore)
    out = round_host(s, c, cohort, ids, round_key(seed_key, r))
    s, c = out.server_state, out.client_states
  host.close()
  chex.assert_trees_all_close(reference.server_state, s, atol=1e-6)
  keys = jax.vmap(lambda r: round_key(seed_key, r))(jnp.arange(3))
  scan = build_round(fedavg, round_config, rounds_per_call=3)[0]
  scanned = scan(server, clients, jax.device_put(stored), keys, jnp.ones(3, bool))
  chex.assert_trees_all_close(reference.server_state, scanned.server_state, atol=1e-6)
  loop = build_round(fedavg, RoundConfig(cohort_size=5, example_buckets=(4, 19)),
                     backend='loop')[0]
  chex.assert_trees_all_close(run_rounds(loop, server, clients, padded).server_state,
                              run_rounds(loop, server, clients, stored).server_state,
                              atol=1e-6)


def test_vmapped_seeds_share_one_store():
  config = tiny_config(**{'model.name': 'mlp', 'client.batch_size': 3})
  padded, stored = skewed_clients()
  _, fedavg, server, clients = build_method('fedavg', config, padded, NUM_CLASSES)
  round_device = build_round(fedavg, grouped(padded, 6, 2))[0]
  keys = jnp.stack([jax.random.key(1), jax.random.key(2)])
  stack = lambda tree: jax.tree.map(lambda leaf: jnp.stack([leaf, leaf]), tree)
  both = jax.vmap(round_device, (0, 0, None, 0))(stack(server), stack(clients),
                                                 jax.device_put(stored), keys)
  for i in range(2):
    one = round_device(server, clients, padded, keys[i])
    chex.assert_trees_all_close(jax.tree.map(lambda leaf: leaf[i], both.server_state),
                                one.server_state, atol=1e-6)


def test_a_host_cohort_sends_only_its_own_examples_on_a_ladder_of_sizes():
  _, stored = skewed_clients()
  cohort = cohort_store(stored, np.array([3, 1, 4, 5]))   # 11 + 19 + 0 + 3 = 33 examples
  assert cohort.x.shape[0] == cohort_capacity(33) == 34   # 33 up to a multiple of 2^(6-5)
  np.testing.assert_array_equal(cohort.offsets, [0, 11, 30, 30, 33])
  np.testing.assert_array_equal(cohort.take([1]).x, stored.take([1]).x)
  # sixteen sizes per doubling: at most 1/16 above the examples
  for total in (1, 7, 100, 1000, 12345, 10 ** 6):
    assert total <= cohort_capacity(total) <= total * 1.0625
  assert len({cohort_capacity(t) for t in range(4097, 8193)}) == 16
  # the host store starts at the expected cohort (mean + 2 std) and only grows
  sizes = np.asarray(stored.num_examples, np.float64)   # cohort 4 of these 8 clients
  sd = np.sqrt(4 * sizes.var() * 4 / 7)
  assert expected_cohort_rows(sizes, 4) == cohort_capacity(4 * sizes.mean() + 2 * sd)


@pytest.mark.parametrize('break_store,message', [
    (lambda s: s.replace(offsets=np.where(np.arange(len(s.offsets)) == 2, 1, s.offsets)),
     'client 1 in split .train.: offsets give'),
    (lambda s: s.replace(y=np.where(np.arange(len(s.y)) == 30, 7, s.y)),
     r"client 3 in split 'train': label 7 outside \[0, 3\)"),
    (lambda s: s.replace(x=s.x[:-1], y=s.y[:-1]), 'the offsets in split .train. end at 60'),
    (lambda s: s.replace(palette=s.palette[:10]), 'past the palette'),
])
def test_a_malformed_store_is_refused_naming_split_and_client(break_store, message):
  _, stored = skewed_clients()
  with pytest.raises(ValueError, match=message):
    client_store.validate_store(break_store(stored), NUM_CLASSES, 'train')


def test_a_split_without_examples_pads_to_zeros():
  empty = client_store.from_clients([np.zeros((0, 3)), np.zeros((0, 3))],
                                    [np.zeros(0), np.zeros(0)], (3,))
  taken = empty.take([1, 0])
  assert taken.x.shape == (2, 1, 3) and not taken.mask.any() and not taken.x.any()
  client_store.validate_store(empty, 2, 'val')


def test_bad_construction_input_names_the_client():
  with pytest.raises(ValueError, match='add up to 5 examples but x has 4'):
    client_store.from_arrays(np.zeros((4, 2)), np.zeros(4), [2, 3], 'train')
  with pytest.raises(ValueError, match='client 1 in split .val.: num_examples=-1'):
    client_store.from_arrays(np.zeros((1, 2)), np.zeros(1), [2, -1], 'val')
  with pytest.raises(ValueError, match='dtype complex64: a model takes real numbers'):
    client_store.from_arrays(np.zeros((2, 2), np.complex64), np.zeros(2), [2])


def loop_dirichlet(labels, num_clients, alpha, rng):
  """The per-client loop reference of one Dirichlet draw (Hsu et al. 2019)."""
  parts = [[] for _ in range(num_clients)]
  for c in np.unique(labels):
    idx = rng.permutation(np.nonzero(labels == c)[0])
    proportions = rng.dirichlet(np.full(num_clients, alpha))
    cuts = (np.cumsum(proportions) * len(idx)).astype(int)[:-1]
    for k, chunk in enumerate(np.split(idx, cuts)):
      parts[k].append(chunk)
  return [np.sort(np.concatenate(p)) for p in parts]


@pytest.mark.parametrize('rule', ['redraw', 'top_up'])
def test_a_dirichlet_draw_that_meets_the_minimum_is_the_loop_references(rule):
  from fedjax_shift.data import partitions
  labels = np.random.default_rng(0).integers(0, 10, 3000)
  fast = partitions.dirichlet(labels, 30, 1.0, np.random.default_rng(5), min_examples=1,
                              rule=rule)
  reference = loop_dirichlet(labels, 30, 1.0, np.random.default_rng(5))
  assert min(len(p) for p in reference) >= 1
  for a, b in zip(fast, reference):
    np.testing.assert_array_equal(a, b)


def test_redrawing_draws_again_as_the_loop_reference_does():
  """rule='redraw' is the papers' partitioner: the second draw when the first leaves a
  client short (seed 0 of the default experiment's 20 clients at Dir(0.1), minimum 2)."""
  from fedjax_shift.data import partitions
  labels = np.repeat(np.arange(10), 30)
  rng = np.random.default_rng(1)
  draws = [loop_dirichlet(labels, 20, 0.1, rng) for _ in range(30)]
  first_ok = next(i for i, d in enumerate(draws) if min(len(p) for p in d) >= 2)
  assert first_ok > 0   # the first draw left a client short
  fast = partitions.dirichlet(labels, 20, 0.1, np.random.default_rng(1), min_examples=2)
  for a, b in zip(fast, draws[first_ok]):
    np.testing.assert_array_equal(a, b)


def test_a_dirichlet_minimum_is_met_by_construction():
  from fedjax_shift.data import partitions
  # 70,000 labels over 1,000 clients with at least 10 each, Dir(0.1): a draw leaves
  # hundreds of clients short (redrawing found none in 1,000 draws).
  labels = np.repeat(np.arange(10), 7000)
  short = loop_dirichlet(labels, 1000, 0.1, np.random.default_rng(0))
  assert sum(len(p) < 10 for p in short) > 100
  with pytest.raises(ValueError, match="min_examples_rule='top_up'"):
    partitions.dirichlet(labels, 1000, 0.1, np.random.default_rng(0), min_examples=10,
                         max_tries=20)
  parts = partitions.dirichlet(labels, 1000, 0.1, np.random.default_rng(0), min_examples=10,
                               rule='top_up')
  sizes = np.array([len(p) for p in parts])
  assert sizes.min() == 10 and sizes.sum() == 70000
  partitions.check_disjoint(parts)
  # the clients the draw left at or above the minimum keep most of their examples:
  # only clients above the level the largest were cut to gave any
  kept = [len(np.intersect1d(a, b)) for a, b in zip(parts, short) if len(b) >= 10]
  assert np.mean(kept) / np.mean([len(b) for b in short if len(b) >= 10]) > 0.9


@pytest.mark.parametrize('placement', ['device', 'host'])
def test_a_pipeline_run_on_the_store_equals_the_run_on_the_padded_layout(tmp_path, placement):
  from fedjax_shift.benchmarks import build_benchmark
  from fedjax_shift.pipelines.runs import data_digest
  from fedjax_shift.pipelines.single_run import RunInputs, train_and_evaluate
  config = tiny_config(rounds=2)
  stored = build_benchmark(config.data, 0)
  assert all(isinstance(s, client_store.ClientStore) for s in stored.splits.values())
  padded = stored._replace(splits={n: s.padded() for n, s in stored.splits.items()})
  # the digest is of the data, not their layout: workdirs of padded runs stay valid
  assert data_digest(stored) == data_digest(padded)
  results = {}
  for name, bench in [('store', stored), ('padded', padded)]:
    config.data.store = placement if name == 'store' else 'device'   # host: cohort stores
    run = train_and_evaluate(config, str(tmp_path / name), 'fedavg', 0, RunInputs(bench=bench))
    results[name] = run['metrics']
  for key, value in results['padded'].items():
    np.testing.assert_allclose(results['store'][key], value, rtol=1e-5, atol=1e-6,
                               err_msg=key)


@pytest.mark.parametrize('sampling', ['uniform', 'num_examples'])
def test_a_large_population_draws_cohorts_of_the_same_distribution(sampling):
  """Above LARGE_POPULATION clients a cohort is the top C of K random keys: distinct
  ids, and over 4,000 rounds each client is drawn C/K of the time with a binomial
  spread (uniform), or never when empty and more often the larger it is (by size)."""
  from fedjax_shift.core.round import LARGE_POPULATION, sample_cohort
  num_clients, cohort = LARGE_POPULATION + 16, 64
  sizes = jnp.asarray(np.random.default_rng(0).integers(0, 4, num_clients))
  config = RoundConfig(cohort_size=cohort, sampling=sampling)
  draw = jax.jit(jax.vmap(lambda key: sample_cohort(key, sizes, config)))
  ids = np.asarray(draw(jax.random.split(jax.random.key(0), 4000)))
  assert all(len(set(row)) == cohort for row in ids[:50])
  counts = np.bincount(ids.ravel(), minlength=num_clients)
  if sampling == 'num_examples':
    assert counts[np.asarray(sizes) == 0].sum() == 0   # an empty client is never drawn
    by_size = [counts[np.asarray(sizes) == s].mean() for s in (1, 2, 3)]
    assert by_size[0] < by_size[1] < by_size[2]
  else:
    expected = 4000 * cohort / num_clients   # 15.6 draws each
    assert abs(counts.mean() - expected) < 1e-9
    assert abs(counts.std() - np.sqrt(expected * (1 - cohort / num_clients))) < 0.3


def test_a_saved_store_opens_memory_mapped_and_equals_the_store(tmp_path):
  _, stored = skewed_clients()
  client_store.save(stored, str(tmp_path / 'train'))
  opened = client_store.open_saved(str(tmp_path / 'train'), 'train')
  assert isinstance(opened.x, np.memmap)
  assert client_store.mapped_file(opened) == str(tmp_path / 'train' / 'x.npy')
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, opened), stored)
  np.testing.assert_array_equal(opened.padded().x, stored.padded().x)


def test_a_cut_or_unfinished_saved_store_is_refused_naming_split_and_file(tmp_path):
  _, stored = skewed_clients()
  folder = tmp_path / 'train'
  client_store.save(stored, str(folder))
  with open(folder / 'x.npy', 'r+b') as f:   # cut short, as by a full disk
    f.truncate(200)
  with pytest.raises(ValueError, match=r"split 'train'.*x\.npy has 200 bytes.*cut short"):
    client_store.open_saved(str(folder), 'train')
  (folder / client_store.SAVED_INDEX).unlink()   # a save that never finished
  with pytest.raises(ValueError, match=r"split 'train'.*store\.json is missing"):
    client_store.open_saved(str(folder), 'train')


def test_the_host_store_stops_when_its_mapped_file_changes_under_the_run(tmp_path):
  import os
  _, stored = skewed_clients()
  client_store.save(stored, str(tmp_path / 'train'))
  opened = client_store.open_saved(str(tmp_path / 'train'), 'train')
  host = HostStore(opened, jax.random.key(0), RoundConfig(cohort_size=3))
  host.cohort(0)
  path = tmp_path / 'train' / 'x.npy'
  info = os.stat(path)
  os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns + 10 ** 9))   # rewritten in place
  with pytest.raises(ValueError, match=r'x\.npy changed while the run read it'):
    host.cohort(1)   # the prefetched round was gathered before the change: this one stops
    host.cohort(2)
  host.close()


def test_a_run_through_store_dir_saves_once_then_trains_from_the_files(tmp_path, monkeypatch):
  from fedjax_shift.benchmarks import BENCHMARKS
  from fedjax_shift.pipelines import runs
  from fedjax_shift.pipelines.single_run import train_and_evaluate
  config = tiny_config(rounds=2, **{'data.store': 'host',
                                    'data.store_dir': str(tmp_path / 'stores')})
  first = runs.build_data(config, 0)
  folder = runs.saved_data_dir(config, 0)
  assert sorted(os.listdir(folder)) == sorted(list(first.splits) + [runs.SAVED_BENCHMARK])
  assert all(isinstance(s.x, np.memmap) for s in first.splits.values())
  builder = BENCHMARKS._entries[config.data.benchmark]

  def not_called(*args):
    raise AssertionError('the benchmark was built again')

  monkeypatch.setitem(BENCHMARKS._entries, config.data.benchmark, not_called)
  again = runs.build_data(config, 0)   # a second build reads the files
  monkeypatch.setitem(BENCHMARKS._entries, config.data.benchmark, builder)
  assert runs.data_digest(again) == runs.data_digest(first)
  plain = tiny_config(rounds=2, **{'data.store': 'host'})
  assert runs.data_digest(runs.build_data(plain, 0)) == runs.data_digest(first)
  a = train_and_evaluate(config, str(tmp_path / 'mapped'), 'fedavg', 0)
  b = train_and_evaluate(plain, str(tmp_path / 'memory'), 'fedavg', 0)
  for key, value in b['metrics'].items():
    np.testing.assert_allclose(a['metrics'][key], value, rtol=1e-6, err_msg=key)


def test_a_store_is_aligned_so_that_a_cpu_device_store_is_the_same_memory():
  _, stored = skewed_clients()
  assert stored.x.ctypes.data % client_store.ALIGNMENT == 0
  gathered = client_store.from_parts(np.asarray(stored.x), np.asarray(stored.y),
                                     [np.array([3, 1]), np.array([0])])
  assert gathered.x.ctypes.data % client_store.ALIGNMENT == 0
  np.testing.assert_array_equal(gathered.x, np.asarray(stored.x)[[3, 1, 0]])
  on_device = jax.device_put(stored.x)
  if jax.default_backend() == 'cpu':   # used in place: no second copy of the population
    assert on_device.unsafe_buffer_pointer() == stored.x.ctypes.data
