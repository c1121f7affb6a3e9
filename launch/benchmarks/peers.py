"""The peers a user would pick: the papers' per-client PyTorch loop, PyTorch torch.func
over stacked clients, fedjax 0.0.17's FedAvg. Run as a script in a peer's environment
(``--fedjax_python``): imports nothing of fedjax_shift, and torch, fedjax and haiku
only where a case needs them (none is a dependency).
"""
import copy
import importlib.metadata
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from launch.benchmarks import register  # noqa: E402
from launch.benchmarks.common import (FLAGS, SHAPES, client_sizes, cohort_arrays,  # noqa: E402
                                      define_flags, num_clients, run_case, timed)


def torch_twin(batch_statistics_only: bool = False):
  """(model, x [K, N, ...], y [K, N]) of the PyTorch twin of --model, or a str saying
  why there is none. ``batch_statistics_only``: BatchNorm without running statistics
  (what a functional, vmapped call can use)."""
  try:
    import torch
  except ImportError:
    return 'torch is not installed'
  if FLAGS.torch_threads:
    torch.set_num_threads(FLAGS.torch_threads)
  if FLAGS.model not in ('atp_cnn', 'mlp', 'lenet5'):
    return f'no PyTorch twin of {FLAGS.model}'
  from torch import nn
  x, y, _, _ = cohort_arrays(num_clients())
  track = not batch_statistics_only
  if FLAGS.model == 'atp_cnn':
    def block(cin, cout, pool):
      layers = [nn.Conv2d(cin, cout, 3, bias=False),
                nn.BatchNorm2d(cout, track_running_stats=track), nn.ReLU()]
      return layers + ([nn.MaxPool2d(2)] if pool else [])
    model = nn.Sequential(*block(3, 32, True), *block(32, 64, True), *block(64, 64, False),
                          nn.Flatten(), nn.Linear(64 * 4 * 4, 64),
                          nn.BatchNorm1d(64, track_running_stats=track),
                          nn.ReLU(), nn.Linear(64, 10))
    x = torch.from_numpy(x).permute(0, 1, 4, 2, 3).contiguous()
  elif FLAGS.model == 'lenet5':   # the FedTTA authors' models/fashion_mnist LeNet
    model = nn.Sequential(nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(64 * 7 * 7, 512), nn.ReLU(),
                          nn.Linear(512, 10))
    x = torch.from_numpy(x).permute(0, 1, 4, 2, 3).contiguous()
  else:
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 200), nn.ReLU(), nn.Linear(200, 200),
                          nn.ReLU(), nn.Linear(200, 10))
    x = torch.from_numpy(x)
  return model, x, torch.from_numpy(y).long()


def case_torch():
  """(d) the papers' loop: per client, a deep copy of the global model, local SGD, then
  the mean of the state dicts; on the GPU when torch sees one."""
  twin = torch_twin()
  if isinstance(twin, str):
    return {'skipped': twin}
  import torch
  model, x, y = twin
  sizes = client_sizes(num_clients())
  device = 'cuda' if torch.cuda.is_available() else 'cpu'
  model, x, y = model.to(device), x.to(device), y.to(device)
  loss_fn = torch.nn.CrossEntropyLoss()

  def run():
    states = []
    for k in range(num_clients()):
      local = copy.deepcopy(model)
      local.train()
      opt = torch.optim.SGD(local.parameters(), lr=0.01)
      perm = torch.randperm(int(sizes[k]), device=device)   # the client's own examples
      for start in range(0, int(sizes[k]), FLAGS.batch_size):
        idx = perm[start:start + FLAGS.batch_size]
        opt.zero_grad()
        loss_fn(local(x[k][idx]), y[k][idx]).backward()
        opt.step()
      states.append(local.state_dict())
    with torch.no_grad():
      averaged = {name: sum(s[name].float() for s in states) / len(states)
                  for name in states[0]}
      model.load_state_dict({n: v.to(states[0][n].dtype) for n, v in averaged.items()})
    if device == 'cuda':
      torch.cuda.synchronize()

  median, times = timed(run, FLAGS.repeats)
  return {'seconds': median, 'times': times, 'compile_s': 0.0, 'device': device,
          'torch': torch.__version__, 'threads': torch.get_num_threads()}


def case_fedjax():
  """(f) fedjax 0.0.17's FedAvg (``fedjax.algorithms.fed_avg``: a Python loop over
  clients of its jitted per-client step, ``for_each_client``) on the same clients, a
  Haiku twin of the MLP; run in --fedjax_python's environment (fedjax needs an older
  jax), or skipped with the reason when fedjax does not import. Imports nothing of
  fedjax_shift."""
  try:
    import jax
    if not hasattr(jax, 'tree_map'):   # fedjax 0.0.17 calls jax.tree_map
      jax.tree_map = jax.tree_util.tree_map
    import fedjax
    import haiku as hk
  except Exception as err:   # noqa: BLE001  (any import failure means: no peer here)
    return {'skipped': f'fedjax does not import here ({type(err).__name__}: {err}); '
                       f'give --fedjax_python of an environment with fedjax 0.0.17'}
  if FLAGS.model != 'mlp':
    return {'skipped': f'no fedjax twin of {FLAGS.model}'}
  sizes = client_sizes(num_clients())
  rng = np.random.default_rng(0)
  clients_data = {f'{k}'.encode(): {
      'x': rng.random((int(n),) + SHAPES[FLAGS.model], dtype=np.float32),
      'y': rng.integers(0, 10, int(n)).astype(np.int32)} for k, n in enumerate(sizes)}

  def forward(batch):
    x = batch['x'].reshape((batch['x'].shape[0], -1))
    return hk.Sequential([hk.Linear(200), jax.nn.relu, hk.Linear(200), jax.nn.relu,
                          hk.Linear(10)])(x)

  transformed = hk.transform(forward)
  sample = {'x': np.zeros((1,) + SHAPES[FLAGS.model], np.float32), 'y': np.zeros(1, np.int32)}
  model = fedjax.create_model_from_haiku(
      transformed_forward_pass=transformed, sample_batch=sample,
      train_loss=lambda batch, preds: fedjax.metrics.unreduced_cross_entropy_loss(
          batch['y'], preds))
  grad_fn = fedjax.model_grad(model)
  algorithm = fedjax.algorithms.fed_avg.federated_averaging(
      grad_fn, fedjax.optimizers.sgd(0.01), fedjax.optimizers.sgd(1.0),
      fedjax.ShuffleRepeatBatchHParams(batch_size=FLAGS.batch_size, num_epochs=1,
                                       drop_remainder=False))
  state = algorithm.init(model.init(jax.random.PRNGKey(0)))
  clients = [(cid, fedjax.ClientDataset(data), jax.random.PRNGKey(k))
             for k, (cid, data) in enumerate(clients_data.items())]

  def run():
    new_state, _ = algorithm.apply(state, clients)
    return jax.block_until_ready(new_state.params)

  tick = time.perf_counter()
  run()
  compile_s = time.perf_counter() - tick
  median, times = timed(run, FLAGS.repeats)
  return {'seconds': median, 'times': times, 'compile_s': compile_s,
          'fedjax': importlib.metadata.version('fedjax'), 'jax': jax.__version__}


def case_torch_vmap():
  """(e) PyTorch ``torch.func``: the clients' parameters stacked, one ``vmap``ped
  gradient per local step over every client's batch (BatchNorm on batch statistics),
  SGD, then the mean — the vmapped peer of (a), on the GPU when torch sees one."""
  if len(set(client_sizes(num_clients()).tolist())) > 1:
    return {'skipped': 'stacked clients of equal size only (--sizes=uniform)'}
  twin = torch_twin(batch_statistics_only=True)
  if isinstance(twin, str):
    return {'skipped': twin}
  import torch
  from torch.func import functional_call, grad, vmap
  model, x, y = twin
  device = 'cuda' if torch.cuda.is_available() else 'cpu'
  model, x, y = model.to(device), x.to(device), y.to(device)
  global_params = {k: v.detach() for k, v in model.named_parameters()}
  loss_fn = torch.nn.CrossEntropyLoss()

  def loss(params, xb, yb):
    return loss_fn(functional_call(model, params, (xb,)), yb)

  client_grads = vmap(grad(loss))
  clients = torch.arange(num_clients(), device=device)[:, None]

  def run():
    params = {k: v.expand(num_clients(), *v.shape).clone() for k, v in global_params.items()}
    perms = torch.argsort(torch.rand(num_clients(), FLAGS.examples, device=device), dim=1)
    for start in range(0, FLAGS.examples, FLAGS.batch_size):
      idx = perms[:, start:start + FLAGS.batch_size]
      grads = client_grads(params, x[clients, idx], y[clients, idx])
      params = {k: params[k] - 0.01 * grads[k] for k in params}
    averaged = {k: v.mean(0) for k, v in params.items()}
    if device == 'cuda':
      torch.cuda.synchronize()
    return averaged

  median, times = timed(run, FLAGS.repeats)
  return {'seconds': median, 'times': times, 'compile_s': 0.0, 'device': device,
          'torch': torch.__version__, 'threads': torch.get_num_threads()}


register('torch', '(d) PyTorch per-client loop', lambda name: case_torch())
register('torch_vmap', '(e) PyTorch torch.func vmap over stacked clients',
         lambda name: case_torch_vmap())
register('fedjax', '(f) fedjax 0.0.17 FedAvg (for_each_client)', lambda name: case_fedjax())


if __name__ == '__main__':   # a case in a peer's environment (spawn, --fedjax_python)
  from absl import app
  define_flags()
  app.run(lambda argv: print(json.dumps(run_case(FLAGS.case))))
