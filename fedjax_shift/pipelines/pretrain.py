"""A pretrained backbone for the methods that fine-tune one (FedIns: a frozen ViT,
Feng et al., ICCV 2023 Sec. 3.2 and 4.1), from ``config.backbone``:

  weights = ''          no pretraining: every method starts from a random model
  weights = 'pretrain'  trained here, centrally, on ``backbone.domains`` (digit domains,
                        data/digit_domains.py; ``examples`` each, drawn with
                        ``backbone.seed``, 10 % held out to report source accuracy) with
                        Adam, and saved with orbax in ``<workdir>/backbone/`` (reused by
                        a later run of the same config; another config's is refused)
  weights = <path>      a user's weights: a ``.npz`` in the ViT-B/16 layout
                        (models/vit.py ``load_npz``), a ``.npz`` of torchvision's
                        ResNet-18 state dict (models/torchvision_resnet.py; its
                        BatchNorm statistics too) or a directory this module saved

No weights can be downloaded here, so 'pretrain' stands in for ImageNet-21K: the
default pretrains on generated SynthDigits-style renders (fonts), and the clients of
benchmarks/mixed_domains.py hold real and textured digits besides (their synth
examples are other renders). Every method of a federated run starts from the same
encoder (``with_backbone``); its head is new, as a pretrained ViT's classifier is
replaced for a downstream task. The pipeline ``pretrain`` only pretrains.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import traverse_util

from fedjax_shift import models
from fedjax_shift.data import digit_domains, sources
from fedjax_shift.models import torchvision_resnet, vit
from fedjax_shift.pipelines.base import PIPELINES, Results, hardware
from fedjax_shift.pipelines.run_config import check_sections
from fedjax_shift.pipelines.runs import build_data
from fedjax_shift.benchmarks import data_view
from fedjax_shift.benchmarks.digit_domains import DOMAIN
from fedjax_shift.registry import (NONNEGATIVE_INT, POSITIVE, POSITIVE_INT, TEXT, check_fields,
                                   interval, require, sequence_of)

log = logging.getLogger('fedjax_shift')
HELD_OUT = 0.1
SECTIONS = {'backbone': {
    'weights': '',              # '' | 'pretrain' | a .npz or a directory saved here
    'domains': ('synth',),      # digit domains pretrained on (data/digit_domains.py)
    'examples': 30000,          # per domain
    'epochs': 10,
    'batch_size': 64,
    'learning_rate': 3e-3,      # Adam's peak (warm-up 1 epoch, cosine decay)
    'seed': 0,
}}
RANGES = {
    'backbone.weights': TEXT,                       # '', 'pretrain' or a path (check)
    'backbone.domains': sequence_of(DOMAIN, 1),
    'backbone.examples': interval(20, integer=True),
    'backbone.epochs': POSITIVE_INT,
    'backbone.batch_size': POSITIVE_INT,
    'backbone.learning_rate': POSITIVE,
    'backbone.seed': NONNEGATIVE_INT,
}


def check_backbone(config: ml_collections.ConfigDict) -> None:
  """``config.backbone`` (every pipeline that starts methods from it): its fields, their
  ranges, and the weights they name."""
  check_fields(config.backbone, SECTIONS['backbone'], 'config.backbone')
  PIPELINES.check_ranges('pretrain', config, 'config')
  b = config.backbone
  if b.weights == 'pretrain':
    if backbone_reserve(config) > 0:
      others = digit_domains.without_reserve(b.domains)
      require(not others, 'backbone.domains',
              f'with data.{config.data.benchmark}.backbone_reserve > 0 the backbone draws '
              f'from the reserve of '
              f'{list(digit_domains.RESERVABLE)} (or new synth images); {others} have none')
  elif b.weights:
    require(os.path.exists(b.weights), 'backbone.weights',
            f"{b.weights!r} does not exist (use '', 'pretrain', a .npz file or a directory "
            f"saved by the pretrain pipeline)")


def backbone_reserve(config: ml_collections.ConfigDict) -> float:
  """The share of each real digit domain the benchmark keeps for the backbone
  (``data.<benchmark>.backbone_reserve``; 0 for a benchmark without one)."""
  return data_view(config.data).get('backbone_reserve', 0.0)


def image_size(config: ml_collections.ConfigDict) -> int:
  """The side of the pretraining images: the run's ``data.image_size`` (0: the digits'
  28), so that the backbone's input layer (a ViT's patch grid) fits the clients' data."""
  return config.data.image_size or digit_domains.SIZE


def backbone_fields(config: ml_collections.ConfigDict) -> dict:
  """What determines pretrained weights: the model, the backbone section, the image side
  and the real domains' reserve (these two recorded only when they are not 28 and 0,
  the values of every earlier record)."""
  size, reserve = image_size(config), backbone_reserve(config)
  return {'model': config.model.to_dict(), 'backbone': config.backbone.to_dict(),
          **({'image_size': size} if size != digit_domains.SIZE else {}),
          **({'backbone_reserve': reserve} if reserve else {})}


def source_data(config: ml_collections.ConfigDict):
  """(train, held-out) pairs of (x [N, S, S, 3], y [N]) from ``backbone.domains``, S =
  ``image_size(config)`` (the domains' 28-px images resized bilinearly); with
  ``backbone_reserve(config)`` > 0 the real domains' images come from their reserve, which
  no client holds."""
  b = config.backbone
  rng = np.random.default_rng([b.seed, 91])
  reserve = backbone_reserve(config)
  parts = [digit_domains.domain(name, b.examples, rng, config.data.data_dir or None, reserve,
                                'backbone' if reserve > 0 and name != 'synth' else 'all')
           for name in b.domains]
  x = np.concatenate([p.x for p in parts])
  size = image_size(config)
  if x.shape[1:3] != (size, size):
    x = sources.resize_images(x, size, size)
  y = np.concatenate([p.y for p in parts])
  order = rng.permutation(len(y))
  cut = int(round(len(y) * (1 - HELD_OUT)))
  return (x[order[:cut]], y[order[:cut]]), (x[order[cut:]], y[order[cut:]])


def train_backbone(config: ml_collections.ConfigDict) -> tuple:
  """Central training of ``config.model`` on the source domains; returns (params,
  {'source_accuracy', 'train_examples', 'epochs'})."""
  b = config.backbone
  (train_x, train_y), (held_x, held_y) = source_data(config)
  module = models.create(config.model, 10)
  key = jax.random.key(b.seed)
  params = models.init(module, key, jnp.asarray(train_x[:1]))['params']
  batch = min(b.batch_size, len(train_y))
  steps = len(train_y) // batch
  # Adam with a linear warm-up over the first epoch (none for a one-epoch run) and
  # cosine decay: ViTs' usual recipe.
  schedule = optax.warmup_cosine_decay_schedule(0.0, b.learning_rate,
                                                steps if b.epochs > 1 else 0, steps * b.epochs)
  optimizer = optax.adam(schedule)
  opt_state = optimizer.init(params)

  @jax.jit
  def step(params, opt_state, x, y):
    def loss_fn(p):
      logits = module.apply({'params': p}, x, train=True)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  @jax.jit
  def correct(params, x, y):
    return jnp.sum(jnp.argmax(module.apply({'params': params}, x), -1) == y)

  for epoch in range(b.epochs):
    order = np.random.default_rng([b.seed, 92, epoch]).permutation(len(train_y))
    losses = []
    for s in range(steps):
      index = order[s * batch:(s + 1) * batch]
      params, opt_state, loss = step(params, opt_state, jnp.asarray(train_x[index]),
                                     jnp.asarray(train_y[index]))
      losses.append(loss)
    log.info('backbone pretraining: epoch %d/%d, loss %.4f', epoch + 1, b.epochs,
             float(jnp.mean(jnp.stack(losses))))
  hits = sum(int(correct(params, jnp.asarray(held_x[i:i + 256]), jnp.asarray(held_y[i:i + 256])))
             for i in range(0, len(held_y), 256))
  return params, {'source_accuracy': 100.0 * hits / max(len(held_y), 1),
                  'train_examples': int(len(train_y)), 'epochs': int(b.epochs)}


def save(directory: str, params, record: dict) -> None:
  """``params`` as a flat {'a/b/c': array} orbax checkpoint in ``directory/params`` and
  ``record`` (fingerprint, source accuracy) in ``directory/backbone.json``."""
  os.makedirs(directory, exist_ok=True)
  flat = {'/'.join(path): np.asarray(leaf)
          for path, leaf in traverse_util.flatten_dict(params).items()}
  checkpointer = ocp.PyTreeCheckpointer()
  params = os.path.join(os.path.abspath(directory), 'params')
  checkpointer.save(params, flat, force=True)
  with open(os.path.join(directory, PARAMS_FILES), 'w') as f:
    json.dump(file_sizes(params), f, indent=1, sort_keys=True)
  with open(os.path.join(directory, 'backbone.json'), 'w') as f:
    json.dump(record, f, indent=1, sort_keys=True)


# Beside a saved backbone's params/: {relative path: size in bytes} of every file the
# checkpoint wrote, checked before reading it (a missing or cut file is named, not
# handed to the checkpoint library, whose reads fail asynchronously).
PARAMS_FILES = 'params_files.json'


def file_sizes(directory: str) -> dict:
  return {os.path.relpath(os.path.join(root, name), directory):
          os.path.getsize(os.path.join(root, name))
          for root, _, names in os.walk(directory) for name in names}


class BackboneReadError(ValueError):
  """A saved backbone directory that cannot be read (damaged or partly written)."""


def read_backbone(path: str) -> dict:
  """The flat {'a/b/c': array} parameters ``save`` wrote in ``path``; a damaged or
  incomplete directory is one clear error saying what to delete or re-run, not the
  checkpoint library's traceback."""
  params = os.path.join(os.path.abspath(path), 'params')
  if not os.path.isdir(params):
    raise BackboneReadError(f'config.backbone.weights: {path} holds no saved backbone '
                            f'(no {params}): point it at a directory the pretrain pipeline '
                            f'wrote, a ViT-B/16 .npz or a torchvision ResNet-18 .npz')
  advice = (f'It is damaged or was cut off while being written: delete {path} and re-run '
            f'(with backbone.weights=\'pretrain\' the run pretrains it again).')
  listed = os.path.join(path, PARAMS_FILES)
  if os.path.exists(listed):
    with open(listed) as f:
      written = json.load(f)
    found = file_sizes(params)
    damaged = sorted(name for name, size in written.items() if found.get(name) != size)
    if damaged:
      raise BackboneReadError(
          f'config.backbone.weights: the backbone in {path} cannot be read: '
          f'{os.path.join(params, damaged[0])} is ' +
          ('missing' if damaged[0] not in found else
           f'{found[damaged[0]]} bytes, written as {written[damaged[0]]}') +
          (f' ({len(damaged) - 1} more files too)' if len(damaged) > 1 else '') +
          f'. {advice}')
  checkpointer = ocp.PyTreeCheckpointer()
  try:
    return checkpointer.restore(params)
  except Exception as err:  # orbax / tensorstore raise many types for a damaged file
    first_line = str(err).strip().splitlines()[0][:300] if str(err).strip() else repr(err)
    raise BackboneReadError(
        f'config.backbone.weights: the backbone in {path} cannot be read ({type(err).__name__}: '
        f'{first_line}). {advice}') from None
  finally:
    checkpointer.close()


def load_encoder(path: str, module, example_x: jax.Array) -> dict:
  """The encoder variables {'params', ['batch_stats']} of ``module`` from ``path`` (a
  .npz in the ViT-B/16 layout, a .npz of torchvision's ResNet-18 state dict, or a
  directory ``save`` wrote), checked against the shapes ``module`` has for
  ``example_x``: a missing or wrong-shaped parameter is an error naming it."""
  if path.endswith('.npz'):
    encoder = getattr(module, 'encoder', None)
    if isinstance(module, vit.ViTClassifier):
      return {'params': vit.load_npz(path, module.encoder, example_x)}
    if isinstance(encoder, models.ResNet18Encoder):
      return torchvision_resnet.load_npz(path, encoder, example_x)
    raise ValueError(f'config.backbone.weights: {path}: a .npz holds a ViT-B/16 '
                     f'(config.model.name = "vit") or a torchvision ResNet-18 '
                     f'(config.model.name = "resnet18", stem = "imagenet")')
  expected = traverse_util.flatten_dict(
      jax.eval_shape(lambda: models.init(module, jax.random.key(0), example_x))['params'])
  stored = read_backbone(path)
  encoder_specs = {key: spec for key, spec in expected.items() if key[0] == 'encoder'}
  encoder = vit.checked_params(encoder_specs, stored, '/'.join,
                               f'config.backbone.weights: {path}',
                               f'config.model ({config_summary(module)})')
  return {'params': traverse_util.unflatten_dict({key[1:]: value
                                                  for key, value in encoder.items()})}


def config_summary(module) -> str:
  encoder = getattr(module, 'encoder', None)
  if isinstance(encoder, vit.ViTEncoder):
    return (f'vit patch {encoder.patch_size}, width {encoder.width}, depth {encoder.depth}, '
            f'heads {encoder.heads}, mlp {encoder.mlp_dim}')
  return type(module).__name__


def backbone_directory(workdir: str) -> str:
  return os.path.join(workdir, 'backbone')


def pretrained(config: ml_collections.ConfigDict, workdir: str) -> Optional[dict]:
  """The record of ``<workdir>/backbone`` after pretraining it there if it is not yet
  (None unless ``backbone.weights == 'pretrain'``). A backbone of another config is
  an error, never reused."""
  if config.backbone.weights != 'pretrain':
    return None
  directory = backbone_directory(workdir)
  record_path = os.path.join(directory, 'backbone.json')
  if os.path.exists(record_path):
    with open(record_path) as f:
      record = json.load(f)
    if record['fingerprint'] != json.loads(json.dumps(backbone_fields(config))):
      raise ValueError(f'{directory} holds a backbone pretrained with another config.model / '
                       f'config.backbone ({record["fingerprint"]}); use a new --workdir')
    log.info('backbone: reusing %s (source accuracy %.2f %%)', directory,
             record['source_accuracy'])
    return record
  params, stats = train_backbone(config)
  record = {'fingerprint': backbone_fields(config), **stats}
  save(directory, params, record)
  log.info('backbone: pretrained on %s, source accuracy %.2f %%, saved to %s',
           tuple(config.backbone.domains), stats['source_accuracy'], directory)
  return record


def backbone_encoder(config: ml_collections.ConfigDict, workdir: str, module,
                     example_x: jax.Array) -> Optional[dict]:
  """The encoder variables {'params', ['batch_stats']} every method of a run starts
  from (None: random init)."""
  weights = config.backbone.weights
  if not weights:
    return None
  if weights == 'pretrain':
    pretrained(config, workdir)
    weights = backbone_directory(workdir)
  return load_encoder(weights, module, example_x)


def with_backbone(state, encoder: dict, method: str):
  """``state`` (a method's initial server state) with ``state.variables[c]['encoder']``
  replaced by ``encoder[c]`` for each collection c of ``encoder`` ('params', and
  'batch_stats' for a BatchNorm backbone; shapes checked)."""
  variables = getattr(state, 'variables', None)
  if not isinstance(variables, dict) or 'encoder' not in variables.get('params', {}):
    raise ValueError(f'config.backbone.weights: method {method!r} keeps no model '
                     f'variables with an encoder in its server state; it cannot start '
                     f'from a pretrained backbone')
  replaced = dict(variables)
  for collection, loaded in encoder.items():
    current = variables.get(collection, {}).get('encoder')
    if current is None or jax.tree.structure(current) != jax.tree.structure(loaded) or any(
        a.shape != b.shape for a, b in zip(jax.tree.leaves(current), jax.tree.leaves(loaded))):
      raise ValueError(f'config.backbone.weights: the pretrained encoder\'s {collection} '
                       f'do not match method {method!r}\'s model')
    replaced[collection] = {**variables[collection], 'encoder': loaded}
  return state._replace(variables=replaced)


def run_dirs(config: ml_collections.ConfigDict, workdir: str):
  return []


def check(config: ml_collections.ConfigDict) -> None:
  check_sections(config)
  require(config.backbone.weights == 'pretrain', 'backbone.weights',
          f"the pretrain pipeline trains a backbone: set it to 'pretrain', got "
          f"{config.backbone.weights!r}")
  check_backbone(config)


@PIPELINES.register('pretrain', defaults=SECTIONS, ranges=RANGES, check=check,
                    run_dirs=run_dirs)
def run(config: ml_collections.ConfigDict, workdir: str) -> Results:
  """Pretrains (or finds) ``<workdir>/backbone``; a federated run with
  ``backbone.weights=<workdir>/backbone`` then starts from it."""
  record = pretrained(config, workdir)
  info = hardware()
  table = ('| Backbone | Source domains | Train examples | Epochs | Source accuracy (%) |\n'
           '|---|---|---|---|---|\n'
           f"| {config_summary(models.create(config.model, 10))} | "
           f"{', '.join(config.backbone.domains)} | {record['train_examples']} | "
           f"{record['epochs']} | {record['source_accuracy']:.2f} |")
  preamble = (f'Backbone pretrained in {backbone_directory(workdir)}; hardware: '
              f"{info['device_kind']} ({info['backend']}).")
  return Results(preamble, (table,), (os.path.join(backbone_directory(workdir),
                                                   'backbone.json'),), {'backbone': record})


def backbone_for(config: ml_collections.ConfigDict, workdir: str) -> Optional[dict]:
  """The pretrained encoder of ``config.backbone`` for this run's model and data
  (None without one); pretrains it in ``<workdir>/backbone`` first if asked."""
  if not config.backbone.weights:
    return None
  bench = build_data(config, config.seeds[0])
  module = models.create(config.model, bench.num_classes)
  return backbone_encoder(config, workdir, module,
                                   jnp.asarray(bench.splits['train'].first_example()))
