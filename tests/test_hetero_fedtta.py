"""HeteroFedTTA (Ye et al., UPFL 2023 Sec. 3.4, Eq. 14, Algorithm 2) and the grouped round."""
import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_shift import pipelines
from fedjax_shift.algorithms import hetero_fedtta
from fedjax_shift.config import base_config
from fedjax_shift.core.algorithm import ClientData, ClientOutput
from fedjax_shift.core.groups import (build_grouped_round, cohort_sizes, init_group_states,
                                      split_groups)
from fedjax_shift.core.local import LocalSchedule
from fedjax_shift.core.round import NO_STEP_LIMIT
from fedjax_shift.parts import fedtta_step
from helpers import backend_tolerance, compiled_programs, override, toy_clients

SHAPE = (4, 4, 1)
NUM_CLASSES = 3


def hparams(**fields):
  hp = base_config().hetero_fedtta
  hp.sizes = ('small', 'big')
  hp.public_batch_size = 4
  hp.digest_steps = 2
  hp.new_client_digest_steps = 2
  for key, value in fields.items():
    hp[key] = value
  return hp


def setup(hp, sizes=(3, 2, 4, 3, 5), num_epochs=0, num_steps=2):
  """A 2-architecture algorithm over 5 toy clients: small = 0, 2, 4; big = 1, 3."""
  data, _, _ = toy_clients(sizes, SHAPE, NUM_CLASSES)
  public_x = np.random.default_rng(1).random((8,) + SHAPE).astype(np.float32)
  schedule = LocalSchedule(batch_size=2, num_epochs=num_epochs, num_steps=num_steps,
                           max_examples=data.max_examples)
  algorithm = hetero_fedtta.build(hp, NUM_CLASSES, public_x, optax.sgd(0.1), schedule,
                                  jnp.asarray(data.x[0, :1]))
  group_ids = [np.array([0, 2, 4], np.int32), np.array([1, 3], np.int32)]
  return algorithm, data, public_x, group_ids


ROUNDS = {}


def run_round(algorithm, data, group_ids, server, states, key, cohort=(3, 2)):
  """One grouped round; the compiled round is kept per (algorithm, cohort)."""
  cache_key = (id(algorithm), tuple(cohort))
  if cache_key not in ROUNDS:
    ROUNDS[cache_key] = (algorithm, build_grouped_round(algorithm, cohort, 'uniform'))
  return ROUNDS[cache_key][1](server, states, split_groups(data, group_ids),
                              tuple(jnp.asarray(i) for i in group_ids), key)


def loop_round(algorithm, data, group_ids, server, states, key, cohort=(3, 2)):
  """The round as a Python loop over clients: the same cohort draw, one client_update
  call per client, the knowledge as the plain mean of the clients' public logits."""
  outputs, new_states = [], []
  for g, (group, ids, stack) in enumerate(zip(algorithm.groups, group_ids, states)):
    slots = jax.random.choice(jax.random.fold_in(jax.random.fold_in(key, 0), g), len(ids),
                              (cohort[g],), replace=False)
    update = jax.jit(group.client_update)
    for slot in np.asarray(slots):
      client = int(ids[slot])
      one = ClientData(jnp.asarray(data.x[client]), jnp.asarray(data.y[client]),
                       jnp.asarray(data.mask[client]), jnp.asarray(data.num_examples[client]),
                       jnp.int32(NO_STEP_LIMIT))
      state = jax.tree.map(lambda a: a[slot], stack)
      output, state = update(server, state, one,
                             jax.random.fold_in(jax.random.fold_in(key, 1), client))
      outputs.append(output.update)
      stack = jax.tree.map(lambda a, b: a.at[slot].set(b), stack, state)
    new_states.append(stack)
  mean = lambda name: sum(o[name] for o in outputs) / len(outputs)
  return hetero_fedtta.Knowledge(mean('base'), mean('personalized'), server.round + 1), new_states


@pytest.fixture(scope='module')
def toy():
  hp = hparams()
  algorithm, data, public_x, group_ids = setup(hp)
  server = algorithm.init(jax.random.key(0))
  states = init_group_states(algorithm, jax.random.key(1), group_ids)
  return hp, algorithm, data, public_x, group_ids, server, states


def test_grouped_round_equals_a_loop_over_clients(toy):
  # 2 of the 3 small clients and 1 of the 2 big ones: sampling, gather, scatter.
  _, algorithm, data, _, group_ids, server, states = toy
  for r in range(2):   # round 0 (no digest) and round 1 (digest of round 0's knowledge)
    key = jax.random.key(10 + r)
    out = run_round(algorithm, data, group_ids, server, states, key, (2, 1))
    want_server, want_states = loop_round(algorithm, data, group_ids, server, states, key,
                                          (2, 1))
    chex.assert_trees_all_close(out.server_state, want_server, **backend_tolerance(2e-5, 1e-6))
    chex.assert_trees_all_close(out.group_states, tuple(want_states),
                                **backend_tolerance(2e-5, 1e-6))
    server, states = out.server_state, out.group_states
  assert int(server.round) == 2
  assert compiled_programs(ROUNDS[(id(algorithm), (2, 1))][1]) == 1   # one compilation


def test_grouped_round_on_skewed_sizes_equals_a_loop_over_clients():
  # One epoch of batch 2 on clients of 1 to 11 examples: 1 to 6 steps, each client's
  # step loop ending with its own steps inside the vmapped group.
  algorithm, data, _, group_ids = setup(hparams(), sizes=(1, 11, 6, 2, 9), num_epochs=1,
                                        num_steps=0)
  server = algorithm.init(jax.random.key(0))
  states = init_group_states(algorithm, jax.random.key(1), group_ids)
  key = jax.random.key(3)
  out = run_round(algorithm, data, group_ids, server, states, key)
  want_server, want_states = loop_round(algorithm, data, group_ids, server, states, key)
  chex.assert_trees_all_close(out.server_state, want_server, **backend_tolerance(2e-5, 1e-6))
  chex.assert_trees_all_close(out.group_states, tuple(want_states),
                              **backend_tolerance(2e-5, 1e-6))


def test_the_grouped_round_on_a_client_store_equals_the_padded_layout(toy):
  # The groups' data are the store's clients padded to N (split_groups): the same
  # arrays bit for bit, so the compiled round gives the same state exactly.
  from fedjax_shift.data import store
  _, algorithm, data, _, group_ids, server, states = toy
  stored = store.compact(data)
  assert isinstance(stored, store.ClientStore)
  key = jax.random.key(21)
  a = run_round(algorithm, stored, group_ids, server, states, key, (2, 1))
  b = run_round(algorithm, data, group_ids, server, states, key, (2, 1))
  chex.assert_trees_all_equal(a.server_state, b.server_state)
  chex.assert_trees_all_equal(a.group_states, b.group_states)


def test_knowledge_is_the_mean_of_the_clients_public_logits(toy):
  """Alg. 2, Aggregate: F_base = 1/N Σ f(D_p; ψ_i) and F_per = 1/N Σ f(D_p; ψ̃_i), with
  ψ̃_i the inner step of ψ_i on each public batch, recomputed from the returned states."""
  hp, algorithm, data, public_x, group_ids, server, states = toy
  out = run_round(algorithm, data, group_ids, server, states, jax.random.key(2))
  base, personal = [], []
  for size, stack, ids in zip(hp.sizes, out.group_states, group_ids):
    arch = hetero_fedtta.architecture(size, NUM_CLASSES)
    for i in range(len(ids)):
      params = jax.tree.map(lambda a: a[i], stack)
      base.append(arch.module.apply({'params': params['base']}, public_x))
      blocks = []
      for x in public_x.reshape((2, 4) + SHAPE):
        adapted = fedtta_step.inner_step(
            arch.module, arch.adaptation_module, params['base'], params['adaptation'], x,
            jnp.ones(4), fedtta_step.InnerStep(hp.inner_learning_rate, hp.norm_epsilon))
        blocks.append(arch.module.apply({'params': adapted}, x))
      personal.append(jnp.concatenate(blocks))
  chex.assert_trees_all_close(out.server_state.base, sum(base) / 5,
                              **backend_tolerance(1e-5, 1e-6))
  chex.assert_trees_all_close(out.server_state.personalized, sum(personal) / 5,
                              **backend_tolerance(1e-5, 1e-6))


def test_probability_ensemble_is_the_log_of_the_weighted_mean_softmax():
  hp = hparams(ensemble='probabilities')
  algorithm, *_ = setup(hp)
  logits = jax.random.normal(jax.random.key(0), (3, 8, NUM_CLASSES))
  weights = jnp.array([0.5, 0.25, 0.25])
  outputs = ClientOutput({'base': logits, 'personalized': 2 * logits}, {})
  knowledge = algorithm.server_update(algorithm.init(jax.random.key(0)), outputs, weights)
  probs = np.exp(np.asarray(logits, np.float64))
  probs /= probs.sum(-1, keepdims=True)
  want = np.log(np.tensordot(np.asarray(weights), probs, axes=1))
  np.testing.assert_allclose(knowledge.base, want, rtol=1e-5, atol=1e-6)
  assert int(knowledge.round) == 1


@pytest.mark.parametrize('kd_lambda', [0.0, 0.5])
def test_kd_loss_is_eq14_computed_by_hand(kd_lambda):
  """Eq. 14 = mean KL(σ(F_per) ‖ σ(f(x; ψ̃))) + λ mean KL(σ(F_base) ‖ σ(f(x; ψ))),
  the KLs written out with numpy."""
  hp = hparams(kd_lambda=kd_lambda)
  arch = hetero_fedtta.architecture('small', NUM_CLASSES)
  x = jnp.asarray(np.random.default_rng(3).random((4,) + SHAPE), jnp.float32)
  params = hetero_fedtta.init_params(arch, jax.random.key(4), x)
  teacher_base = np.random.default_rng(5).normal(size=(4, NUM_CLASSES))
  teacher_per = np.random.default_rng(6).normal(size=(4, NUM_CLASSES))
  adapted = fedtta_step.inner_step(
      arch.module, arch.adaptation_module, params['base'], params['adaptation'], x,
      jnp.ones(4), fedtta_step.InnerStep(hp.inner_learning_rate, hp.norm_epsilon))
  student_per = np.asarray(arch.module.apply({'params': adapted}, x), np.float64)
  student_base = np.asarray(arch.module.apply({'params': params['base']}, x), np.float64)

  def kl(teacher, student):
    p = np.exp(teacher) / np.exp(teacher).sum(-1, keepdims=True)
    q = np.exp(student) / np.exp(student).sum(-1, keepdims=True)
    return np.mean(np.sum(p * np.log(p / q), -1))

  want = kl(teacher_per, student_per) + kd_lambda * kl(teacher_base, student_base)
  got = hetero_fedtta.kd_loss(arch, params, x, jnp.asarray(teacher_base, jnp.float32),
                              jnp.asarray(teacher_per, jnp.float32), hp)
  np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_round_zero_has_no_knowledge_to_digest_and_later_rounds_do(toy):
  # One small client: digest_steps 2 (the toy's) against 0, at knowledge round 0 and 1.
  _, algorithm, data, _, group_ids, server, states = toy
  no_digest, *_ = setup(hparams(digest_steps=0))
  one = ClientData(*(jnp.asarray(a[0]) for a in data), jnp.int32(NO_STEP_LIMIT))
  params = jax.tree.map(lambda a: a[0], states[0])
  knowledge = server._replace(base=jax.random.normal(jax.random.key(3), server.base.shape),
                              personalized=jax.random.normal(jax.random.key(4),
                                                             server.base.shape))
  with_digest = jax.jit(algorithm.groups[0].client_update)
  without = jax.jit(no_digest.groups[0].client_update)
  key = jax.random.key(5)
  (first, first_params), (_, plain_params) = (with_digest(knowledge, params, one, key),
                                              without(knowledge, params, one, key))
  chex.assert_trees_all_close(first_params, plain_params)
  assert float(first.metrics['kd_loss']) == 0
  later = knowledge._replace(round=jnp.int32(1))
  (second, second_params), (_, plain_params) = (with_digest(later, params, one, key),
                                                without(later, params, one, key))
  gap = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), second_params, plain_params)
  assert max(jax.tree.leaves(gap)) > 1e-4 and float(second.metrics['kd_loss']) > 0


def test_groups_keep_their_own_architectures(toy):
  _, algorithm, data, _, group_ids, server, states = toy
  out = run_round(algorithm, data, group_ids, server, states, jax.random.key(0))
  kernels = [s['base']['encoder']['Dense_0']['kernel'].shape for s in out.group_states]
  assert kernels == [(3, 16, 100), (2, 16, 400)]   # small: 100 hidden units, big: 400


@pytest.mark.slow   # convolutions in a grouped round: ~1 min on a 2-core CPU; the
                    # LeNet-5 parameter counts are checked unmarked in tests/test_models.py
def test_table3_lenet5_groups_have_the_papers_channels():
  """base_model='lenet5': App. G Table 3's conv widths 16/32 (small) and 64/128 (big),
  then MLP(512); one grouped round runs."""
  algorithm, data, _, group_ids = setup(hparams(base_model='lenet5'))
  server = algorithm.init(jax.random.key(0))
  states = init_group_states(algorithm, jax.random.key(1), group_ids)
  out = run_round(algorithm, data, group_ids, server, states, jax.random.key(0))
  convs = [(s['base']['encoder']['Conv_0']['kernel'].shape[-1],
            s['base']['encoder']['Conv_1']['kernel'].shape[-1],
            s['base']['encoder']['Dense_0']['kernel'].shape[-1]) for s in out.group_states]
  assert convs == [(16, 32, 512), (64, 128, 512)]
  assert np.all(np.isfinite(np.asarray(out.server_state.base)))


def test_new_client_drift_is_zero_without_digest_and_grows_with_it(toy):
  """‖θ − θ_0‖ / ‖θ_0‖ of a new client after digesting the knowledge: 0 with no digest
  step (the initialisation itself), > 0 after steps on non-zero knowledge."""
  hp, algorithm, data, public_x, group_ids, server, states = toy
  knowledge = run_round(algorithm, data, group_ids, server, states,
                        jax.random.key(0)).server_state
  example_x = jnp.asarray(data.x[0, :1])
  drifts = {}
  for steps in (0, 5):
    _, drifts[steps] = hetero_fedtta.new_client_params(
        'small', NUM_CLASSES, hparams(new_client_digest_steps=steps), knowledge, public_x,
        optax.sgd(0.1), example_x, jax.random.key(3))
  assert drifts[0] == {'base': 0.0, 'adaptation': 0.0}
  assert float(drifts[5]['base']) > 0 and float(drifts[5]['adaptation']) > 0


def test_sizes_assignment_and_stratified_cohorts():
  sizes = hetero_fedtta.assign_sizes(10, ('small', 'medium', 'big'), np.random.default_rng(0))
  counts = [sizes.count(s) for s in ('small', 'medium', 'big')]
  assert sorted(counts) == [3, 3, 4]
  assert sizes == hetero_fedtta.assign_sizes(10, ('small', 'medium', 'big'),
                                             np.random.default_rng(0))
  assert cohort_sizes((17, 17, 16), 50) == (17, 17, 16)     # every client
  assert cohort_sizes((17, 17, 16), 10) == (3, 3, 3)        # round(10 · K_g / 50)
  assert cohort_sizes((1, 9), 2) == (1, 2)                  # at least one per group


def hetero_config(**fields):
  from configs import hetero_fedtta as config_file
  return override(config_file.get_config('tiny'), **fields)


def test_hetero_pipeline_runs_and_resumes(tmp_path):
  config = hetero_config(**{'hetero_fedtta.sizes': ('small', 'big'), 'rounds': 2,
                            'eval_every': 1})
  results = pipelines.run(config, str(tmp_path))
  (first,) = results.records['results']
  assert first['algorithm'] == 'hetero_fedtta_lambda0.8'
  for key in ('personalized/val/accuracy', 'base/val/accuracy', 'digested/test/accuracy',
              'personalized/test/accuracy', 'personalized/test_small/accuracy',
              'personalized_pp/val/accuracy', 'personalized_pp/test/accuracy',
              'knowledge_base/public/accuracy', 'knowledge_personalized/public/accuracy'):
    assert 0.0 <= first['metrics'][key] <= 1.0, key
  for part in ('base', 'adaptation'):   # the new clients' digest moved both from init
    assert first['metrics'][f'new_clients/{part}_drift'] > 0
  assert first['uploaded_parameters'] == 2 * 40 * 10   # f(D_p; ψ) and f(D_p; ψ̃)
  assert first['group_sizes'] == {'small': 3, 'big': 3}
  assert len(first['evaluations']) == 2
  run_dir = os.path.join(tmp_path, 'hetero_fedtta_lambda0.8', 'seed_0')
  with open(os.path.join(run_dir, 'partition.json')) as f:
    assert len(json.load(f)['new_client_sizes']) == 6
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    assert len(f.readlines()) == 2
  again = pipelines.run(config, str(tmp_path))   # finished: restored, not retrained
  assert again.records['results'][0]['metrics'] == first['metrics']
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    assert len(f.readlines()) == 2
  assert 'hetero_fedtta_lambda0.8' in results.tables[0]


def test_lambda_sweep_runs_one_directory_per_lambda_and_seed(tmp_path):
  from fedjax_shift.pipelines import hetero
  config = hetero_config(**{'hetero.kd_lambdas': (0.0, 0.4), 'seeds': (0, 1)})
  dirs = hetero.run_dirs(config, str(tmp_path))
  assert [os.path.relpath(d, tmp_path) for d, _, _ in dirs] == [
      'hetero_fedtta_lambda0/seed_0', 'hetero_fedtta_lambda0/seed_1',
      'hetero_fedtta_lambda0.4/seed_0', 'hetero_fedtta_lambda0.4/seed_1']
  assert [c.hetero_fedtta.kd_lambda for _, c, _ in dirs] == [0.0, 0.0, 0.4, 0.4]
  assert {section for _, _, section in dirs} == {'hetero_fedtta'}


@pytest.mark.slow   # FedTTA++'s runner has the same check unmarked (tests/test_fedtta.py)
def test_new_clients_labels_are_never_read():
  """Poisoned new-client labels leave every new client's predictions unchanged."""
  from fedjax_shift.pipelines import hetero
  config = hetero_config(**{'hetero_fedtta.sizes': ('small',)})
  bench = hetero.build_data(config, 0)
  clean = hetero.new_client_predictions(bench, config, 0)
  test = bench.splits['test']
  poisoned = test._replace(y=(test.y + 1) % 10)
  bench = bench._replace(splits={**bench.splits, 'test': poisoned})
  np.testing.assert_array_equal(hetero.new_client_predictions(bench, config, 0), clean)
  assert (clean[np.asarray(test.mask)] >= 0).all()


@pytest.mark.parametrize('field, value, message', [
    ('hetero_fedtta.sizes', ('small', 'huge'), 'hetero_fedtta.sizes'),
    ('data.public_examples', 30, 'data.upfl.public_examples'),
    ('data.public_source', '', 'data.upfl.public_source'),
    ('data.upfl.public_source', 'imagenet', 'data.upfl.public_source'),
    ('hetero_fedtta.kd_lambda', -1.0, 'hetero_fedtta.kd_lambda'),
    ('hetero_fedtta.ensemble', 'median', 'hetero_fedtta.ensemble'),
    ('hetero_fedtta.sizes', (), 'hetero_fedtta.sizes'),
    ('hetero_fedtta.digest_step', 3, 'hetero_fedtta.digest_step: unknown field'),
    ('data.store', 'host', 'data.store'),
    ('engine.rounds_per_call', 5, 'engine.rounds_per_call'),
    ('engine.backend', 'loop', 'engine.backend'),
    ('eval_adapters', ('tent:online',), 'eval_adapters'),
    ('hetero.kd_lambdas', (0.5, -0.1), 'hetero.kd_lambdas'),
    ('hetero.kd_lambdas', (0.8, 0.8), 'hetero.kd_lambdas: names 0.8 more than once'),
    ('model.name', 'bn_mlp', 'model.name'),
    ('data.benchmark', 'label_skew_corrupted', 'data.benchmark'),
    ('algorithms', ('fedtta',), 'algorithms'),
])
def test_bad_input_names_the_field(tmp_path, field, value, message):
  config = hetero_config(**{field: value})
  with pytest.raises(ValueError, match=message.replace('.', r'\.')):
    pipelines.run(config, str(tmp_path))


def test_a_public_set_larger_than_its_source_is_an_error(tmp_path):
  config = hetero_config(**{'data.public_source': 'uci_digits', 'data.public_examples': 2000,
                            'hetero_fedtta.public_batch_size': 20})
  with pytest.raises(ValueError, match=r'data\.upfl\.public_examples=2000: uci_digits has only 1797'):
    pipelines.run(config, str(tmp_path))


def test_public_sets_are_disjoint_from_every_client_and_framed_like_mnist():
  from fedjax_shift.benchmarks import data_view, upfl
  from fedjax_shift.pipelines import hetero
  config = hetero_config(**{'data.num_clients': 20})
  bench = hetero.build_data(config, 0)
  public_x, _ = upfl.public_set(data_view(config.data), bench.info)
  assert public_x.shape == (40, 28, 28, 1)
  held_out = {x.tobytes() for x in public_x}
  for split in bench.splits.values():
    for k in range(split.num_clients):
      for x in split.x[k, :split.num_examples[k]]:
        assert x.tobytes() not in held_out
  # Without a public set the partition is the one FedTTA's runs had.
  plain = hetero.build_data(override(config, **{'data.public_source': ''}), 0)
  assert 'public' not in plain.info
  assert sum(int(s.num_examples.sum()) for s in plain.splits.values()) == \
      40 + sum(int(s.num_examples.sum()) for s in bench.splits.values())
  uci = override(config, **{'data.public_source': 'uci_digits'})
  x, y = upfl.public_set(data_view(uci.data), hetero.build_data(uci, 0).info)
  assert x.shape == (40, 28, 28, 1) and y.shape == (40,)
  assert x[:, :4].max() == 0 and x[:, -4:].max() == 0   # MNIST's empty 4-pixel margin
