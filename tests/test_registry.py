"""Registries: a method is one file, configs come from what files registered, bad
names and fields are errors, the package layering holds, and the adapter
evaluation compiles once."""
import ast
import glob
import importlib
import inspect
import re
import os

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from fedjax_shift import algorithms, models, pipelines
from fedjax_shift import config as config_lib
from fedjax_shift.adapters import ADAPTERS
from fedjax_shift.adapters import atp as atp_lib
from fedjax_shift.algorithms import ALGORITHMS
from fedjax_shift.algorithms.fedavg import fedavg
from fedjax_shift.benchmarks import BENCHMARKS, DATA_DEFAULTS
from fedjax_shift.core.algorithm import ClientOutput
from fedjax_shift.core.test_time import Adapter, build_test_time, register_constructor
from fedjax_shift.parts import atp_rates
from fedjax_shift.pipelines import PIPELINES
from fedjax_shift.pipelines.atp import adapter_accuracy, adapter_evaluator
from fedjax_shift.registry import POSITIVE
from helpers import compiled_programs, tiny_config, toy_clients

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, 'fedjax_shift')


def load_launcher():
  """launch/train.py as a module (it is a script, not part of the package)."""
  from tests.helpers import launch_module
  return launch_module('train')


def scaled_fedavg(hparams, context):
  """A toy method: FedAvg whose clients upload ``scale`` × their update."""
  base = fedavg(hparams, context)

  def client_update(server_state, client_state, data, rng):
    output, client_state = base.client_update(server_state, client_state, data, rng)
    update = jax.tree.map(lambda u: hparams.scale * u, output.update)
    return ClientOutput(update, output.metrics), client_state

  return base._replace(client_update=client_update)


def tempered(module, hparams, context):
  """A toy adapter: the model's logits divided by a temperature (argmax unchanged)."""
  def init(variables, rng):
    del rng
    return variables

  def step(variables, batch):
    return variables, models.apply(module, variables, batch.x, 'eval')[0] / hparams.temperature

  return Adapter(init, step)


def test_toy_algorithm_and_adapter_from_a_test_file_run_through_the_launcher(tmp_path):
  launcher = load_launcher()
  ALGORITHMS.register('toy_scaled_fedavg', defaults={'scale': 1.0})(scaled_fedavg)
  ADAPTERS.register('toy_tempered', defaults={'temperature': 2.0})(tempered)
  try:
    config = config_lib.apply_variant(config_lib.base_config(), 'tiny')
    assert config.toy_scaled_fedavg.scale == 1.0
    assert config.adapters.toy_tempered.temperature == 2.0
    config.algorithms = ('fedavg', 'toy_scaled_fedavg')
    config.eval_adapters = ('toy_tempered:online',)
    config.eval_adapter_algorithms = ('toy_scaled_fedavg',)
    out = launcher.train(config, str(tmp_path))
    fedavg_run, toy_run = out.records['results']
    # scale = 1 uploads FedAvg's update: the same model, the same accuracies.
    for key, value in fedavg_run['metrics'].items():
      np.testing.assert_allclose(toy_run['metrics'][key], value, rtol=1e-5, atol=1e-6)
    # A temperature keeps every argmax: the adapted accuracy is the global one.
    assert toy_run['metrics']['global+toy_tempered/test/accuracy'] == pytest.approx(
        toy_run['metrics']['global/test/accuracy'])
    assert '| toy_scaled_fedavg |' in out.tables[0]
    assert 'global+toy_tempered/test' in open(tmp_path / 'results.md').read()
    # scale = 0 uploads nothing: the global model never moves from its initialisation.
    config.toy_scaled_fedavg.scale = 0.0
    config.algorithms = ('toy_scaled_fedavg',)
    frozen = pipelines.run(config, str(tmp_path / 'frozen'))
    assert frozen.records['results'][0]['metrics']['global/test/accuracy'] < 0.5
  finally:
    ALGORITHMS.unregister('toy_scaled_fedavg')
    ADAPTERS.unregister('toy_tempered')
  assert 'toy_scaled_fedavg' not in config_lib.base_config()


def test_every_method_section_holds_its_registered_defaults():
  config = config_lib.base_config()
  for name in ALGORITHMS.names():   # a variant's section: what it changes
    assert config[name].to_dict() == ALGORITHMS.own_defaults(name).to_dict()
    assert ALGORITHMS.section(name, config).to_dict() == ALGORITHMS.defaults(name).to_dict()
  for name in ADAPTERS.names():
    assert config.adapters[name].to_dict() == ADAPTERS.own_defaults(name).to_dict()
    assert ADAPTERS.section(name, config.adapters).to_dict() == \
        ADAPTERS.defaults(name).to_dict()
  for name in BENCHMARKS.names():   # a benchmark's own fields: its section of config.data
    assert config.data[name].to_dict() == BENCHMARKS.defaults(name).to_dict()
    assert not set(BENCHMARKS.defaults(name)) & set(DATA_DEFAULTS)
  assert config.fedprox.mu == 0.01 and config.adapters.tent.learning_rate == 1e-3


@pytest.mark.parametrize('field, value, pattern', [
    ('pipeline', 'nope', re.escape(f"config.pipeline: unknown pipeline 'nope'; choose from "
                                   f"{PIPELINES.names()}")),
    ('pipeline', 'test_time', r"config.pipeline: 'test_time' is called 'atp' now"),
    ('paper_tables', 'nope', r"config.paper_tables: unknown paper table 'nope'; choose from "
                             r"\['atp', "),
    ('paper_tables', 'atp', r"config.paper_tables: 'atp' lays out runs of the \['atp'\] "
                            r"pipeline\(s\), not config.pipeline='federated'"),
    ('algorithms', ('atp',), r'config.algorithms: atp trains around a pretrained global model'),
    ('data.benchmark', 'nope', r"config.data.benchmark: unknown benchmark 'nope'; choose from "
                               r"\['atp_shift', 'circle', 'digit_domains', "
                               r"'label_skew_corrupted'"),
    ('data.benchmark', 'atp_shift', r"config.data.benchmark: 'atp_shift' feeds the "
                                    r"\['atp'\] pipeline"),
    ('fedprox.nu', 0.1, r"config.fedprox.nu: unknown field; config.fedprox has \['mu'\]"),
    ('fedavg.mu', 0.1, r"config.fedavg.mu: unknown field; config.fedavg has no fields"),
    ('client_overrides', {'fedavgg': {'learning_rate': 0.1}},
     r"config.client_overrides: unknown algorithm 'fedavgg'"),
    ('client_overrides', {'fedprox': {'rate': 0.1}},
     r"config.client_overrides.fedprox.rate: unknown field; config.client has \['augmentation'"),
    ('client_overrides', {'fedprox': {'batch_size': 2.5}},
     r"config.client_overrides.fedprox.batch_size: must be of config.client.batch_size's "
     r"type \(int\), got 2.5"),
    ('client_overrides', {'fedprox': {'learning_rate': -0.1}},
     r"config.client_overrides.fedprox.learning_rate: must be > 0, got -0.1"),
    ('client_overrides', {'fedprox': {'optimizer': 'adagrad'}},
     r"config.client_overrides.fedprox.optimizer: unknown 'adagrad'"),
    ('adapters.tent.lr', 0.1, r'config.adapters.tent.lr: unknown field'),
    ('eval_adapters', ('tent:sometimes',), r"config.eval_adapters: unknown mode 'sometimes'"),
    ('eval_adapters', ('tnet:online',), r"config.eval_adapters: unknown adapter 'tnet'"),
])
def test_bad_names_and_fields_are_errors(field, value, pattern):
  with pytest.raises(ValueError, match=pattern):
    config_lib.validate(tiny_config(**{field: value}))


def test_registry_rejects_duplicates_and_names_choices():
  with pytest.raises(ValueError, match="algorithm 'fedavg' is registered twice"):
    ALGORITHMS.register('fedavg')(scaled_fedavg)
  with pytest.raises(ValueError, match=r"unknown pipeline 'x'; choose from"):
    PIPELINES.get('x')


# data → models → core → parts → {algorithms, adapters, benchmarks} → report → pipelines
# → papers → config, as stated in fedjax_shift/__init__.py; registry, metrics and
# checkpoint are leaves anyone may use. Siblings (one layer, different packages) never
# import each other: a training method never reads a test-time method or a benchmark.
LAYERS = {'registry': 0, 'distributed': 0, 'metrics': 0, 'events': 0, 'checkpoint': 0,
          'data': 1, 'models': 2, 'core': 3, 'parts': 4, 'algorithms': 5, 'adapters': 5,
          'benchmarks': 5, 'report': 6, 'pipelines': 7, 'papers': 8, 'config': 9}


def package_modules():
  """{dotted module name: path} of every module of the package."""
  out = {}
  for directory, _, files in os.walk(PACKAGE):
    for file in files:
      if file.endswith('.py'):
        rel = os.path.relpath(os.path.join(directory, file), ROOT)[:-3].replace(os.sep, '.')
        out[rel[:-len('.__init__')] if rel.endswith('.__init__') else rel] = \
            os.path.join(directory, file)
  return out


def imported_modules(path, modules):
  """The package modules a file imports (``from pkg import mod`` names mod itself)."""
  found = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name in modules}
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      for alias in node.names:
        full = f'{node.module}.{alias.name}'
        found.add(full if full in modules else node.module)
  return {m for m in found if m in modules}


def layer(module):
  parts = module.split('.')
  return LAYERS[parts[1]] if len(parts) > 1 else None


def layering_violations(graph):
  """(upward, sideways): the imports ``graph`` ({module: imported modules}) makes to a
  higher layer, and to a sibling (same layer, another top-level package)."""
  pairs = [(m, d) for m, deps in graph.items() for d in deps
           if layer(m) is not None and layer(d) is not None]
  upward = [(m, d) for m, d in pairs if layer(d) > layer(m)]
  sideways = [(m, d) for m, d in pairs
              if layer(d) == layer(m) and layer(m) > 0 and m.split('.')[1] != d.split('.')[1]]
  return upward, sideways


def test_a_cross_sibling_or_upward_import_is_a_violation():
  graph = {'fedjax_shift.adapters.tent': {'fedjax_shift.algorithms.fedavg',
                                          'fedjax_shift.parts.atp_rates'},
           'fedjax_shift.algorithms.fedavg': {'fedjax_shift.benchmarks.upfl',
                                              'fedjax_shift.algorithms.base'},
           'fedjax_shift.core.round': {'fedjax_shift.pipelines.loop'}}
  upward, sideways = layering_violations(graph)
  assert upward == [('fedjax_shift.core.round', 'fedjax_shift.pipelines.loop')]
  assert sorted(sideways) == [('fedjax_shift.adapters.tent', 'fedjax_shift.algorithms.fedavg'),
                              ('fedjax_shift.algorithms.fedavg', 'fedjax_shift.benchmarks.upfl')]


def test_imports_follow_the_layering_and_have_no_cycles():
  modules = package_modules()
  assert set(LAYERS) >= {m.split('.')[1] for m in modules if '.' in m}, \
      'a new top-level module needs its layer in LAYERS and fedjax_shift/__init__.py'
  graph = {m: imported_modules(path, modules) - {m} for m, path in modules.items()}
  upward, sideways = layering_violations(graph)
  assert not upward, f'modules importing from a higher layer: {upward}'
  assert not sideways, f'modules importing from a sibling layer: {sideways}'
  # No cycle of any length (Tarjan's strongly connected components).
  index, low, stack, on_stack, cycles = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        cycles.append(sorted(component))

  for v in graph:
    if v not in index:
      visit(v)
  assert not cycles, f'modules importing each other: {cycles}'
  assert 'parts → {algorithms, adapters, benchmarks}' in open(
      os.path.join(PACKAGE, '__init__.py')).read()


def test_the_layering_test_sees_an_upward_import_and_a_cycle(tmp_path):
  """The check above can fail: an upward import and a two-module cycle are found."""
  modules = {'fedjax_shift.data.a': str(tmp_path / 'a.py'),
             'fedjax_shift.pipelines.b': str(tmp_path / 'b.py')}
  (tmp_path / 'a.py').write_text('from fedjax_shift.pipelines import b\n')
  (tmp_path / 'b.py').write_text('from fedjax_shift.data import a\n')
  graph = {m: imported_modules(p, modules) for m, p in modules.items()}
  assert graph == {'fedjax_shift.data.a': {'fedjax_shift.pipelines.b'},
                   'fedjax_shift.pipelines.b': {'fedjax_shift.data.a'}}
  assert layer('fedjax_shift.pipelines.b') > layer('fedjax_shift.data.a')


def test_adapter_evaluation_compiles_once_and_takes_alpha_as_an_argument():
  """ATP through the pipeline's compiled evaluation: three clients in padded chunks of
  two, two different α — one compilation, and each α gives what an adapter built
  around it (the reference, ``build_test_time``) gives."""
  module = models.MODELS.get('bn_mlp')(3, hidden=(8,))
  variables = models.init(module, jax.random.key(0), jnp.zeros((1, 4, 4, 1)))
  data, _, _ = toy_clients([6, 4, 5], num_classes=3, pad_to=6)
  evaluate_chunk = adapter_evaluator('atp', module, ml_collections.ConfigDict(),
                                     3, 4, 'online')
  from fedjax_shift.pipelines.atp import AdapterInputs
  rng = jax.random.key(3)
  results = []
  for shift in (0.3, 3.0):
    alpha = jax.tree.map(lambda a, s=shift: a + s, atp_rates.init_alpha(variables))
    inputs = AdapterInputs(variables, None, None, alpha)
    accuracy = adapter_accuracy(evaluate_chunk, inputs, variables, data, rng, client_chunk=2)
    reference = build_test_time(atp_lib.atp(module, alpha), 4, 'online')(variables, data, rng)
    np.testing.assert_allclose(accuracy, np.asarray(reference['correct']) /
                               np.asarray(reference['count']), rtol=1e-6)
    results.append(accuracy)
  assert compiled_programs(evaluate_chunk) == 1
  chex.assert_tree_all_finite(results)


def test_builders_take_their_section_and_the_engine_context():
  config = tiny_config()
  module = models.create(config.model, 3)
  seen = {}

  def recorder(hparams, context):
    seen.update(hparams=hparams, context=context)
    return fedavg(hparams, context)

  ALGORITHMS.register('toy_recorder', defaults={'strength': 0.01})(recorder)
  try:
    config = config_lib.apply_variant(config_lib.base_config(), 'tiny')
    config.toy_recorder.strength = 0.5
    algorithms.build('toy_recorder', config, module, 7, {'num_domains': 2})
  finally:
    ALGORITHMS.unregister('toy_recorder')
  assert seen['hparams'].to_dict() == {'strength': 0.5}   # its own fields, no others
  assert seen['context'].info == {'num_domains': 2}
  assert seen['context'].schedule.batch_size == config.client.batch_size
  assert seen['context'].schedule.max_examples == 7
  assert seen['context'].client_learning_rate == config.client.learning_rate


def test_an_adapter_registered_from_its_constructor_takes_the_signature_defaults():
  seen = {}

  def toy_constructor(module, rate: float = 0.25, predict: str = 'after') -> Adapter:
    seen.update(module=module, rate=rate, predict=predict)
    return Adapter(init=lambda variables, rng: variables, step=None)

  assert register_constructor('toy_signature')(toy_constructor) is toy_constructor
  try:
    # The section is the signature's keyword parameters with their defaults.
    assert ADAPTERS.defaults('toy_signature').to_dict() == {'rate': 0.25, 'predict': 'after'}
    section = ml_collections.ConfigDict({'rate': 0.5, 'predict': 'before'})
    ADAPTERS.get('toy_signature')('the module', section, None)
  finally:
    ADAPTERS.unregister('toy_signature')
  assert seen == {'module': 'the module', 'rate': 0.5, 'predict': 'before'}  # by name

  def with_context(module, num_classes, rate: float = 0.5, *, note: str = 'python only'):
    seen.update(num_classes=num_classes, rate=rate, note=note)
    return None
  register_constructor('toy_context', from_context={'num_classes': lambda m, c: c * 2})(
      with_context)
  try:   # C from the context, keyword-only parameters not fields
    assert ADAPTERS.defaults('toy_context').to_dict() == {'rate': 0.5}
    ADAPTERS.get('toy_context')('m', ml_collections.ConfigDict({'rate': 0.1}), 5)
  finally:
    ADAPTERS.unregister('toy_context')
  assert seen['num_classes'] == 10 and seen['rate'] == 0.1 and seen['note'] == 'python only'
  with pytest.raises(ValueError, match=r"from_context names \['classes'\], not parameters"):
    register_constructor('toy_bad', from_context={'classes': None})(with_context)

  def no_default(module, rate):
    return None
  with pytest.raises(ValueError, match=r"adapter 'toy_bad': constructor parameters \['rate'\] "
                                       r"have no default"):
    register_constructor('toy_bad')(no_default)
  assert 'toy_bad' not in ADAPTERS


PAPERS_ADAPTER_DEFAULTS = {
    'tent': {'learning_rate': 1e-3, 'optimizer': 'adam', 'parameters': 'batch_norm',
             'clip': 0.0, 'weight_decay': 0.0, 'entropy_units': 'nats', 'predict': 'before'},
    'shot': {'learning_rate': 1e-3, 'optimizer': 'adam', 'pseudo_label_weight': 0.3,
             'predict': 'before'},
    't3a': {'filter_k': 100}, 'no_adapt': {}, 'odpfl_hn': {}, 'em': {'num_iterations': 100},
    'bbse': {'projection': 'clip'},
    'memo': {'num_augmentations': 32, 'learning_rate': 0.005, 'num_steps': 1,
             'augmentation': 'translate_rotate_jitter'},
    'bn_adapt': {'prior_strength': 16.0, 'mixing': 'batch'},
    'atp': {},
    'eata': {'learning_rate': 0.00025, 'lr_batch_size': 64, 'momentum': 0.9,
             'entropy_margin': 0.4, 'redundancy_epsilon': 0.05, 'fisher_weight': 2000.0,
             'fisher_samples': 2000, 'predict': 'before'},
    'surgical': {'block': {'feature': 'first', 'label': 'head', 'hybrid': 'head'},
                 'learning_rate': 1e-3, 'predict': 'before', 'optimizer': 'adam',
                 'select': 'fixed', 'candidates': (), 'selection_examples': 1000},
    'fedthe': {'learning_rate': 0.1, 'steps': 20, 'alpha': 0.1, 'beta': 0.1,
               'initial_global_weight': 0.5, 'history': 'official', 'tune_steps': 0,
               'tune_learning_rate': 0.0005, 'num_augmentations': 16},
    'fedicon': {'temperature': 0.1, 'learning_rate': 0.005, 'steps': 1, 'memory_size': 128,
                'augmentations': ('random_resized_crop', 'colour_jitter', 'grayscale',
                                  'gaussian_blur'),
                'predict': 'after', 'epochs': 1, 'anchors': 'raw', 'batch_norm': 'frozen',
                'weight_decay': 5e-4},
    # SAR's code: SGD 0.00025 (ResNets, batch >= 32), momentum 0.9, E0 = 0.4 ln C, ρ 0.05,
    # recovery under 0.2, moving average 0.9
    'sar': {'learning_rate': 0.00025, 'momentum': 0.9, 'entropy_margin': 0.4, 'rho': 0.05,
            'reset_threshold': 0.2, 'average_rate': 0.9, 'scale_with_batch': True},
    # CoTTA's CIFAR-10-C config: Adam 1e-3, α 0.999, restore 0.01, p_th 0.92, 32 copies
    'cotta': {'learning_rate': 1e-3, 'optimizer': 'adam', 'teacher_rate': 0.999,
              'restore_probability': 0.01, 'confidence_threshold': 0.92,
              'num_augmentations': 32, 'augmentation': 'translate_rotate_jitter'},
    # RoTTA's config: Adam 1e-3, memory 64 learnt every 64, ν 0.001, α 0.05, λ_t = λ_u = 1
    'rotta': {'learning_rate': 1e-3, 'optimizer': 'adam', 'memory_size': 64,
              'update_frequency': 64, 'teacher_rate': 0.001, 'bn_momentum': 0.05,
              'lambda_t': 1.0, 'lambda_u': 1.0, 'augmentation': 'translate_rotate_jitter'},
    # LAME's best configuration: RBF affinity, σ from 5 neighbours, not symmetrised, λ 1,
    # at most 100 steps
    'lame': {'affinity_kind': 'rbf', 'knn': 5, 'strength': 1.0, 'max_steps': 100,
             'symmetric': False},
    # NOTE's code: Adam 1e-4, PBRS memory 64 learnt every 64, BN momentum 0.01, IABN k 4
    'note': {'learning_rate': 1e-4, 'optimizer': 'adam', 'memory_size': 64,
             'update_frequency': 64, 'bn_momentum': 0.01, 'iabn_k': 4.0},
    'pl': {'learning_rate': 0.00025, 'optimizer': 'sgd', 'momentum': 0.9, 'threshold': 0.9},
    'conjugate_pl': {'learning_rate': 1e-3, 'optimizer': 'adam', 'temperature': 1.0,
                     'predict': 'before'},
}


def signature_defaults(constructor, from_context) -> dict:
  """The section a constructor's signature gives: its parameters after the module with
  their defaults, a NamedTuple default's fields in its place, but those the source
  context gives and the keyword-only ones (the Python API's)."""
  out = {}
  for p in tuple(inspect.signature(constructor).parameters.values())[1:]:
    if p.name in from_context or p.kind is inspect.Parameter.KEYWORD_ONLY:
      continue
    assert p.default is not inspect.Parameter.empty, p.name
    out.update(p.default._asdict() if hasattr(p.default, '_fields') else {p.name: p.default})
  return out


@pytest.mark.parametrize('name', sorted(PAPERS_ADAPTER_DEFAULTS))
def test_signature_registered_adapters_hold_their_papers_defaults(name):
  """Each default is written once, in the constructor: the base config's section equals
  the signature's defaults, which are the papers' values (Tent: Adam 1e-3 on BN affine
  parameters; SHOT: β = 0.3; T3A: K = 100; the ATP code predicts before the update and
  mixes BN statistics with N = 16; Saerens et al.'s EM 100 iterations; Lipton et al.'s
  clipped least squares; MEMO's 32 augmentations, lr 0.005, one step; EATA's code: SGD
  0.00025 at batch 64, momentum 0.9, E0 = 0.4 ln C, ε = 0.05, β = 2000 over 2000
  samples; Lee et al.: the first block for input shifts, the last layer for label
  shifts; FedTHE's code: 20 Adam steps of 0.1, α = β = 0.1; FedICON Sec. 5.1: τ = 0.1,
  lr 0.005, weight decay 5e-4)."""
  meta = ADAPTERS.meta(name)
  section = config_lib.base_config().adapters[name].to_dict()
  assert section == signature_defaults(meta['constructor'], meta['from_context'])
  assert section == PAPERS_ADAPTER_DEFAULTS[name]


def test_every_adapter_section_is_written_once():
  """Every registered adapter's section comes from its constructor's signature, or is a
  variant holding only what it changes (FedTHE+: the tuning's 3 steps), or is FedTTA's,
  whose fields are its settings' defaults (``Adaptation``, ``InnerStep``) but those it
  takes from the trained method."""
  from fedjax_shift.adapters import fedtta
  from fedjax_shift.parts.fedtta_step import InnerStep
  variants = {name for name in ADAPTERS.names() if ADAPTERS.variant_of(name)}
  assert variants == {'fedthe_plus', 'fedtta_pp'}
  assert ADAPTERS.own_defaults('fedthe_plus').to_dict() == {'tune_steps': 3}
  from_settings = {**InnerStep._field_defaults, **fedtta.Adaptation._field_defaults}
  own = {field for field in ADAPTERS.defaults('fedtta')
         if ADAPTERS.defaults('fedtta')[field] != from_settings.get(field, object())}
  assert own == {'inner_learning_rate', 'norm_epsilon', 'override_training', 'fill_batch'}
  assert set(ADAPTERS.names()) - variants - {'fedtta'} == set(PAPERS_ADAPTER_DEFAULTS)


def test_a_variant_holds_what_it_changes_and_follows_its_method():
  toy = ALGORITHMS.__class__('toy')
  toy.register('base', defaults={'rate': 0.1, 'steps': 2, 'nested': {'a': 1, 'b': 2}},
               ranges={'rate': POSITIVE})(None)
  toy.register('ablation', variant_of='base', defaults={'steps': 5, 'nested': {'b': 3}})(None)
  assert toy.own_defaults('ablation').to_dict() == {'steps': 5, 'nested': {'b': 3}}
  assert toy.defaults('ablation').to_dict() == {'rate': 0.1, 'steps': 5,
                                                'nested': {'a': 1, 'b': 3}}
  sections = ml_collections.ConfigDict({'base': toy.own_defaults('base'),
                                        'ablation': toy.own_defaults('ablation')})
  sections.base.rate = 0.2        # the method's field: the variant follows it
  sections.base.steps = 7         # ... but not where the variant has its own
  assert toy.section('ablation', sections).to_dict() == {'rate': 0.2, 'steps': 5,
                                                         'nested': {'a': 1, 'b': 3}}
  sections.ablation.rate = 0.3    # its own value of a field it followed
  assert toy.section('ablation', sections).rate == 0.3 and sections.base.rate == 0.2
  toy.check('ablation', sections.ablation, 'config.ablation')   # the method's fields are known
  sections.ablation.rate = -1.0   # ... within the method's ranges
  with pytest.raises(ValueError, match=r'config.ablation.rate: must be a number > 0'):
    toy.check('ablation', sections.ablation, 'config.ablation')
  with pytest.raises(ValueError, match=r"config.ablation.lr: unknown field"):
    toy.check('ablation', ml_collections.ConfigDict({'lr': 1.0}), 'config.ablation')
  with pytest.raises(ValueError, match=r"toy 'copy', a variant of 'base', registers \['rate'\] "
                                       r"at the values of 'base': a variant holds only what it changes"):
    toy.register('copy', variant_of='base', defaults={'rate': 0.1, 'steps': 4})
  assert 'copy' not in toy


def _leaves(section) -> set:
  from fedjax_shift.registry import leaf_paths
  return {(path, repr(value)) for path, value in leaf_paths(section.to_dict())}


@pytest.mark.parametrize('registry, sections', [
    (ALGORITHMS, lambda config: config), (ADAPTERS, lambda config: config.adapters)])
def test_no_section_copies_another_methods_defaults(registry, sections):
  """An ablation registers what it changes (the five FedICON variants, FedIns-SSF and
  FedIns batch-query, FedTTA-Prox; FedTHE+, FedTTA++ among adapters): two entries of
  one registry, neither a variant of the other, share fewer than 5 (field, value) leaves
  of their whole sections, and at most half of the smaller one's where it has 5 or
  more (the old copies shared 4 of FedIns' 7 to all 9 of FedICON's)."""
  config = config_lib.base_config()
  for name in registry.names():   # a variant's own fields are changes, never copies
    parent = registry.variant_of(name)
    if parent:
      assert not _leaves(sections(config)[name]) & _leaves(registry.defaults(parent)), name
  def related(a, b):
    return registry.variant_of(a) in (b, registry.variant_of(b) or b) or \
        registry.variant_of(b) == a
  names = registry.names()
  for i, a in enumerate(names):
    for b in names[i + 1:]:
      if related(a, b):
        continue
      whole_a, whole_b = _leaves(registry.defaults(a)), _leaves(registry.defaults(b))
      shared, smaller = whole_a & whole_b, min(len(whole_a), len(whole_b))
      assert len(shared) < 5 and (smaller < 5 or 2 * len(shared) <= smaller), \
          (a, b, sorted(shared))


def test_a_variants_field_it_follows_is_set_from_the_command_line(tmp_path):
  """A variant's section holds only what it changes, so absl has no flag for the fields
  it follows; the launcher sets them after parsing (type-checked like absl's)."""
  import subprocess
  import sys
  code = ("import sys; sys.path.insert(0, 'launch'); import train; "
          "from fedjax_shift.algorithms import ALGORITHMS; "
          "from fedjax_shift.adapters import ADAPTERS; "
          "train.parse_flags(['train.py', '--config=configs/fedtta.py:tiny', '--workdir=w', "
          "'--config.fedtta_prox.inner_learning_rate=0.3', '--config.fedtta.mu=0.5', "
          "'--config.adapters.fedtta_pp.fill_batch=48']); c = train._CONFIG.value; "
          "s = ALGORITHMS.section('fedtta_prox', c); "
          "print(s.inner_learning_rate, s.mu, c.fedtta.mu, "
          "ADAPTERS.section('fedtta_pp', c.adapters).fill_batch, c.adapters.fedtta.fill_batch)")
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=ROOT)
  # its own η_inner; its own μ (FedTTA-Prox's 0.01) although FedTTA's is set; the adapter's
  assert out.stdout.split() == ['0.3', '0.01', '0.5', '48', '-1'], out.stderr[-3000:]
  bad = subprocess.run([sys.executable, 'launch/train.py', '--config=configs/fedtta.py:tiny',
                        f'--workdir={tmp_path}', '--config.fedtta_prox.inner_learning_rate=x'],
                       capture_output=True, text=True, cwd=ROOT)
  assert bad.returncode == 2 and 'Traceback' not in bad.stderr, bad.stderr[-3000:]
  assert ("--config.fedtta_prox.inner_learning_rate: expected a value of type float (as "
          "config.fedtta_prox.inner_learning_rate's default 0.5), got 'x'") in bad.stderr


def test_importing_the_library_and_configs_does_not_start_the_jax_backend():
  # launch/train.py sets XLA_FLAGS (engine.deterministic) after the config file is
  # loaded: any array made at import time would start the backend before that.
  import subprocess
  import sys
  code = ('from jax._src import xla_bridge\n'
          'import fedjax_shift.config, fedjax_shift.papers\n'
          'from configs import atp, default, fedevolve, fedicon, fedins, fedtta\n'
          'assert not xla_bridge.backends_are_initialized()\n')
  subprocess.run([sys.executable, '-c', code], cwd=ROOT, check=True)


def unused_imports(source: str):
  """Names a module imports from the package but never uses (a re-export: the name gets
  a second import path). ``# noqa: F401`` on the import marks an import for its side
  effect (registering names), which is not a re-export."""
  tree = ast.parse(source)
  lines = source.splitlines()
  used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
  used |= {node.value.id for node in ast.walk(tree)
           if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)}
  exported = set()
  for node in ast.walk(tree):   # __all__ = [...] names what a module re-exports on purpose
    if isinstance(node, ast.Assign) and any(getattr(t, 'id', '') == '__all__' for t in node.targets):
      exported |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
  unused = []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or '').startswith('fedjax_shift'):
      if 'noqa: F401' in lines[node.lineno - 1] and 'register' in lines[node.lineno - 1]:
        continue
      for alias in node.names:
        name = alias.asname or alias.name
        if name not in used and name not in exported:
          unused.append(name)
  return unused


def test_every_name_has_one_import_path():
  """No module outside the packages' ``__init__.py`` imports a name it does not use:
  a moved name is imported from where it lives, not through a module that re-exports
  it."""
  found = {}
  for module, path in package_modules().items():
    if path.endswith('__init__.py'):
      continue
    unused = unused_imports(open(path).read())
    if unused:
      found[module] = unused
  assert not found, f'names imported and not used (re-exports): {found}'
  assert unused_imports('from fedjax_shift.parts.trees import tree_sub, weighted_sum\n'
                        'x = tree_sub(1, 2)\n') == ['weighted_sum']


def paper_table_strings(source: str):
  """The string literals of ``source`` that name a paper's table ('Table 1', …),
  docstrings left out (they cite what code implements)."""
  tree = ast.parse(source)
  docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                     ast.AsyncFunctionDef))
                and node.body and isinstance(node.body[0], ast.Expr)
                and isinstance(node.body[0].value, ast.Constant)}
  return [node.value for node in ast.walk(tree)
          if isinstance(node, ast.Constant) and isinstance(node.value, str)
          and id(node) not in docstrings and re.search(r'\bTable \d', node.value)]


def test_no_paper_table_lives_outside_the_papers_folders():
  """The library knows no paper by its tables: row layouts, labels and captions of a
  paper's table live in fedjax_shift/papers/<paper>/ (or the paper's config), never in
  the engine, the methods or the pipelines."""
  found = {module: paper_table_strings(open(path).read())
           for module, path in package_modules().items()
           if not module.startswith('fedjax_shift.papers')}
  assert not {m: s for m, s in found.items() if s}, found
  assert paper_table_strings('"""Implements Table 1."""\nCAPTION = "Table 3 (ATP)"\n') == [
      'Table 3 (ATP)']


# The names every pipeline module defines for the registry (its run loop, its check, its
# run directories, its config sections and ranges) and the module logger.
PIPELINE_PROTOCOL = {'run', 'check', 'run_dirs', 'SECTIONS', 'RANGES', 'log'}


def top_level_names(path):
  names = []
  for node in ast.parse(open(path).read()).body:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
      names.append(node.name)
    elif isinstance(node, ast.Assign):
      names += [t.id for t in node.targets if isinstance(t, ast.Name)]
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
      names.append(node.target.id)
  return names


def names_in_two_modules(paths):
  """{name: the files defining it} of the names (but PIPELINE_PROTOCOL) that more than
  one of ``paths`` defines at top level."""
  where = {}
  for path in sorted(paths):
    for name in set(top_level_names(path)) - PIPELINE_PROTOCOL:
      where.setdefault(name, []).append(os.path.basename(path))
  return {name: files for name, files in where.items() if len(files) > 1}


def test_each_name_of_the_pipelines_is_defined_in_one_module():
  # One job a file (fedjax_shift/pipelines/__init__.py lists them); a check or a
  # fingerprint written twice drifts apart.
  assert names_in_two_modules(glob.glob(os.path.join(PACKAGE, 'pipelines', '*.py'))) == {}
  with open(os.path.join(PACKAGE, 'pipelines', 'base.py')) as f:
    assert len(f.readlines()) <= 250   # the registry and the results, not a hub


def test_the_one_module_check_sees_a_name_defined_twice(tmp_path):
  (tmp_path / 'a.py').write_text('def check_run_dir(x):\n  return x\nlog = None\n')
  (tmp_path / 'b.py').write_text('check_run_dir: int = 1\nlog = None\ndef run(): pass\n')
  assert names_in_two_modules([str(tmp_path / 'a.py'), str(tmp_path / 'b.py')]) == {
      'check_run_dir': ['a.py', 'b.py']}
