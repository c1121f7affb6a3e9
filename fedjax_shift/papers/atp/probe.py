"""ATP's learned α kept on one subset of modules at a time (zero on the others), on a
finished run's target clients: which modules' rates help and which hurt.

    python launch/train.py --config=configs/atp.py:digits_feature --workdir=/tmp/atp_feature
    python -m fedjax_shift.papers.atp.probe --config=configs/atp.py:digits_feature \
        --workdir=/tmp/atp_feature

For each shift and seed of the config, restores ``<workdir>/<shift>/seed_<s>`` (the
pretrained model from its checkpoint, α from ``alpha.json``) and prints ATP-batch and
ATP-online accuracy (%) on the target clients with α on: every module, none (the
global model, No adaptation), the BatchNorm statistics only, the parameters only, and
each layer alone (its parameters and statistics), layers in the model's order. Every
subset is an argument of the same compiled evaluation (one compilation per mode).
"""
import json
import os
from typing import Dict, List, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from fedjax_shift import models
from fedjax_shift.benchmarks import build_benchmark
from fedjax_shift.parts import atp_rates
from fedjax_shift.pipelines import atp as atp_pipeline
from fedjax_shift.pipelines.run_config import algorithm_names
from fedjax_shift.pipelines.single_run import RunInputs, train_and_evaluate

ATP_ROWS = ('atp_batch', 'atp_online')


def layer_of(name: str) -> str:
  """'params/encoder/Dense_0/kernel' -> 'encoder/Dense_0'."""
  return '/'.join(name.split('/')[1:-1])


def alpha_subsets(names: List[str], layers: Tuple[str, ...]) -> Dict[str, set]:
  """{label: the α module names it keeps}, for ``names`` (atp_rates.module_names) and
  the model's ``layers`` in definition order."""
  subsets = {'every module': set(names), 'none (No adaptation)': set(),
             'BatchNorm statistics': {n for n in names if n.startswith('batch_stats/')},
             'parameters': {n for n in names if n.startswith('params/')}}
  for layer in layers:
    kept = {n for n in names if layer_of(n) == layer}
    if kept:
      subsets[f'{layer} alone'] = kept
  return subsets


def masked_alpha(alpha, names: List[str], kept: set):
  """α with every module outside ``kept`` set to 0 (the same tree)."""
  leaves = [a if n in kept else jnp.zeros_like(a)
            for n, a in zip(names, jax.tree.leaves(alpha))]
  return jax.tree.unflatten(jax.tree.structure(alpha), leaves)


def restore(config: ml_collections.ConfigDict, workdir: str, shift: str, seed: int):
  """(module, pretrained variables, α, ShiftData) of one finished run."""
  run_dir = os.path.join(workdir, shift, f'seed_{seed}')
  alpha_path = os.path.join(run_dir, 'alpha.json')
  if not os.path.exists(alpha_path):
    raise FileNotFoundError(f'{alpha_path} is missing: run launch/train.py with this '
                            f'config and workdir first')
  shift_config = atp_pipeline.for_shift(config, shift)
  data = build_benchmark(shift_config.data, seed)
  module = models.create(config.model, data.source.num_classes)
  pre = train_and_evaluate(shift_config, os.path.join(run_dir, 'pretrain'),
                           algorithm_names(config)[0], seed, RunInputs(bench=data.source))
  variables = pre['server_state'].variables
  template = atp_rates.init_alpha(variables)
  with open(alpha_path) as f:
    values = json.load(f)
  names = atp_rates.module_names(template)
  alpha = jax.tree.unflatten(jax.tree.structure(template),
                             [jnp.asarray(values[n], jnp.float32) for n in names])
  return module, variables, alpha, data


def probe_run(config: ml_collections.ConfigDict, workdir: str, shift: str, seed: int
              ) -> Dict[str, Dict[str, float]]:
  """{subset label: {row key: accuracy %}} of one run."""
  module, variables, alpha, data = restore(config, workdir, shift, seed)
  names = atp_rates.module_names(alpha)
  layers = models.layer_order(module, tuple(data.source.example_shape))
  source_x, source_y = atp_pipeline.source_examples(data.source.splits['val'])
  evaluators = atp_pipeline.Evaluators(config, module, data.source.num_classes)
  rng = jax.random.fold_in(jax.random.key(seed), 7)   # the pipeline's test-time key
  table: Dict[str, Dict[str, float]] = {}
  for key in ATP_ROWS:
    name, mode = config.tta.adapter[key], config.tta.mode[key]
    evaluate = evaluators.get(name, mode, atp_pipeline.shift_adapter_section(config, name, shift))
    for label, kept in alpha_subsets(names, layers).items():
      inputs = atp_pipeline.AdapterInputs(variables, source_x, source_y,
                                          masked_alpha(alpha, names, kept))
      per_client = atp_pipeline.adapter_accuracy(evaluate, inputs, variables, data.target, rng,
                                                 config.tta.client_chunk)
      table.setdefault(label, {})[key] = 100 * float(np.nanmean(per_client))
  return table


def markdown(table: Dict[str, Dict[str, float]], config: ml_collections.ConfigDict) -> str:
  labels = [config.tta.label[key] for key in ATP_ROWS]
  lines = ['| α kept on | ' + ' | '.join(labels) + ' |', '|---' * (len(labels) + 1) + '|']
  for subset, row in table.items():
    lines.append(f'| {subset} | ' + ' | '.join(f'{row[key]:.2f}' for key in ATP_ROWS) + ' |')
  return '\n'.join(lines)


def main(argv):
  del argv
  config = flags.FLAGS.config
  for shift in config.tta.shifts:
    for seed in config.seeds:
      print(f'\n{shift} shift, seed {seed}\n')
      print(markdown(probe_run(config, flags.FLAGS.workdir, shift, seed), config))


if __name__ == '__main__':   # flags defined here only: tests import probe_run
  config_flags.DEFINE_config_file('config', None, 'configs/atp.py:<variant>')
  flags.DEFINE_string('workdir', None, 'The finished run of launch/train.py.')
  flags.mark_flags_as_required(['config', 'workdir'])
  app.run(main)
