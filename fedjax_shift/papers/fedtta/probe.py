"""FedTTA / FedTTA++ test-time steps on a trained run's new clients.

    python launch/train.py --config=configs/fedtta.py --workdir=/tmp/fedtta
    python -m fedjax_shift.papers.fedtta.probe --config=configs/fedtta.py --workdir=/tmp/fedtta \
        --algorithm=fedtta

Restores (or, if absent, trains) ``<workdir>/<algorithm>/seed_<s>`` for each seed of the
config, runs up to E = ``adapters.fedtta_pp.max_steps`` inner steps (η_inner of
``adapters.fedtta_pp``) on each new client's whole data, and prints per seed the
new-client accuracy (%) after 0, 1, 2, 3, 5, 10, 20 and E steps, and FedTTA++'s entropy
early stopping at patience 1, 3 and 5 — predicting with the model at the stop
('last') or with the lowest-entropy model seen ('best', ``restore_best``) — with the
mean step at which it stopped. Every number comes from one trace of E steps per client,
recomputed here with FedTTA++'s steps (its clip and weight decay) and its candidates
(``include_initial``).
"""
import json
import os
from typing import Dict

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from fedjax_shift import models
from fedjax_shift.parts.losses import weighted_entropy
from fedjax_shift.adapters.fedtta import adaptation, adaptation_module_of, filled_weight
from fedjax_shift.parts.fedtta_step import ADAPTATION, inner_step
from fedjax_shift.pipelines import programs, runs, single_run

REPORTED_STEPS = (0, 1, 2, 3, 5, 10, 20)
PATIENCES = (1, 3, 5)


def stop_and_best(entropies: np.ndarray, patience: int, include_initial: bool = False):
  """(step of the stop, step of the lowest entropy up to it) of one trace H_0 … H_E;
  the candidates are steps 1 … stop (Algorithm 1), or 0 … stop with
  ``include_initial`` (the authors' released code)."""
  lowest, waited = entropies[0], 0
  best, best_value = (0, entropies[0]) if include_initial else (1, np.inf)
  for step in range(1, len(entropies)):
    if entropies[step] < best_value:
      best, best_value = step, entropies[step]
    if entropies[step] < lowest:
      lowest, waited = entropies[step], 0
    else:
      waited += 1
    if waited >= patience:
      return step, best
  return len(entropies) - 1, best


def probe_seed(config: ml_collections.ConfigDict, workdir: str, algorithm: str,
               seed: int) -> Dict[str, float]:
  bench = runs.build_data(config, seed)
  result = single_run.train_and_evaluate(
      config, os.path.join(workdir, algorithm, f'seed_{seed}'), algorithm, seed,
      single_run.RunInputs(bench=bench))
  module = models.create(config.model, bench.num_classes)
  # the trained algorithm's global model {'params': ψ, 'fedtta_adaptation': φ}
  state = result['server_state']
  variables = {'params': state.variables['params']['base'],
               ADAPTATION: state.variables['params']['adaptation']}
  settings = adaptation(programs.adapter_section(config, 'fedtta_pp', algorithm))
  num_steps = settings.max_steps   # η_inner, ε: training's
  g = adaptation_module_of(variables[ADAPTATION])
  test = bench.splits['test']

  def trace(x, weight):
    norm_weight = filled_weight(weight, settings.fill_batch)   # as the adapter's step

    def step(params, _):
      params = inner_step(module, g, params, variables[ADAPTATION], x, norm_weight,
                          settings.step)
      logits = models.apply(module, {'params': params}, x)[0]
      return params, (weighted_entropy(logits, weight), jnp.argmax(logits, -1))
    logits = models.apply(module, {'params': variables['params']}, x)[0]
    _, (entropies, predictions) = jax.lax.scan(step, variables['params'], None,
                                               length=num_steps)
    return (jnp.concatenate([weighted_entropy(logits, weight)[None], entropies]),
            jnp.concatenate([jnp.argmax(logits, -1)[None], predictions]))

  entropies, predictions = jax.jit(jax.vmap(trace))(jnp.asarray(test.x),
                                                    jnp.asarray(test.mask, jnp.float32))
  entropies, predictions = np.asarray(entropies), np.asarray(predictions)  # [K, E+1, N]
  correct = (predictions == test.y[:, None]) & test.mask[:, None]
  total = test.mask.sum()
  out = {f'step_{s}': float(correct[:, s].sum() / total)
         for s in REPORTED_STEPS + (num_steps,) if s <= num_steps}
  clients = [k for k in range(test.num_clients) if test.mask[k].any()]
  for patience in PATIENCES:
    stops = [stop_and_best(entropies[k], patience, settings.include_initial) for k in clients]
    out[f'patience_{patience}_last'] = float(
        sum(correct[k, stop].sum() for k, (stop, _) in zip(clients, stops)) / total)
    out[f'patience_{patience}_best'] = float(
        sum(correct[k, best].sum() for k, (_, best) in zip(clients, stops)) / total)
    out[f'patience_{patience}_mean_stop'] = float(np.mean([stop for stop, _ in stops]))
  for name in ('global+fedtta', 'global+fedtta_pp'):
    key = f'{name}/test/accuracy'
    if key in result['metrics']:
      out[f'engine_{name}'] = result['metrics'][key]
  return out


def main(argv):
  del argv
  config = flags.FLAGS.config
  for seed in config.seeds:
    row = probe_seed(config, flags.FLAGS.workdir, flags.FLAGS.algorithm, seed)
    print(json.dumps({'seed': seed, **{k: round(v if 'mean_stop' in k else 100 * v, 2)
                                       for k, v in row.items()}}))


if __name__ == '__main__':   # flags defined here only: tests import probe_seed
  config_flags.DEFINE_config_file('config', None, 'FedTTA config file[:variant].')
  flags.DEFINE_string('workdir', None, 'Workdir of the FedTTA run.')
  flags.DEFINE_enum('algorithm', 'fedtta_prox', ['fedtta', 'fedtta_prox'],
                    'Which trained method to probe.')
  flags.mark_flags_as_required(['config', 'workdir'])
  app.run(main)
