"""FedEvolve's prediction rules on a trained run, each measured on the same trained model.

    python -m fedjax_shift.papers.fedevolve.probe --config=configs/fedevolve.py:rmnist_dirinf,cnn_cpu \
        --workdir=/tmp/rm_cnn

Restores (or, if absent, trains) ``<workdir>/fedevolve/seed_<s>`` for each seed of the
config and prints, per seed, the target-domain accuracy (%) of:

* ``server``: the engine's Server rule — ψ features, the prototypes the server
  averaged from the last round's uploads (each client's S_M features under its
  locally trained φ);
* ``server_global_phi``: ψ features, prototypes of all clients' S_M under the
  final global φ (the same rule without the local-φ / global-ψ mismatch);
* ``psi_psi`` / ``phi_phi``: prototypes and test features from one encoder only;
* ``source_pair``: ψ(S_M) against φ(S_{M−1}) prototypes (the training objective's
  last pair: how well the sources are fitted);
* ``client_g<g>``: the Client rule (global φ, ψ; prototypes from the client's own
  S_M) with the S_M data of g clients pooled, mean over clients — g = 1 is the
  engine's Client column; larger g shows what more examples per class give.
"""
import json
import os
from typing import Dict

import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from fedjax_shift import models
from fedjax_shift.algorithms.fedevolve import encoder_features
from fedjax_shift.algorithms.prototypes import class_prototypes
from fedjax_shift.pipelines import runs, single_run

GROUPS = (1, 2, 4, 10, 20)


def nearest_prototype_accuracy(proto_features, proto_labels, features, labels,
                               num_classes: int) -> float:
  """Accuracy of the nearest present prototype (squared Euclidean, the argmin of
  either distance). proto_features [P, F], features [T, F]."""
  protos, counts = class_prototypes(proto_features, proto_labels,
                                    jnp.ones(len(proto_labels)), num_classes)
  dist = jnp.sum((features[:, None] - protos[None]) ** 2, -1)
  dist = jnp.where(counts[None] > 0, dist, jnp.inf)
  return float(jnp.mean(jnp.argmin(dist, -1) == labels))


def probe_seed(config: ml_collections.ConfigDict, workdir: str, seed: int) -> Dict[str, float]:
  bench = runs.build_data(config, seed)
  result = single_run.train_and_evaluate(
      config, os.path.join(workdir, 'fedevolve', f'seed_{seed}'), 'fedevolve', seed,
      single_run.RunInputs(bench=bench))
  state = result['server_state']
  module = models.create(config.model, bench.num_classes)
  num_classes = bench.num_classes
  train, test = bench.splits['train'], bench.splits['test']
  size = bench.info['domain_size']
  last = bench.info['num_domains'] - 1

  def block(m):  # per client: (x, y) of source domain block m, real examples only
    part = slice(m * size, (m + 1) * size)
    return [(train.x[k, part][train.mask[k, part]], train.y[k, part][train.mask[k, part]])
            for k in range(train.num_clients)]

  def features(encoder, x):  # encoder: 'phi' or 'psi', with its BatchNorm statistics
    params, stats = state.params[encoder], (state.batch_stats or {}).get(encoder)
    return jnp.concatenate([encoder_features(module, params, jnp.asarray(x[i:i + 256]), stats)
                            for i in range(0, len(x), 256)] or [jnp.zeros((0, 1))])

  phi, psi = 'phi', 'psi'
  s_m, s_prev = block(last), block(last - 1)
  targets = [(test.x[k][test.mask[k]], test.y[k][test.mask[k]])
             for k in range(test.num_clients)]
  cat = lambda parts, i: np.concatenate([p[i] for p in parts])
  x_m, y_m, x_t, y_t = cat(s_m, 0), cat(s_m, 1), cat(targets, 0), cat(targets, 1)
  psi_target, phi_m = features(psi, x_t), features(phi, x_m)
  server_logits = -jnp.sum((psi_target[:, None] - state.prototypes[None]) ** 2, -1)
  server_logits = jnp.where(state.present[None], server_logits, -jnp.inf)
  out = {
      'server': float(jnp.mean(jnp.argmax(server_logits, -1) == y_t)),
      'server_global_phi': nearest_prototype_accuracy(phi_m, y_m, psi_target, y_t,
                                                      num_classes),
      'psi_psi': nearest_prototype_accuracy(features(psi, x_m), y_m, psi_target, y_t,
                                            num_classes),
      'phi_phi': nearest_prototype_accuracy(phi_m, y_m, features(phi, x_t), y_t, num_classes),
      'source_pair': nearest_prototype_accuracy(features(phi, cat(s_prev, 0)), cat(s_prev, 1),
                                                features(psi, x_m), y_m, num_classes),
  }
  clients = [k for k in range(train.num_clients) if len(targets[k][1])]
  for group in GROUPS:
    if group > train.num_clients:
      break
    accuracies = []
    for start in range(0, train.num_clients, group):
      members = range(start, min(start + group, train.num_clients))
      pooled = [s_m[k] for k in members]
      proto_x, proto_y = cat(pooled, 0), cat(pooled, 1)
      for k in members:
        if k in clients:
          accuracies.append(nearest_prototype_accuracy(
              features(phi, proto_x), proto_y, features(psi, targets[k][0]), targets[k][1],
              num_classes))
    out[f'client_g{group}'] = float(np.mean(accuracies))
  out['engine_server'] = result['metrics']['global/test/accuracy']
  out['engine_client'] = result['metrics']['personalized/test/client_accuracy']
  return out


def main(argv):
  del argv
  config = flags.FLAGS.config
  for seed in config.seeds:
    row = probe_seed(config, flags.FLAGS.workdir, seed)
    print(json.dumps({'seed': seed, **{k: round(100 * v, 2) for k, v in row.items()}}))


if __name__ == '__main__':   # flags defined here only: tests import probe_seed
  config_flags.DEFINE_config_file('config', None, 'FedEvolve config file[:variant].')
  flags.DEFINE_string('workdir', None, 'Workdir of the FedEvolve run.')
  flags.mark_flags_as_required(['config', 'workdir'])
  app.run(main)
