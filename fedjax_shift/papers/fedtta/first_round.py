"""The first round's local training of every training client, from the initial model,
with and without the gradient clip: where a client rate diverges.

    python -m fedjax_shift.papers.fedtta.first_round --config=configs/fedtta.py:fashion_mnist \
        --clip_norms=0,10

Builds the config's data (seed ``--seed``) and model, and trains each training client
from the same initialisation for ``client.local_steps`` steps of ``client.batch_size``
(a fresh permutation of its examples each epoch, batches running on across an epoch's
end) with the optimizer ``method``'s client would
use (``--method``, default fedavg), its ``clip_norm`` replaced by each of
``--clip_norms``. Prints per clip: the largest batch loss and gradient norm over all
clients and steps, how many clients end with a non-finite loss, and the median final
loss. One line per clip; nothing is written.
"""
from typing import Dict, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import app, flags
from ml_collections import config_flags

from fedjax_shift import models
from fedjax_shift.algorithms.base import client_optimizer, method_client
from fedjax_shift.pipelines import runs


def client_batches(num_examples: int, batch_size: int, steps: int,
                   rng: np.random.Generator) -> np.ndarray:
  """[steps, batch_size] example indices: epochs of fresh permutations, concatenated."""
  epochs = -(-steps * batch_size // num_examples)
  order = np.concatenate([rng.permutation(num_examples) for _ in range(epochs)])
  return order[:steps * batch_size].reshape(steps, batch_size)


def first_round(config: ml_collections.ConfigDict, clip_norms: Sequence[float],
                method: str = 'fedavg', seed: int = 0) -> Dict[float, dict]:
  """{clip: {'max_loss', 'max_grad_norm', 'nonfinite_clients', 'median_final_loss',
  'clients'}} of the first round's local training (module docstring)."""
  bench = runs.build_data(config, seed)
  train = bench.splits['train']
  module = models.create(config.model, bench.num_classes)
  variables = models.init(module, jax.random.key(seed), jnp.asarray(train.first_example()))
  client = method_client(config, method)
  steps, batch_size = client.local_steps, client.batch_size
  if steps < 1:
    raise ValueError('first_round: set config.client.local_steps (the round\'s steps)')

  def loss_fn(params, x, y):
    logits = models.apply(module, {**variables, 'params': params}, x)[0]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  out = {}
  for clip in clip_norms:
    optimizer = client_optimizer(ml_collections.ConfigDict({**client.to_dict(),
                                                            'clip_norm': float(clip)}))

    @jax.jit
    def train_client(x, y, order):
      def step(carry, batch):
        params, state = carry
        loss, grads = jax.value_and_grad(loss_fn)(params, x[batch], y[batch])
        updates, state = optimizer.update(grads, state, params)
        return (optax.apply_updates(params, updates), state), (loss, optax.tree_utils.tree_norm(grads))
      params = variables['params']
      _, (losses, norms) = jax.lax.scan(step, (params, optimizer.init(params)), order)
      return losses, norms

    rng = np.random.default_rng([seed, 5])
    losses, norms = [], []
    for k in np.nonzero(np.asarray(train.num_examples) > 0)[0]:
      n = int(train.num_examples[k])
      client_losses, client_norms = train_client(
          jnp.asarray(train.x[k, :n]), jnp.asarray(train.y[k, :n]),
          jnp.asarray(client_batches(n, batch_size, steps, rng)))
      losses.append(np.asarray(client_losses))
      norms.append(np.asarray(client_norms))
    losses, norms = np.stack(losses), np.stack(norms)
    finite, finite_losses = np.isfinite(losses[:, -1]), losses[np.isfinite(losses)]
    out[float(clip)] = {
        'clients': len(losses),
        'max_loss': float(finite_losses.max()) if finite_losses.size else float('nan'),
        'max_grad_norm': float(np.max(norms)),
        'nonfinite_clients': int((~finite).sum()),
        'median_final_loss': float(np.median(losses[finite, -1])) if finite.any() else float('nan')}
  return out


def main(argv):
  del argv
  config = FLAGS.config
  results = first_round(config, [float(c) for c in FLAGS.clip_norms], FLAGS.method, FLAGS.seed)
  rate = method_client(config, FLAGS.method).learning_rate
  for clip, row in results.items():
    print(f"{FLAGS.method} rate {rate}, clip {clip or 'none'}: {row['nonfinite_clients']} of "
          f"{row['clients']} clients non-finite after {config.client.local_steps} steps; "
          f"largest batch loss {row['max_loss']:.4g}, largest gradient norm "
          f"{row['max_grad_norm']:.4g}, median final loss {row['median_final_loss']:.4g}")


if __name__ == '__main__':   # flags defined here only: tests import first_round
  FLAGS = flags.FLAGS
  config_flags.DEFINE_config_file('config', None, 'A configs/fedtta.py config.')
  flags.DEFINE_list('clip_norms', ['0', '10'], 'Global-norm clips to compare (0: none).')
  flags.DEFINE_string('method', 'fedavg', "Whose client optimizer (its rate and clip).")
  flags.DEFINE_integer('seed', 0, 'Data and initialisation seed.')
  flags.mark_flags_as_required(['config'])
  app.run(main)
