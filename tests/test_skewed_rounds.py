"""Rounds whose cost follows the real work on skewed client sizes.

The compiled round sorts the cohort by examples and runs it in vmapped groups, each
looping to its own largest client's steps and cut to a planned padded size; the loop
backend cuts each client to a bucket. Both must equal the loop reference (every client
at the padded N, one at a time) up to floating-point reordering, and say how many
steps they scanned.
"""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (backend_tolerance, build_method, grouped, run_rounds, tiny_config,
                     toy_clients)
from fedjax_shift.algorithms import ALGORITHMS
from fedjax_shift.core import algorithm as alg
from fedjax_shift.core import plan
from fedjax_shift.core import round as engine
from fedjax_shift.core.local import run_steps
from fedjax_shift.core.round import HostStore, RoundConfig, build_round, round_key

NUM_CLASSES = 3
SIZES = [2, 19, 5, 11, 0, 3, 7, 13]   # skewed, one client without data


# The families of the list: plain, proximal, stateful clients (SCAFFOLD, Ditto,
# FedRep, personal heads, local BatchNorm), ATP's α round; FedEvolve's domain pairs and
# HeteroFedTTA's groups are in tests/test_evolving.py and tests/test_hetero_fedtta.py.
FAMILIES = ['fedavg', 'fedprox', 'scaffold', 'ditto', 'fedrep', 'fedper', 'fedbn', 'atp',
            'fedtta', 'moon']


@pytest.mark.parametrize('name', FAMILIES)
def test_grouped_round_equals_the_loop_reference_on_a_skewed_cohort(name):
  model = 'bn_mlp' if ALGORITHMS.meta(name).get('batch_norm', True) else 'mlp'
  config = tiny_config(**{'model.name': model, 'client.batch_size': 3})
  data, _, _ = toy_clients(SIZES, num_classes=NUM_CLASSES)
  _, algorithm, server, clients = build_method(name, config, data, NUM_CLASSES)
  # 7 of 8 clients in groups of 3: three groups, the last with two empty slots.
  fast = grouped(data, 7, 3, straggler_prob=0.3, straggler_max_steps=2)
  reference = RoundConfig(cohort_size=7, straggler_prob=0.3, straggler_max_steps=2)
  a = run_rounds(build_round(algorithm, fast)[0], server, clients, data)
  b = run_rounds(build_round(algorithm, reference, backend='loop')[0], server, clients, data)
  np.testing.assert_array_equal(a.metrics['cohort'], b.metrics['cohort'])
  chex.assert_trees_all_close(a.server_state, b.server_state, **backend_tolerance(1e-5, 1e-6))
  chex.assert_trees_all_close(a.client_states, b.client_states,
                              **backend_tolerance(1e-5, 1e-6))
  np.testing.assert_allclose(a.metrics['client_loss'], b.metrics['client_loss'], rtol=1e-5,
                             atol=1e-6)


def test_scanned_steps_are_each_groups_largest_client_times_its_width():
  # batch 3, one epoch: sizes 12, 6, 3, 1 run 4, 2, 1, 1 steps (8 real). Sorted by
  # examples in groups of 2: [4, 2] and [1, 1] -> 2·4 + 2·1 = 10 scanned; one group of
  # 4 scans 4·4 = 16; the loop backend scans each client's own steps, 8.
  config = tiny_config(**{'model.name': 'mlp', 'client.batch_size': 3})
  data, _, _ = toy_clients([3, 12, 1, 6], num_classes=NUM_CLASSES)
  _, fedavg, server, clients = build_method('fedavg', config, data, NUM_CLASSES)
  ids, key = jnp.arange(4), jax.random.key(0)
  for round_config, backend, scanned in [(RoundConfig(cohort_size=4, client_chunk=2), 'vmap', 10),
                                         (RoundConfig(cohort_size=4), 'vmap', 16),
                                         (RoundConfig(cohort_size=4), 'loop', 8)]:
    out = build_round(fedavg, round_config, backend=backend)[1](server, clients, data, ids, key)
    assert int(out.metrics['local_steps']) == 8
    assert int(out.metrics['scanned_steps']) == scanned, (round_config, backend)


def test_a_vmapped_step_loop_runs_to_the_largest_count_and_keeps_finished_lanes():
  counts = jnp.array([0, 2, 5])
  out = jax.vmap(lambda n: run_steps(lambda c, s: c + s + 1, jnp.int32(0), n, 8))(counts)
  np.testing.assert_array_equal(out, [0, 3, 15])   # Σ_{s<n} (s + 1)
  for unroll in (3, True):   # blocks of 3 masked past n; every step of the bound unrolled
    out = jax.vmap(lambda n: run_steps(lambda c, s: c + s + 1, jnp.int32(0), n, 8,
                                       unroll))(counts)
    np.testing.assert_array_equal(out, [0, 3, 15])


def test_the_loop_backend_cuts_each_client_to_its_bucket():
  def client_update(server, client_state, data, rng):
    del rng
    return alg.ClientOutput(server, {'rows': jnp.float32(data.x.shape[0]),
                                     'seen': jnp.sum(data.mask).astype(jnp.float32)}), client_state

  toy = alg.FederatedAlgorithm(lambda r, x: jnp.float32(0.), lambda s: (), client_update,
                               lambda s, o, w: s, None, lambda s: s)
  data, _, _ = toy_clients([3, 12, 1, 6], num_classes=NUM_CLASSES)
  round_config = RoundConfig(cohort_size=4, weighting='uniform', example_buckets=(4, 8, 12))
  _, round_host = build_round(toy, round_config, backend='loop')
  out = round_host(jnp.float32(0.), (), data, jnp.arange(4), jax.random.key(0))
  # Every client's examples are all there, in rows of the smallest bucket that holds
  # them (sizes 3, 12, 1, 6 -> 4, 12, 4, 8; uniform weights, so the metrics are means).
  np.testing.assert_allclose(out.metrics['cohort_examples'], 22)
  assert float(out.metrics['rows']) == pytest.approx(np.mean([4, 12, 4, 8]))
  assert float(out.metrics['seen']) == pytest.approx(np.mean([3, 12, 1, 6]))


def test_groups_are_cut_to_bounds_no_sampled_cohort_can_exceed():
  sizes = np.array([40, 3, 25, 9, 17, 1, 30, 12])
  # Sorted: 40 30 25 17 12 9 3 1. A cohort of 6 in groups of 2 starts its groups at its
  # 1st, 3rd and 5th largest clients: at most 40, 25 and 12.
  bounds = plan.group_bounds(sizes, 6, 2)
  np.testing.assert_array_equal(bounds, [40, 25, 12])
  assert plan.plan_group_examples(bounds, (16, 32, 64)) == (64, 32, 16)
  rng = np.random.default_rng(0)
  for _ in range(200):
    cohort = np.sort(rng.choice(sizes, 6, replace=False))[::-1]
    assert np.all(cohort[::2] <= [40, 25, 12])


def test_fitted_buckets_minimise_the_copied_examples():
  bounds = np.array([100, 90, 10, 9, 8, 7])   # groups of one client, sorted
  # One size copies 6 × 100 = 600. Two: {100, 10} copies 100 + 100 + 10·4 = 240 (every
  # other split copies more, e.g. {100, 9}: 100·3 + 9·3 = 327); three: {100, 90, 10},
  # 100 + 90 + 10·4 = 230.
  assert plan.fit_example_buckets(bounds, 1, 1) == (100,)
  assert plan.fit_example_buckets(bounds, 1, 2) == (10, 100)
  assert plan.fit_example_buckets(bounds, 1, 3) == (10, 90, 100)


def test_the_fitted_width_keeps_scanned_steps_within_the_bound():
  steps = np.array([10, 1, 1, 1, 1, 1, 1, 1])   # one cohort, sorted
  # One group of 8 scans 80 for 17 real steps; groups of 4: 4·10 + 4·1 = 44; of 2:
  # 2·10 + 2 + 2 + 2 = 26 (1.53x); of 1: 17. With max 1.6 the widest within is 2.
  assert plan.fit_client_chunk(steps, 1.6) == 2
  assert plan.fit_client_chunk(steps, 5.0) == 0    # the whole cohort: 80 <= 85
  assert plan.fit_client_chunk(np.full(8, 3), 1.2) == 0   # uniform: one group
  assert plan.fit_client_chunk(steps, 1.0, multiple=2) == 2   # a 2-device mesh
  # Over likely cohorts the mean counts: a second cohort [2, 2, ..., 2] scans 16 at
  # any width, so groups of 2 scan (26 + 16) / 2 = 21 of (17 + 16) / 2 = 16.5 real
  # (1.27x), groups of 4 (44 + 16) / 2 = 30 (1.82x): with max 1.3, width 2.
  assert plan.fit_client_chunk(np.stack([steps, np.full(8, 2)]), 1.3) == 2


def test_simulated_cohorts_are_drawn_as_the_round_draws_them():
  sizes = np.arange(1, 41)
  cohorts = plan.simulate_cohorts(sizes, 10, draws=300)
  assert cohorts.shape == (300, 10)
  assert np.all(np.diff(cohorts, axis=1) < 0)   # distinct clients, sorted most first
  # uniform: a client's chance to be drawn is C/K = 1/4, the mean size 20.5 (±0.2 here);
  # ∝ size: the mean drawn size is above (E[size²] / E[size] = 27.0 for the first draw)
  assert abs(cohorts.mean() - 20.5) < 0.5
  assert plan.simulate_cohorts(sizes, 10, 'num_examples', draws=300).mean() > 24
  np.testing.assert_array_equal(plan.simulate_cohorts(sizes, 10, draws=5),
                                plan.simulate_cohorts(sizes, 10, draws=5))   # a fixed seed
  np.testing.assert_array_equal(plan.simulate_cohorts(sizes[:8], 8), [sizes[:8][::-1]])


@pytest.mark.parametrize('buckets,message', [
    ((), 'is empty'), ((8, 4, 16), 'strictly ascending'), ((0, 4, 16), 'positive'),
    ((4, 8), 'largest client')])
def test_a_bad_bucket_list_is_refused_naming_the_field(buckets, message):
  with pytest.raises(ValueError, match=message) as err:
    plan.check_example_buckets(buckets, 12, 'config.engine.example_buckets')
  assert 'config.engine.example_buckets' in str(err.value)


def test_the_pipeline_refuses_buckets_before_compiling(tmp_path):
  from fedjax_shift.pipelines import run_config
  from fedjax_shift.pipelines.single_run import train_and_evaluate
  config = tiny_config(**{'engine.example_buckets': (8, 4)})
  with pytest.raises(ValueError, match='engine.example_buckets'):
    run_config.validate(config)
  config = tiny_config(**{'engine.example_buckets': (2, 3)})   # smaller than the clients
  with pytest.raises(ValueError, match='engine.example_buckets.*largest client'):
    train_and_evaluate(config, str(tmp_path), 'fedavg', 0)


def test_host_store_and_round_scan_equal_the_grouped_device_round():
  config = tiny_config(**{'model.name': 'mlp', 'client.batch_size': 3})
  data, _, _ = toy_clients(SIZES, num_classes=NUM_CLASSES)
  _, fedavg, server, clients = build_method('fedavg', config, data, NUM_CLASSES)
  round_config = grouped(data, 5, 2)
  round_device, round_host = build_round(fedavg, round_config)
  seed_key = jax.random.key(9)
  device = run_rounds(round_device, server, clients, data, rounds=3, seed=9)
  store = HostStore(data, seed_key, round_config)
  s, c = server, clients
  for r in range(3):
    cohort, ids = store.cohort(r)
    out = round_host(s, c, cohort, ids, round_key(seed_key, r))
    s, c = out.server_state, out.client_states
  store.close()
  chex.assert_trees_all_close(device.server_state, s, atol=1e-6)
  scan = build_round(fedavg, round_config, rounds_per_call=3)[0]
  keys = jax.vmap(lambda r: round_key(seed_key, r))(jnp.arange(3))
  scanned = scan(server, clients, data, keys, jnp.ones(3, bool))
  chex.assert_trees_all_close(device.server_state, scanned.server_state, atol=1e-6)


def test_vmapped_seeds_run_the_grouped_round():
  config = tiny_config(**{'model.name': 'mlp', 'client.batch_size': 3})
  data, _, _ = toy_clients(SIZES, num_classes=NUM_CLASSES)
  _, fedavg, server, clients = build_method('fedavg', config, data, NUM_CLASSES)
  round_device = build_round(fedavg, grouped(data, 6, 2))[0]
  keys = jnp.stack([jax.random.key(1), jax.random.key(2)])
  stack = lambda tree: jax.tree.map(lambda leaf: jnp.stack([leaf, leaf]), tree)
  both = jax.vmap(round_device, (0, 0, None, 0))(stack(server), stack(clients), data, keys)
  for i in range(2):
    one = round_device(server, clients, data, keys[i])
    chex.assert_trees_all_close(jax.tree.map(lambda leaf: leaf[i], both.server_state),
                                one.server_state, atol=1e-6)


def test_rounds_record_their_real_and_scanned_steps(tmp_path):
  from fedjax_shift.metrics import read_metrics
  from fedjax_shift.pipelines.single_run import train_and_evaluate
  config = tiny_config(**{'data.partition': 'dirichlet', 'data.dirichlet_alpha': 0.1})
  train_and_evaluate(config, str(tmp_path), 'fedavg', 0)
  records = [r for r in read_metrics(str(tmp_path / 'metrics.jsonl')) if 'loss' in r]
  assert records
  for record in records:
    assert 1 <= record['local_steps'] <= record['scanned_steps']


def test_max_scanned_zero_keeps_one_vmapped_group():
  from fedjax_shift.pipelines.programs import round_config
  data, _, _ = toy_clients(SIZES, num_classes=NUM_CLASSES)
  config = tiny_config(**{'cohort_size': 8, 'engine.backend': 'vmap', 'client.batch_size': 2})
  assert round_config(config, data).client_chunk > 0
  config.engine.max_scanned = 0.0
  assert round_config(config, data).client_chunk == 0
  config.engine.backend = 'loop'
  assert round_config(config, data).example_buckets[-1] == max(SIZES)


def test_a_round_out_of_device_memory_names_the_fields_to_lower():
  def exhausted(*args):
    raise jax.errors.JaxRuntimeError('RESOURCE_EXHAUSTED: Out of memory while trying to '
                                     'allocate 80.00GiB.')

  round_fn = engine.ExplainedRound(exhausted, RoundConfig(cohort_size=1000,
                                                          client_chunk=250))
  with pytest.raises(MemoryError, match=r'config.engine.client_chunk \(now 250.*'
                                        r'config.cohort_size'):
    round_fn()

  def other(*args):
    raise jax.errors.JaxRuntimeError('INVALID_ARGUMENT: something else')

  with pytest.raises(jax.errors.JaxRuntimeError, match='INVALID_ARGUMENT'):
    engine.ExplainedRound(other, RoundConfig(cohort_size=4))()


def test_likely_bounds_hold_likely_cohorts_below_the_bounds_every_cohort_holds():
  # Ten clients of 100 examples among 990 of 1. A cohort of 10 in groups of 5 holds a
  # client of 100 with probability 1 - C(990,10)/C(1000,10) ≈ 9.6 % (so in some of
  # 1,024 simulated cohorts: group 0's likely bound is 100), and six of them with
  # probability C(10,6)·C(990,4)/C(1000,10) ≈ 3e-12 (group 1's likely bound is 1),
  # where the population's 6th largest client, the bound every cohort holds, is 100.
  sizes = np.array([100] * 10 + [1] * 990)
  np.testing.assert_array_equal(plan.group_bounds(sizes, 10, 5), [100, 100])
  np.testing.assert_array_equal(
      plan.likely_group_bounds(plan.simulate_cohorts(sizes, 10), 5), [100, 1])
  np.testing.assert_array_equal(   # ∝ size: the big clients fill the cohort
      plan.likely_group_bounds(plan.simulate_cohorts(sizes, 10, 'num_examples'), 5),
      [100, 100])
  # A cohort as large as the population is the population: the exact bounds.
  np.testing.assert_array_equal(plan.likely_group_bounds(plan.simulate_cohorts(sizes[:8], 8), 3),
                                plan.group_bounds(sizes[:8], 8, 3))


def test_a_cohort_beyond_the_likely_plan_runs_at_the_fallback_and_equals_it():
  config = tiny_config(**{'model.name': 'mlp', 'client.batch_size': 3})
  data, _, _ = toy_clients(SIZES, num_classes=NUM_CLASSES)
  _, fedavg, server, clients = build_method('fedavg', config, data, NUM_CLASSES)
  safe = grouped(data, 5, 2)            # groups of 2 of a cohort of 5: three bounds
  likely = safe._replace(group_examples=(19, 5, 3), fallback_examples=safe.group_examples)
  fallback_round, safe_round = build_round(fedavg, likely)[0], build_round(fedavg, safe)[0]
  sizes = np.asarray(data.num_examples)
  seen = set()
  s, c = server, clients
  for r in range(8):
    key = round_key(jax.random.key(4), r)
    a, b = fallback_round(s, c, data, key), safe_round(s, c, data, key)
    leaders = np.sort(sizes[np.asarray(a.metrics['cohort'])])[::-1][::2]
    expected = float(np.any(leaders > np.array([19, 5, 3])))
    assert float(a.metrics['fallback_plan']) == expected
    seen.add(expected)
    chex.assert_trees_all_close(a.server_state, b.server_state, atol=1e-6)
    np.testing.assert_allclose(a.metrics['client_loss'], b.metrics['client_loss'], atol=1e-6)
    s, c = b.server_state, b.client_states
  assert seen == {0.0, 1.0}   # both branches ran


def test_the_plan_cuts_a_large_population_to_likely_bounds_but_not_vmapped_seeds():
  from fedjax_shift.data.store import from_arrays
  from fedjax_shift.pipelines.programs import round_config
  # Examples of 28 × 28 floats, so that the likely plan saves the copy of more than
  # the 8 MB a round a compiled size must save (programs.MIN_SHAPE_SAVING_BYTES).
  sizes = np.array([600] * 10 + [2] * 1990)
  train = from_arrays(np.zeros((int(sizes.sum()), 784), np.float32),
                                  np.zeros(int(sizes.sum()), np.int32), sizes, 'train')
  config = tiny_config(**{'cohort_size': 40, 'engine.client_chunk': 8,
                          'engine.backend': 'vmap', 'client.batch_size': 2})
  planned = round_config(config, train, 'fedavg')
  # Every cohort: the population's 1st, 9th, 17th, ... largest (600, 600, 2, 2, 2); a
  # likely cohort of 40 holds at most a few of the ten clients of 600.
  assert planned.fallback_examples[:2] == (600, 600)
  assert planned.group_examples[0] == 600 and planned.group_examples[1] < 600
  for field, value in [('engine.vmap_seeds', True), ('engine.likely_plan', False)]:
    other = tiny_config(**{'cohort_size': 40, 'engine.client_chunk': 8, field: value,
                           'engine.backend': 'vmap', 'client.batch_size': 2})
    assert round_config(other, train, 'fedavg').fallback_examples == ()
    assert round_config(other, train, 'fedavg').group_examples == planned.fallback_examples


def test_out_of_memory_where_a_result_is_read_names_the_fields_and_the_bytes(tmp_path):
  # The round's call is dispatched asynchronously: the allocation fails when the loop
  # reads the round's metrics, outside the compiled round's own explanation.
  from fedjax_shift.pipelines import loop

  class Exhausted:
    def __array__(self, *args, **kwargs):
      raise jax.errors.JaxRuntimeError('RESOURCE_EXHAUSTED: Out of memory while trying to '
                                       'allocate 6442450944 bytes.')

  trainer = loop.Trainer(lambda state, start, stop: (state, {'loss': Exhausted()}),
                         loop.only_run)
  run = loop.Run('fedavg seed 0', str(tmp_path), None, None, 0, 0.0, lambda state: {})
  with pytest.raises(MemoryError, match=r'ran out of device memory \(an allocation of '
                                        r'6442450944 bytes\): lower config.engine.client_chunk'
                                        r'.*config.cohort_size.*data.store=.host.'):
    loop.train([run], (), trainer, loop.Cadence(rounds=2, eval_every=1, checkpoint_every=1,
                                                progress=False))
  other = lambda state, start, stop: (_ for _ in ()).throw(
      jax.errors.JaxRuntimeError('INVALID_ARGUMENT: something else'))
  with pytest.raises(jax.errors.JaxRuntimeError, match='INVALID_ARGUMENT'):
    loop.train([run], (), loop.Trainer(other, loop.only_run),
               loop.Cadence(rounds=2, eval_every=1, checkpoint_every=1, progress=False))
