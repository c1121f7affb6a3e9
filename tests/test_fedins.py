"""FedIns (algorithms/fedins.py), its ViT classifier, the pretrained backbone
(pipelines/pretrain.py) and the intra-client heterogeneity benchmark."""
import json
import os

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from fedjax_shift import algorithms, models, pipelines
from fedjax_shift.benchmarks import BENCHMARKS, build_benchmark, check_data, data_view
from fedjax_shift.core.algorithm import ClientData
from fedjax_shift.core.local import local_train, masked_mean
from fedjax_shift.core.round import NO_STEP_LIMIT, RoundConfig, build_round, stack_client_states
from fedjax_shift.models import vit
from fedjax_shift.pipelines import pretrain
from fedjax_shift.pipelines.runs import uploaded_parameters
from configs import fedins as fedins_config
from helpers import build_method, data_config, override, tiny_config, toy_clients, write_run

NUM_CLASSES = 3


def small_vit_config(**fields):
  config = tiny_config(**{'client.batch_size': 3, **fields})
  config.model = ml_collections.ConfigDict({'name': 'vit', 'patch_size': 2, 'width': 16,
                                            'depth': 1, 'heads': 4, 'mlp_dim': 24})
  return config


def make(name, config, data):
  return build_method(name, config, data, NUM_CLASSES)


def test_top_c_weights_pick_the_c_most_similar_keys():
  # Row 0 ranks keys 2 > 0 > 1 > 3, row 1 ranks 3 > 1 > 2 > 0: C = 2 keeps {2, 0}, {3, 1}.
  similarity = jnp.array([[0.5, 0.1, 0.9, -0.2], [-0.3, 0.4, 0.2, 0.8]])
  np.testing.assert_allclose(vit.top_c_weights(similarity, jnp.int32(2)),
                             [[0.5, 0, 0.5, 0], [0, 0.5, 0, 0.5]])
  # Ties go to the lower index; C = M averages the whole pool.
  np.testing.assert_allclose(vit.top_c_weights(jnp.zeros((1, 3)), jnp.int32(1)), [[1, 0, 0]])
  np.testing.assert_allclose(vit.top_c_weights(similarity, jnp.int32(4)), np.full((2, 4), 0.25))


def test_instance_adaptive_forward_equals_each_instance_with_its_folded_ssf():
  # Sec. 3.4: query = frozen CLS feature, top-C keys by cosine, δ(x) = mean of their SSFs
  # (Eq. 9), merged into θ (re-parameterisation). Written out per instance in numpy.
  config = small_vit_config()
  config.fedins.pool_size, config.fedins.top_c = 5, 2
  config.fedins.init_std = 0.3                     # pool members far apart
  data, _, _ = toy_clients([6], shape=(4, 4, 3), num_classes=NUM_CLASSES)
  module, _, server, _ = make('fedins', config, data)
  variables = server.variables
  x = jnp.asarray(data.x[0])
  forward = jax.jit(lambda variables, x: models.apply(module, variables, x)[0])
  logits = forward(variables, x)
  params, pool = variables['params'], variables['ssf_pool']
  queries = np.asarray(module.encoder.apply({'params': params['encoder']}, x))
  keys = np.asarray(pool['keys'])
  cosine = (queries / np.linalg.norm(queries, axis=1, keepdims=True)) @ (
      keys / np.linalg.norm(keys, axis=1, keepdims=True)).T
  members = vit.tree_ssf(pool)
  chosen_sets = set()
  for b in range(x.shape[0]):
    chosen = np.argsort(-cosine[b], kind='stable')[:2]
    chosen_sets.add(tuple(sorted(chosen)))
    ssf = {p: (scale[chosen].mean(0), shift[chosen].mean(0)) for p, (scale, shift) in members.items()}
    folded = {'params': {'encoder': vit.fold_ssf(params['encoder'], ssf), 'head': params['head']}}
    np.testing.assert_allclose(logits[b], forward(folded, x[b:b + 1])[0], rtol=2e-4,
                               atol=2e-4)
  assert len(chosen_sets) > 1   # the instances did not all pick the same SSFs


def test_batch_query_picks_one_set_for_the_whole_batch():
  config = small_vit_config()
  config.fedins_batch_query.pool_size, config.fedins_batch_query.top_c = 5, 2
  config.fedins_batch_query.init_std = 0.3
  data, _, _ = toy_clients([6], shape=(4, 4, 3), num_classes=NUM_CLASSES)
  module, _, server, _ = make('fedins_batch_query', config, data)
  pool = server.variables['ssf_pool']
  assert not bool(pool['per_instance'])
  x = jnp.asarray(data.x[0])
  queries = module.encoder.apply({'params': server.variables['params']['encoder']}, x)
  ssf, _, _ = vit.select_ssf(pool, queries)
  scale = np.asarray(ssf['embedding'][0])
  np.testing.assert_allclose(scale, np.broadcast_to(scale[:1], scale.shape))


@pytest.mark.parametrize('key_loss_weight', [0.0, 0.1])
def test_pool_of_one_with_c_one_equals_single_ssf_fine_tuning(key_loss_weight):
  # M = 1, C = 1: every instance takes the one SSF set, so FedIns' client update is
  # federated SSF's (Sec. 3.2) on (1 − λ)·CE; the key loss only moves the key. The
  # reference fine-tunes one SSF set held in the model's 'ssf' collection on the same
  # batches (same local_train key).
  config = small_vit_config()
  config.fedins.pool_size, config.fedins.top_c = 1, 1
  config.fedins.key_loss_weight = key_loss_weight
  data, _, _ = toy_clients([7, 5], shape=(4, 4, 3), num_classes=NUM_CLASSES)
  module, algorithm, server, _ = make('fedins', config, data)
  pool = server.variables['ssf_pool']
  single = {name: jax.tree.map(lambda a: a[0], pool[name]) for name in ('scale', 'shift')}
  encoder = server.variables['params']['encoder']
  context = algorithms.base.build_context(config, module, data.max_examples)

  def loss_fn(params, state, x, y, weight, rng):
    logits = module.apply({'params': {'encoder': encoder, 'head': params['head']},
                           'ssf': params['ssf']}, x)
    ce = masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, y), weight)
    return (1.0 - key_loss_weight) * ce, state

  start = {'head': server.variables['params']['head'], 'ssf': single}
  for client in (0, 1):
    one = ClientData(jnp.asarray(data.x[client]), jnp.asarray(data.y[client]),
                     jnp.asarray(data.mask[client]), jnp.asarray(data.num_examples[client]),
                     jnp.int32(NO_STEP_LIMIT))
    rng = jax.random.key(11 + client)
    delta = algorithm.client_update(server, (), one, rng)[0].update
    params = local_train(loss_fn, context.client_optimizer, start, {}, one, rng,
                         context.schedule)[0]
    chex.assert_trees_all_close(delta['head'], jax.tree.map(jnp.subtract, params['head'],
                                                            start['head']), rtol=1e-4, atol=1e-6)
    for name in ('scale', 'shift'):
      chex.assert_trees_all_close(
          jax.tree.map(lambda a: a[0], delta['ssf_pool'][name]),
          jax.tree.map(jnp.subtract, params['ssf'][name], single[name]), rtol=1e-4, atol=1e-6)
    key_moved = float(jnp.abs(delta['ssf_pool']['keys']).max())
    assert (key_moved > 0) == (key_loss_weight > 0)


def test_round_trains_only_pool_keys_and_head_and_leaves_the_backbone_bit_identical():
  config = small_vit_config()
  config.fedins.pool_size = 4
  data, _, _ = toy_clients([7, 5, 6], shape=(4, 4, 3), num_classes=NUM_CLASSES)
  _, algorithm, server, clients = make('fedins', config, data)
  round_fn = build_round(algorithm, RoundConfig(cohort_size=2))[0]
  state = server
  for r in range(3):
    out = round_fn(state, clients, data, jax.random.key(r))
    state, clients = out.server_state, out.client_states
  before, after = server.variables, state.variables
  for a, b in zip(jax.tree.leaves(before['params']['encoder']),
                  jax.tree.leaves(after['params']['encoder'])):
    np.testing.assert_array_equal(a, b)
  assert not np.allclose(before['params']['head']['kernel'], after['params']['head']['kernel'])
  assert not np.allclose(before['ssf_pool']['keys'], after['ssf_pool']['keys'])
  assert int(after['ssf_pool']['top_c']) == config.fedins.top_c
  # Uploads: pool (γ, β at every point), keys and head; nothing of the backbone.
  module = models.create(config.model, NUM_CLASSES)
  per_set = 2 * sum(vit.ssf_points(module.encoder).values())
  head = 16 * NUM_CLASSES + NUM_CLASSES
  assert uploaded_parameters(algorithm, server, clients, data) == 4 * (per_set + 16) + head


def test_selection_diagnostics_see_keys_learn_one_domain_each():
  """A toy two-domain task whose frozen queries separate the domains (red and blue
  images: the random ViT's mean queries are at cosine 0.64, each domain's within 0.99),
  pool of 8, C = 1, keys trunc-normal(0.02) (the default): at initialisation the chosen
  keys' mean cosine is low and one domain's choices are split; after a few rounds the
  key loss has pulled one key onto each domain (cosine near 1, two keys used, each
  domain's choices all on its own key: purity 1)."""
  from fedjax_shift.algorithms.fedins import selection_diagnostics
  from fedjax_shift.data.federated import stack_clients
  rng = np.random.default_rng(0)

  def domain(channel, n):
    image = np.zeros((4, 4, 3), np.float32)
    image[..., channel] = 1.0
    return np.clip(image + 0.05 * rng.normal(size=(n, 4, 4, 3)), 0, 1).astype(np.float32)

  train = stack_clients([np.concatenate([domain(0, 12), domain(2, 12)]) for _ in range(2)],
                        [rng.integers(0, NUM_CLASSES, 24) for _ in range(2)])
  red, blue = domain(0, 10), domain(2, 10)
  labels = np.zeros(10, np.int64)
  splits = {'test': stack_clients([np.concatenate([red, blue])], [np.zeros(20, np.int64)]),
            'test_red': stack_clients([red], [labels]),
            'test_blue': stack_clients([blue], [labels])}
  config = small_vit_config()
  config.fedins.pool_size, config.fedins.top_c = 8, 1
  module, algorithm, server, clients = make('fedins', config, train)
  assert config.fedins.key_init == 'trunc_normal'
  diagnose = selection_diagnostics(module)
  info = {'domains': ['red', 'blue']}
  before = diagnose(server.variables, splits, info, 64)
  round_fn = build_round(algorithm, RoundConfig(cohort_size=2))[0]
  state = server
  for r in range(3):
    out = round_fn(state, clients, train, jax.random.key(r))
    state, clients = out.server_state, out.client_states
  after = diagnose(state.variables, splits, info, 64)
  assert before['fedins/test/chosen_cosine'] < 0.5 < 0.99 < after['fedins/test/chosen_cosine']
  assert before['fedins/test/purity'] < 1.0
  assert after['fedins/test/keys_used'] == 2.0
  assert after['fedins/test_red/purity'] == after['fedins/test_blue/purity'] == 1.0
  assert after['fedins/test/purity'] == 1.0


def test_vit_b16_communication_matches_the_paper():
  # ViT-B/16 (patch 16, width 768, depth 12, MLP 3072) at 224×224: one SSF set is
  # 2·(768 + 12·(7·768 + 3072) + 768) = 205,824 numbers, 25 sets 5,145,600 (Table 2:
  # 5.16 M new parameters); with 25 keys of 768 and a 100-class head FedIns sends
  # 5,241,700 (Table 1: 5.35 M), FedAvg the whole 85.9 M model (Table 1: 85.80 M).
  config = tiny_config()
  config.model = fedins_config.get_config('vit_b16').model
  data, _, _ = toy_clients([1], shape=(224, 224, 3), num_classes=100)
  module = models.create(config.model, 100)
  sent = {}
  for name in ('fedins', 'fedavg'):
    algorithm = algorithms.build(name, config, module, 1, num_clients=1,
                                 example_shape=(224, 224, 3))
    server = jax.eval_shape(algorithm.init, jax.random.key(0), jnp.zeros((1, 224, 224, 3)))
    clients = jax.eval_shape(lambda s: stack_client_states(algorithm, s, 1), server)
    sent[name] = uploaded_parameters(algorithm, server, clients, data)
  assert sent['fedins'] == 25 * 205_824 + 25 * 768 + 768 * 100 + 100
  assert sent['fedavg'] == 85_798_656 + 768 * 100 + 100   # ViT-B/16 without its head
  assert sent['fedins'] / sent['fedavg'] < 0.062
  # The authors' head pool, 10 classes: 25 heads of 768·10 + 10 in place of the shared
  # one: 5,145,600 + 19,200 + 192,250 = 5,357,050.
  config.fedins.head_pool = True
  module = models.create(config.model, 10)
  algorithm = algorithms.build('fedins', config, module, 1, num_clients=1,
                               example_shape=(224, 224, 3))
  server = jax.eval_shape(algorithm.init, jax.random.key(0), jnp.zeros((1, 224, 224, 3)))
  clients = jax.eval_shape(lambda s: stack_client_states(algorithm, s, 1), server)
  assert uploaded_parameters(algorithm, server, clients, data) == 5_357_050


def test_head_pool_predicts_the_mean_of_the_chosen_heads_logits():
  """With fedins.head_pool each pool member has a head; an instance's logits are the
  mean over its C chosen members of head_m(f(x)), f the features under its mixed SSF,
  written out here per instance; a round trains the pool's heads and leaves the
  module's own head untouched and unsent."""
  config = small_vit_config()
  config.fedins.pool_size, config.fedins.top_c, config.fedins.head_pool = 5, 2, True
  config.fedins.init_std = 0.3
  data, _, _ = toy_clients([6, 5], shape=(4, 4, 3), num_classes=NUM_CLASSES)
  module, algorithm, server, clients = make('fedins', config, data)
  variables = server.variables
  pool = variables['ssf_pool']
  chex.assert_shape(pool['head_kernel'], (5, 16, NUM_CLASSES))
  x = jnp.asarray(data.x[0])
  logits = models.apply(module, variables, x)[0]
  features = module.apply(variables, x, method='features')
  queries = module.apply(variables, x, None, False,
                         method=lambda m, x, s, t: m.encoder(x, s, t))
  kernels, biases = np.asarray(pool['head_kernel']), np.asarray(pool['head_bias'])
  for b in range(x.shape[0]):
    cos = np.asarray(vit.cosine_similarity(queries[b:b + 1], pool['keys']))[0]
    chosen = np.argsort(-cos, kind='stable')[:2]
    expected = np.mean([np.asarray(features[b]) @ kernels[m] + biases[m] for m in chosen], 0)
    np.testing.assert_allclose(logits[b], expected, rtol=1e-5, atol=1e-5)
  round_fn = build_round(algorithm, RoundConfig(cohort_size=2))[0]
  after = round_fn(server, clients, data, jax.random.key(0)).server_state.variables
  assert not np.allclose(after['ssf_pool']['head_kernel'], pool['head_kernel'])
  np.testing.assert_array_equal(after['params']['head']['kernel'],
                                variables['params']['head']['kernel'])


@pytest.mark.parametrize('fields, pattern', [
    ({'fedins.top_c': 4, 'fedins.pool_size': 3}, r'config.fedins.top_c: .*C ≤ M'),
    ({'fedins.pool_size': 0}, r'config.fedins.pool_size: must be an integer >= 1'),
    ({'fedins.query': 'client'}, r"config.fedins.query: must be one of .*got 'client'"),
    ({'fedins.key_loss_weight': 1.0}, r'config.fedins.key_loss_weight: must be .* < 1'),
    ({'fedins.key_init': 'xavier'}, r"config.fedins.key_init: must be one of .*got 'xavier'"),
])
def test_bad_hyperparameters_name_the_field(fields, pattern):
  config = override(small_vit_config(), **fields)
  data, _, _ = toy_clients([4], shape=(4, 4, 3), num_classes=NUM_CLASSES)
  with pytest.raises(ValueError, match=pattern):
    make('fedins', config, data)


def test_fedins_needs_a_vit():
  config = tiny_config(**{'algorithms': ('fedins',)})
  with pytest.raises(ValueError, match=r"config.model.name: fedins needs a model of \['vit'\]"):
    pipelines.validate(config)
  data, _, _ = toy_clients([4], num_classes=NUM_CLASSES)
  with pytest.raises(ValueError, match='config.model.name: FedIns trains SSF sets of a ViT'):
    make('fedins', config, data)


def test_fedbn_with_local_norms_keeps_layer_norms_on_the_client():
  config = small_vit_config(**{'fedbn.local_norms': 'all'})
  data, _, _ = toy_clients([5, 4], shape=(4, 4, 3), num_classes=NUM_CLASSES)
  module, algorithm, server, clients = make('fedbn', config, data)
  norms = sum(leaf.size for path, leaf in
              jax.tree_util.tree_flatten_with_path(server.variables)[0]
              if 'LayerNorm' in jax.tree_util.keystr(path) or 'encoder_norm' in
              jax.tree_util.keystr(path))
  total = models.num_parameters(server.variables)
  assert norms > 0
  assert uploaded_parameters(algorithm, server, clients, data) == total - norms
  with pytest.raises(ValueError, match='config.fedbn.local_norms: must be one of'):
    make('fedbn', override(config, **{'fedbn.local_norms': 'layer'}), data)


def test_mixed_domains_clients_hold_disjoint_mixtures():
  config = data_config(benchmark='mixed_domains', domain_examples=80, client_sizes=(20, 30, 25),
                       test_examples=10, domain_alpha=0.5)
  bench = BENCHMARKS.get('mixed_domains')(config, 0)
  train, test = bench.splits['train'], bench.splits['test']
  np.testing.assert_array_equal(train.num_examples, [20, 30, 25])
  np.testing.assert_array_equal(test.num_examples, [10, 10, 10])
  # The per-domain test splits partition each client's test set.
  per_domain = sum(bench.splits[f'test_{d}'].num_examples for d in config.domains)
  np.testing.assert_array_equal(per_domain, test.num_examples)
  assert np.sum(bench.info['client_domain_counts'], axis=1).tolist() == [20, 30, 25]
  # No image is in two clients or two splits.
  seen = []
  for split in (train, test):
    for k in range(3):
      seen += [x.tobytes() for x in split.x[k][:split.num_examples[k]]]
  assert len(set(seen)) == len(seen)
  assert any(len([c for c in counts if c > 0]) > 1 for counts in
             bench.info['client_domain_counts'])   # intra-client heterogeneity
  with pytest.raises(ValueError, match='config.data.domain_examples'):
    BENCHMARKS.get('mixed_domains')(data_config(benchmark='mixed_domains', domain_examples=10,
                                                client_sizes=(60,)), 0)


def tiny_pretrain_config():
  config = fedins_config.get_config('tiny')
  config.algorithms = ('fedavg', 'fedins')
  return config


def test_loader_round_trips_a_saved_backbone_and_names_a_wrong_shape(tmp_path):
  config = tiny_pretrain_config()
  module = models.create(config.model, 10)
  example = jnp.zeros((1, 28, 28, 3))
  params = models.init(module, jax.random.key(4), example)['params']
  pretrain.save(str(tmp_path / 'bb'), params, {'fingerprint': {}})
  loaded = pretrain.load_encoder(str(tmp_path / 'bb'), module, example)
  assert set(loaded) == {'params'}            # a ViT has no BatchNorm statistics
  for a, b in zip(jax.tree.leaves(params['encoder']), jax.tree.leaves(loaded['params'])):
    np.testing.assert_array_equal(a, b)
    assert a.dtype == b.dtype
  wider = models.create(override(config, **{'model.width': 32, 'model.mlp_dim': 24}).model, 10)
  with pytest.raises(ValueError, match=r"parameter 'encoder/cls' has shape \(1, 1, 16\), "
                                       r"config.model \(vit patch 7, width 32"):
    pretrain.load_encoder(str(tmp_path / 'bb'), wider, example)
  deeper = models.create(override(config, **{'model.width': 16, 'model.depth': 2}).model, 10)
  with pytest.raises(ValueError, match=r"no parameter 'encoder/encoderblock_1/LayerNorm_0/bias'"):
    pretrain.load_encoder(str(tmp_path / 'bb'), deeper, example)
  # A .npz in the ViT-B/16 layout loads into the same encoder.
  vit.save_npz(str(tmp_path / 'bb.npz'), params['encoder'])
  from_npz = pretrain.load_encoder(str(tmp_path / 'bb.npz'), module, example)
  chex.assert_trees_all_equal(from_npz, loaded)
  # A damaged saved backbone: one error saying what to delete, not a tensorstore dump.
  import shutil
  damaged = tmp_path / 'damaged'
  shutil.copytree(tmp_path / 'bb', damaged)
  for root, _, files in os.walk(damaged / 'params'):
    for name in files:
      if name != '_METADATA':
        with open(os.path.join(root, name), 'r+b') as f:
          f.truncate(max(0, os.path.getsize(os.path.join(root, name)) // 3))
  with pytest.raises(pretrain.BackboneReadError,
                     match=rf'cannot be read: .* bytes, written as .*delete {damaged} and re-run'):
    pretrain.load_encoder(str(damaged), module, example)
  # A file of it deleted: named before the checkpoint library reads (whose failed
  # asynchronous reads could print tracebacks at exit).
  shutil.rmtree(damaged)
  shutil.copytree(tmp_path / 'bb', damaged)
  os.remove(damaged / 'params' / 'manifest.ocdbt')
  with pytest.raises(pretrain.BackboneReadError,
                     match=rf'{damaged}/params/manifest.ocdbt is missing.*delete {damaged}'):
    pretrain.load_encoder(str(damaged), module, example)
  with pytest.raises(pretrain.BackboneReadError, match='holds no saved backbone'):
    pretrain.load_encoder(str(tmp_path / 'nowhere'), module, example)


def test_pipeline_pretrains_once_starts_every_method_from_it_and_prints_table_1(tmp_path):
  config = tiny_pretrain_config()
  workdir = str(tmp_path / 'run')
  out = pipelines.run(config, workdir)
  record = json.load(open(os.path.join(workdir, 'backbone', 'backbone.json')))
  assert 0.0 <= record['source_accuracy'] <= 100.0
  module = models.create(config.model, 10)
  encoder = pretrain.load_encoder(os.path.join(workdir, 'backbone'), module,
                                  jnp.zeros((1, 28, 28, 3)))['params']
  results = {r['algorithm']: r for r in out.records['results']}
  # The backbone and the runs started from it load back in Python.
  chex.assert_trees_all_equal(pipelines.load_backbone(workdir)['encoder'], encoder)
  loaded = pipelines.load_run(workdir, 'fedins', seed=config.seeds[0])
  chex.assert_trees_all_equal(loaded.extras['backbone']['params'], encoder)
  chex.assert_trees_all_equal(loaded.server_state, results['fedins']['server_state'])
  # FedIns never moves the backbone: its final encoder is the pretrained one, bit for bit.
  for a, b in zip(jax.tree.leaves(encoder),
                  jax.tree.leaves(results['fedins']['server_state'].variables['params']['encoder'])):
    np.testing.assert_array_equal(a, b)
  # FedAvg fine-tunes it all, from the same start.
  assert not all(np.array_equal(a, b) for a, b in zip(
      jax.tree.leaves(encoder),
      jax.tree.leaves(results['fedavg']['server_state'].variables['params']['encoder'])))
  assert results['fedins']['uploaded_parameters'] < results['fedavg']['uploaded_parameters'] * 2
  # Every FedIns evaluation logs its key selection (chosen cosine, keys used, purity).
  fedins_metrics = results['fedins']['metrics']
  assert 0 < fedins_metrics['fedins/test/keys_used'] <= config.fedins.pool_size
  assert -1 <= fedins_metrics['fedins/test/chosen_cosine'] <= 1
  purity = [v for k, v in fedins_metrics.items() if k.startswith('fedins/test_')
            and k.endswith('/purity')]   # the domains with test examples in this draw
  assert len(purity) >= 2 and all(0 <= v <= 1 for v in purity)
  assert not any(k.startswith('fedins/') for k in results['fedavg']['metrics'])
  # The preamble describes the clients the benchmark built (3 of 12-20 images), not the
  # label-skew fields of config.data that mixed_domains does not read.
  assert out.preamble.startswith('Benchmark mixed_domains: 3 clients, 48 train examples '
                                 '(12-20 per client, seed 0), 2 rounds'), out.preamble
  table = out.records['paper_tables']
  assert '# Com.cost' in table and '| FedIns |' in table and '| FedAvg (w.Full) |' in table
  # The terminal gets the paper's layout alone; results.md every table.
  printed = pipelines.format_results(out, workdir, width=1000)
  assert table in printed and out.records['table']['markdown'] not in printed
  assert f'every table of the run, the results of each method and split among them, is in ' \
      f'{os.path.join(workdir, "results.md")}' in printed
  with open(os.path.join(workdir, 'results.md')) as f:
    written = f.read()
  assert table in written and out.records['table']['markdown'] in written
  for domain in config.data.mixed_domains.domains:
    assert f'| {domain} ' in table.splitlines()[2] or domain in table
  # A second run reuses the backbone; another backbone config is refused, by the runs'
  # fingerprints and by the backbone's own record (the pretrain pipeline).
  again = pipelines.run(config, workdir)
  assert again.records['paper_tables'] == table
  changed = override(tiny_pretrain_config(), **{'backbone.epochs': 2})
  with pytest.raises(ValueError, match=r'backbone.epochs: 1 → 2'):
    pipelines.run(changed, workdir)
  with pytest.raises(ValueError, match='pretrained with another config'):
    pipelines.run(override(changed, pipeline='pretrain'), workdir)
  assert 'Source accuracy' in pipelines.run(override(config, pipeline='pretrain'),
                                            workdir).tables[0]


def test_backbone_errors_name_the_field(tmp_path):
  config = override(tiny_pretrain_config(), **{'backbone.weights': str(tmp_path / 'none')})
  with pytest.raises(ValueError, match=r"config.backbone.weights: .* does not exist"):
    pipelines.validate(config)
  config = override(tiny_pretrain_config(), **{'backbone.examples': 5})
  with pytest.raises(ValueError, match='config.backbone.examples: must be an integer >= 20'):
    pipelines.validate(config)
  with pytest.raises(ValueError, match='keeps no model variables with an encoder'):
    pretrain.with_backbone(algorithms.base.ServerState({'params': {}}, (), 0), {}, 'toy')


def test_mixed_domains_reads_domainnet_domains_from_tfds():
  # DomainNet's domains through TFDS (mock data here: images of varying sizes), resized
  # to data.image_size; 345 classes; per-domain columns named by the domain.
  import tensorflow_datasets as tfds
  config = data_config(benchmark='mixed_domains', domains=('tfds:domainnet/clipart',
                                                           'tfds:domainnet/sketch'),
                       domain_examples=30, client_sizes=(6, 8), test_examples=4, image_size=16)
  BENCHMARKS.check('mixed_domains', config, 'config.data', known_fields_only=False)
  with tfds.testing.mock_data(num_examples=30):
    bench = BENCHMARKS.get('mixed_domains')(config, 0)
  assert bench.num_classes == 345 and bench.example_shape == (16, 16, 3)
  assert set(bench.splits) == {'train', 'test', 'test_clipart', 'test_sketch'}
  np.testing.assert_array_equal(bench.splits['train'].num_examples, [6, 8])
  with pytest.raises(ValueError, match='different label spaces'):
    BENCHMARKS.check('mixed_domains', override(config, domains=('mnist', 'tfds:domainnet/real')),
                     'config.data', known_fields_only=False)


def test_small_clients_deal_the_papers_client_sizes_with_label_shift():
  config = data_config(benchmark='small_clients', source='mnist_embedded', client_sizes=(30, 50),
                       test_examples=20, dirichlet_alpha=0.1)
  bench = BENCHMARKS.get('small_clients')(config, 0)
  np.testing.assert_array_equal(bench.splits['train'].num_examples, [30, 50])
  np.testing.assert_array_equal(bench.splits['test'].num_examples, [20, 20])
  counts = np.asarray(bench.info['client_class_counts'])
  assert counts.sum(1).tolist() == [30, 50] and (counts.max(1) > 10).all()   # Dir(0.1): skewed
  import tensorflow_datasets as tfds
  with tfds.testing.mock_data(num_examples=2000):
    cifar = BENCHMARKS.get('small_clients')(override(config, source='tfds:cifar100',
                                                     dirichlet_alpha=100.0), 0)
  assert cifar.num_classes == 100 and cifar.example_shape == (32, 32, 3)


@pytest.mark.parametrize('variant', ['domainnet', 'cifar100', 'tiny_imagenet', 'ablation', 'pool_5,top_2',
                                     'alpha_0.3', 'paper', 'vit_b16'])
def test_config_variants_validate(variant):
  config = fedins_config.get_config(variant)
  check_data(config.data)
  from fedjax_shift.pipelines.run_config import check_run
  check_run(config)


def test_small_clients_read_class_folders_like_tiny_imagenet(tmp_path):
  # Tiny-ImageNet's layout: train/<wnid>/images/<file>.JPEG, images of any size.
  from PIL import Image
  rng = np.random.default_rng(0)
  for wnid in ('n01443537', 'n01629819'):
    folder = tmp_path / 'tiny' / 'train' / wnid / 'images'
    folder.mkdir(parents=True)
    for i in range(12):
      size = 20 + i
      Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(
          folder / f'{wnid}_{i}.jpeg')
  config = data_config(benchmark='small_clients', source='folder:tiny/train',
                       data_dir=str(tmp_path), image_size=16, client_sizes=(5, 7),
                       test_examples=3, dirichlet_alpha=10.0)
  BENCHMARKS.check('small_clients', config, 'config.data', known_fields_only=False)
  bench = BENCHMARKS.get('small_clients')(config, 0)
  assert bench.num_classes == 2 and bench.example_shape == (16, 16, 3)
  np.testing.assert_array_equal(bench.splits['train'].num_examples, [5, 7])
  with pytest.raises(FileNotFoundError, match='does not exist'):
    BENCHMARKS.get('small_clients')(override(config, source='folder:nowhere'), 0)


@pytest.mark.parametrize('key_init, std, bound', [('trunc_normal', 0.02, 0.1),
                                                   ('uniform', 1 / np.sqrt(3), 1.0)])
def test_keys_start_as_the_authors_code_or_l2p_initialises_them(key_init, std, bound):
  """'trunc_normal' (the default, the authors' trunc_normal_(std=0.02)): keys of standard
  deviation 0.02; 'uniform' (L2P's U(−1, 1)): standard deviation 1/√3, every key in
  [−1, 1]."""
  from fedjax_shift.algorithms import fedins
  config = small_vit_config()
  assert config.fedins.key_init == 'trunc_normal'
  config.fedins.key_init = key_init
  module = models.create(config.model, NUM_CLASSES)
  config.fedins.pool_size = 200   # enough keys for the statistics
  config.fedins.top_c = 3
  pool = fedins.init_pool(module.encoder, config.fedins, jax.random.key(0))
  keys = np.asarray(pool['keys'])
  assert keys.shape == (200, module.encoder.width)
  np.testing.assert_allclose(keys.std(), std, rtol=0.05)
  assert np.abs(keys).max() <= bound


def test_table_gives_the_last_round_the_best_round_and_the_key_selection():
  """The last round is our protocol's cell; the authors' code keeps the best test
  accuracy over rounds (a column of its own); the pool methods show their key
  selection, the others a dash."""
  from fedjax_shift.papers.fedins.tables import fedins_rows
  evaluations = [{'round': 10, 'global/test/accuracy': 0.5},
                 {'round': 20, 'global/test/accuracy': 0.7},
                 {'round': 30, 'global/test/accuracy': 0.6}]
  results = [{'algorithm': 'fedins', 'seed': 0, 'uploaded_parameters': 5_357_050,
              'evaluations': evaluations,
              'metrics': {'global/test/accuracy': 0.6, 'fedins/test/keys_used': 7.0,
                          'fedins/test/chosen_cosine': 0.8125, 'fedins/test/purity': 0.5}},
             {'algorithm': 'fedavg', 'seed': 0, 'uploaded_parameters': 150_000,
              'evaluations': evaluations[:1], 'metrics': {'global/test/accuracy': 0.5}}]
  header, rows = fedins_rows(results)
  assert header == ['Method', '# Com.cost', 'Test (all domains)',
                    "Test, best round (authors' selection)", 'keys used', 'chosen cos',
                    'key purity', 'seeds']
  assert rows == [['FedAvg (w.Full)', '0.15 M', '50.00', '50.00', '—', '—', '—', '1'],
                  ['FedIns', '5.36 M', '60.00', '70.00', '7.0', '0.812', '0.500', '1']]


@pytest.mark.parametrize('variant, per_image', [
    ('per_image', ('fedins_ssf', 'fedins')),
    ('per_image_all', ('local', 'fedavg', 'fedprox', 'scaffold', 'fedbn', 'moon', 'feddc',
                       'fedins_ssf', 'fedins'))])
def test_per_image_schedule_steps_once_per_image(variant, per_image):
  """The authors' release (pool_train): one SGD step per image. `per_image` gives it to
  the SSF methods, `per_image_all` to every method; a client of 7 images then takes 7
  steps an epoch where batch 3 takes ⌈7/3⌉ = 3, and the others keep the shared batch."""
  config = fedins_config.get_config(variant)
  for name in config.algorithms:
    batch = algorithms.base.method_client(config, name).batch_size
    assert batch == (1 if name in per_image else 32), name
  from fedjax_shift.pipelines.run_config import check_run
  check_run(config)
  config = small_vit_config()
  data, _, _ = toy_clients([7, 5], shape=(4, 4, 3), num_classes=NUM_CLASSES)
  one = ClientData(*(jnp.asarray(a[0]) for a in data), jnp.int32(NO_STEP_LIMIT))
  steps = {}
  for batch in (0, 1):   # 0: no override, the shared batch 3
    config.client_overrides = {'fedins': {'batch_size': batch}} if batch else {}
    _, algorithm, server, _ = make('fedins', config, data)
    steps[batch] = float(algorithm.client_update(server, (), one, jax.random.key(0))[0]
                         .metrics['num_steps'])
  assert steps == {0: 3.0, 1: 7.0}
  config.client_overrides = {'fedins': {'batch_size': -1}}
  config.algorithms = ('fedins',)
  with pytest.raises(ValueError, match='client_overrides.fedins.batch_size: must be >= 1'):
    check_run(config)


def test_domainnet_variant_is_fedbn_ten_classes_one_domain_per_client():
  """configs/fedins.py:domainnet as the authors' code (after FedBN): only the 10 classes
  (relabelled 0–9 in FedBN's order), client k holds domain k alone (26 images), and
  tests on its domain's whole test split (mock data)."""
  import tensorflow_datasets as tfds
  from fedjax_shift.data import sources
  config = fedins_config.get_config('domainnet')
  assert config.data.mixed_domains.classes == fedins_config.FEDBN_DOMAINNET_CLASSES
  data = data_view(config.data)   # what the benchmark reads
  data = override(data, domains=data.domains[:2], client_sizes=(6, 8),
                  domain_examples=30, image_size=16)
  BENCHMARKS.check('mixed_domains', data, 'config.data', known_fields_only=False)
  ids = sources.tfds_class_ids('domainnet/real', data.classes)
  with tfds.testing.mock_data(num_examples=1500):
    bench = BENCHMARKS.get('mixed_domains')(data, 0)
    full = sources.tfds_source('domainnet/clipart', 'test', image_size=8)
    first = sources.tfds_source('domainnet/clipart', 'test', image_size=8, classes=data.classes)
  assert bench.num_classes == 10 and bench.example_shape == (16, 16, 3)
  train, test = bench.splits['train'], bench.splits['test']
  np.testing.assert_array_equal(train.num_examples, [6, 8])
  assert train.y[train.mask].max() < 10
  # One domain per client: client 0's test examples are all clipart, client 1's sketch…
  names = [d.split('/')[-1] for d in data.domains]
  for k, name in enumerate(names):
    per_domain = bench.splits[f'test_{name}'].num_examples
    assert per_domain[k] == test.num_examples[k] and per_domain[1 - k] == 0
    assert bench.info['client_domain_counts'][k][k] == data.client_sizes[k]
  # … and its domain's whole test split of the 10 classes (the same images, relabelled).
  kept = np.isin(full.y, ids)
  assert test.num_examples[0] == kept.sum() == len(first.y)
  np.testing.assert_array_equal(first.y, [ids.index(label) for label in full.y[kept]])
  with pytest.raises(ValueError, match='data.classes'):
    sources.tfds_class_ids('domainnet/real', ('bird', 'unicorn'))
  with pytest.raises(ValueError, match='data.client_sizes'):
    BENCHMARKS.check('mixed_domains', override(data, client_sizes=(6,)), 'config.data',
                     known_fields_only=False)
  with pytest.raises(ValueError, match='data.classes'):
    BENCHMARKS.check('mixed_domains', override(data, domains=('mnist', 'uci'), client_sizes=(6, 8)),
                     'config.data', known_fields_only=False)
  with pytest.raises(ValueError, match='data.client_domains'):
    BENCHMARKS.check('mixed_domains', override(data, client_domains='some'), 'config.data',
                     known_fields_only=False)


def test_cifar100_variant_deals_ten_images_per_class_and_tests_on_the_test_split():
  """configs/fedins.py:cifar100 as the authors' code: the first 10 images of each class,
  each class split over 5 clients by Dirichlet(0.2) (client sizes follow from the
  draw), and the whole test split dealt over the clients (mock data)."""
  import tensorflow_datasets as tfds
  config = fedins_config.get_config('cifar100')
  assert (config.data.dirichlet_alpha, config.data.small_clients.images_per_class,
          config.data.num_clients, config.data.small_clients.test_split) == (0.2, 10, 5, 'test')
  with tfds.testing.mock_data(num_examples=3000):
    bench = build_benchmark(config.data, 0)
  train, test = bench.splits['train'], bench.splits['test']
  assert int(train.num_examples.sum()) == 1000 and train.num_clients == 5
  counts = np.asarray(bench.info['client_class_counts'])
  assert (counts.sum(0) == 10).all()                       # every class: its 10 images
  assert (counts.max(0) >= 4).mean() > 0.8                 # Dir(0.2): mostly one client
  assert int(test.num_examples.sum()) == 3000             # the whole mock test split
  assert bench.example_shape == (32, 32, 3)
  from fedjax_shift import config as config_lib
  config.data.source = 'mnist_embedded'
  with pytest.raises(ValueError, match='data.small_clients.test_split'):
    check_data(config.data)


def test_settings_report_puts_each_workdir_in_a_column_with_the_papers_number(tmp_path):
  """Two settings: FedAvg and FedIns at batch 32 (2 seeds), FedIns alone with the head
  pool (1 seed). Binary fractions, so the means are exact: FedIns (0.5, 0.75) →
  62.50 ± 12.50; a method a workdir did not run is '—'; the paper's Table 1 number
  (FedIns 83.12, FedAvg 80.02) last."""
  from fedjax_shift.papers.fedins import tables
  runs = {'batch32': {'fedavg': (0.625, 0.625), 'fedins': (0.5, 0.75)},
          'head_pool': {'fedins': (0.25,)}}
  workdirs = []
  for setting, methods in runs.items():
    workdir = tmp_path / setting
    for method, accuracies in methods.items():
      for seed, accuracy in enumerate(accuracies):
        write_run(workdir, method, seed, {'global/test/accuracy': accuracy})
    workdirs.append(str(workdir))
  text = tables.settings_from_workdirs(workdirs, ['batch 32', 'head pool'])
  assert '| Method | batch 32 | head pool | paper: Test (all domains) | seeds |' in text
  assert '| FedAvg (w.Full) | 62.50 ± 0.00 | — | 80.02 | 2 |' in text
  assert '| FedIns | 62.50 ± 12.50 | 25.00 | 83.12 | 1 / 2 |' in text
  assert 'SOLO' not in text   # rows no workdir ran are left out


@pytest.mark.parametrize('val_layout', ['annotations', 'class_folders'])
def test_tiny_imagenet_variant_tests_on_the_val_folder(tmp_path, val_layout):
  """configs/fedins.py:tiny_imagenet as the authors' code: the first 10 images of each
  class for training, the whole val/ folder (theirs: ImageFolder(<dir>/val/), 10,000
  images) as the test set, dealt over the clients, labels matched by wnid, in Tiny-ImageNet's
  own val layout (images/ + val_annotations.txt) or in class folders."""
  from PIL import Image
  rng = np.random.default_rng(0)
  wnids = ('n01443537', 'n01629819', 'n01641577')
  root = tmp_path / 'tiny-imagenet-200'
  for wnid in wnids:
    (root / 'train' / wnid / 'images').mkdir(parents=True)
    for i in range(11):
      Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(
          root / 'train' / wnid / 'images' / f'{wnid}_{i}.png')
  val = [(f'val_{j}.png', wnids[(j * 2) % 3]) for j in range(7)]   # all but class 1 first
  for name, wnid in val:
    folder = (root / 'val' / 'images' if val_layout == 'annotations'
              else root / 'val' / wnid / 'images')
    folder.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(folder / name)
  if val_layout == 'annotations':
    (root / 'val' / 'val_annotations.txt').write_text(
        ''.join(f'{n}\t{w}\t0\t0\t7\t7\n' for n, w in val))
  config = fedins_config.get_config('tiny_imagenet')
  assert config.data.small_clients.test_split == 'folder:tiny-imagenet-200/val'
  config.data.data_dir = str(tmp_path)
  check_data(config.data)
  bench = build_benchmark(config.data, 0)
  train, test = bench.splits['train'], bench.splits['test']
  assert int(train.num_examples.sum()) == 30 and int(test.num_examples.sum()) == 7
  labels = np.concatenate([np.asarray(test.y[k, :n]) for k, n in enumerate(test.num_examples)])
  assert sorted(labels.tolist()) == sorted(wnids.index(w) for _, w in val)
  config.data.small_clients.test_split = ''
  with pytest.raises(ValueError, match='data.small_clients.test_split'):
    check_data(config.data)
