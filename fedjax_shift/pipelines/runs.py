"""What every pipeline's runs share: the benchmark's data (built and checked), a run's
keys, where its state is placed over several processes, what its clients upload, and
the records of diverged runs.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from fedjax_shift import distributed
from fedjax_shift.benchmarks import Benchmark, build_benchmark, data_view
from fedjax_shift.core.algorithm import ClientData, FederatedAlgorithm
from fedjax_shift.core.round import NO_STEP_LIMIT, client_mesh
from fedjax_shift.data import federated, store
from fedjax_shift.metrics import read_json, read_metrics
from fedjax_shift.pipelines import loop
from fedjax_shift.pipelines import workdir as workdir_lib
from fedjax_shift.pipelines.loop import DivergenceError

log = logging.getLogger('fedjax_shift')

# The most bytes of benchmark arrays ``shared_data`` keeps for the next runs of a
# pipeline call.
MAX_SHARED_DATA_BYTES = 512 * 2 ** 20


def data_key(config: ml_collections.ConfigDict) -> str:
  """What the benchmark reads of ``config.data`` (``data_view``) as one string: runs
  whose data configs have equal keys build equal data from equal seeds."""
  return json.dumps(data_view(config.data).to_dict(), sort_keys=True, default=str)


def shared_data(config: ml_collections.ConfigDict, seed: int, cache: Optional[Dict]
                ) -> Benchmark:
  """``build_data(config, seed)``, kept in ``cache`` (a pipeline call's program cache)
  under the data config and seed, so that the methods of a config build each seed's
  data once; a benchmark that would take the kept arrays past
  ``MAX_SHARED_DATA_BYTES`` is built for its run alone."""
  if cache is None:
    return build_data(config, seed)
  kept = cache.setdefault('data', {})
  key = (data_key(config), seed)
  if key not in kept:
    bench = build_data(config, seed)
    size = lambda b: sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(b.splits))
    if sum(size(b) for b in kept.values()) + size(bench) > MAX_SHARED_DATA_BYTES:
      return bench
    kept[key] = bench
  return kept[key]


def build_data(config: ml_collections.ConfigDict, seed: int) -> Benchmark:
  """The benchmark of ``config.data`` and ``seed``, validated (and, with
  ``data.store_dir``, read from or saved to its files: ``saved_benchmark``)."""
  if config.data.get('store_dir'):
    return saved_benchmark(config, seed)
  bench = build_benchmark(config.data, seed)
  validate_benchmark(bench)
  if not any(int(np.sum(s.num_examples)) for n, s in bench.splits.items() if n != 'train'):
    raise ValueError(f'config.data: benchmark {config.data.benchmark!r} builds no evaluation '
                     f'split with examples (splits: {sorted(bench.splits)}): no accuracy '
                     f'would be measured')
  pad_to = config.data.pad_to
  if pad_to:
    if 'domain_size' in bench.info:
      raise ValueError(f'config.data.pad_to: benchmark {config.data.benchmark!r} lays each '
                       f'client out in domain blocks of {bench.info["domain_size"]}; leave '
                       f'pad_to at 0')
    splits = {}
    for name, split in bench.splits.items():
      try:
        splits[name] = store.pad_examples(split, pad_to)
      except ValueError as err:
        raise ValueError(f'config.data.pad_to={pad_to}: in split {name!r} of seed {seed}, '
                         f'{err}; raise pad_to') from None
    bench = bench._replace(splits=splits)
  return bench


def saved_data_dir(config: ml_collections.ConfigDict, seed: int) -> str:
  """The folder under ``data.store_dir`` of the data of ``config.data`` (but its store
  fields) and ``seed`` as the library's data code builds them: a hash of the three."""
  import hashlib
  import pathlib
  data = {k: v for k, v in data_view(config.data).to_dict().items()
          if k not in ('store', 'store_dir')}
  digest = hashlib.sha256(json.dumps([data, seed], sort_keys=True, default=str).encode())
  package = pathlib.Path(__file__).resolve().parents[1]
  for folder in ('data', 'benchmarks'):
    for path in sorted((package / folder).glob('*.py')):
      digest.update(path.read_bytes())
  return os.path.join(config.data.store_dir, f'{config.data.benchmark}-seed{seed}-'
                      f'{digest.hexdigest()[:16]}')


def saved_benchmark(config: ml_collections.ConfigDict, seed: int) -> Benchmark:
  """``build_data`` through ``data.store_dir``: the splits saved there by an earlier run
  of this data config, seed and library (``saved_data_dir``), their examples
  memory-mapped (``data/store.open_saved``); else built, saved and opened the same way.
  A split stored padded (not a ClientStore) is kept whole in the folder's
  ``SAVED_BENCHMARK`` with the benchmark's classes and info, and in memory."""
  import pickle
  folder = saved_data_dir(config, seed)
  index = os.path.join(folder, SAVED_BENCHMARK)
  if not os.path.exists(index):   # written last: a folder without it is an unfinished save
    unsaved = ml_collections.ConfigDict(config.to_dict())
    unsaved.data.store_dir = ''
    bench = build_data(unsaved, seed)
    for name, split in bench.splits.items():
      if store.is_store(split):
        store.save(split, os.path.join(folder, name))
    padded = {name: jax.tree.map(np.asarray, split) for name, split in bench.splits.items()
              if not store.is_store(split)}
    with open(index + '.tmp', 'wb') as f:
      pickle.dump({'num_classes': bench.num_classes, 'example_shape': bench.example_shape,
                   'info': bench.info, 'names': sorted(bench.splits), 'padded': padded}, f)
    os.replace(index + '.tmp', index)
    log.info('config.data.store_dir: saved seed %d\'s splits to %s', seed, folder)
  with open(index, 'rb') as f:
    saved = pickle.load(f)
  splits = {name: saved['padded'][name] if name in saved['padded'] else
            store.open_saved(os.path.join(folder, name), name) for name in saved['names']}
  bench = Benchmark(splits, saved['num_classes'], tuple(saved['example_shape']), saved['info'])
  validate_benchmark(bench)
  return bench


# The file of a saved benchmark's classes, info and padded splits (``saved_benchmark``).
SAVED_BENCHMARK = 'benchmark.pkl'


def validate_benchmark(bench: Benchmark) -> None:
  """Every split well formed (``data.federated.validate``) and a 'train' split with
  at least one example; errors name the split and client."""
  if 'train' not in bench.splits:
    raise ValueError(f'the benchmark has no train split (splits: {sorted(bench.splits)})')
  for name, split in bench.splits.items():
    store.validate_split(split, bench.num_classes, name)
    if split.num_clients != bench.splits['train'].num_clients:
      raise ValueError(f'split {name!r} has {split.num_clients} clients, the train split '
                       f'{bench.splits["train"].num_clients}')
  if int(np.sum(bench.splits['train'].num_examples)) == 0:
    raise ValueError('the train split holds no examples at any client (e.g. '
                     'a benchmark\'s split_fractions.train=0): nothing would be trained')


def data_digest(bench: Benchmark) -> str:
  """A hash of every split's labels, client sizes and per-client input sums: the same
  config and seed must rebuild the same data for a run to be resumed. It is the hash of
  the padded layout (labels [K, N], sums of each client's padded rows) whether a split
  is stored padded or compactly (hashed a chunk of clients at a time): the data, not
  their layout."""
  import hashlib
  digest = hashlib.sha256()
  for name in sorted(bench.splits):
    split = bench.splits[name]
    digest.update(name.encode())
    sums = []
    for chunk in store.padded_chunks(split):
      digest.update(np.ascontiguousarray(chunk.y).tobytes())
      x = np.asarray(chunk.x)
      sums.append(x.reshape(x.shape[0], -1).sum(1, dtype=np.float64))
    digest.update(np.ascontiguousarray(split.num_examples).tobytes())
    digest.update(np.round(np.concatenate(sums), 3).tobytes())
  return digest.hexdigest()


def check_same_data(path: str, digest: str) -> None:
  """Refuses to reuse a run directory whose recorded data differs from the data just
  built (a changed benchmark, source file or data_dir): its checkpoints were trained
  on other clients."""
  if not os.path.exists(path):
    return
  with open(path) as f:
    recorded = json.load(f).get('data_digest')
  if recorded is not None and recorded != digest:
    raise ValueError(f'{os.path.dirname(path)} was trained on other data than this config '
                     f'builds now (partition.json data_digest {recorded[:12]}… vs '
                     f'{digest[:12]}…: the benchmark code, its source files or data_dir '
                     f'changed); use a new --workdir')


def run_keys(seed: int):
  """(init, train, eval) keys of seed ``seed``'s run."""
  seed_key = jax.random.key(seed)
  return tuple(jax.random.fold_in(seed_key, i) for i in range(3))


def replicated(config: ml_collections.ConfigDict):
  """Where the device store and the initial states go: the default device, or, over
  several processes, replicated on the global mesh of ``engine.num_devices``."""
  if jax.process_count() == 1:
    return None
  return NamedSharding(client_mesh(config.engine.num_devices), PartitionSpec())


def cohort_sharding(config: ml_collections.ConfigDict):
  """The host store's cohort placement over several processes: sharded by client on
  the global mesh, each process moving its own devices' clients (None: one process)."""
  if jax.process_count() == 1:
    return None
  return NamedSharding(client_mesh(config.engine.num_devices), PartitionSpec('clients'))


def uploaded_by_part(algorithm: FederatedAlgorithm, server_state, client_states,
                     train: federated.FederatedData) -> Dict[str, int]:
  """Numbers a client sends per round, by kind, read off the shapes of its
  ``ClientOutput.update`` with no computation (FedEvolve Table 7): 'params' (every leaf
  under a 'params' key: the trained model parameters), 'batch_stats' (running
  statistics), else the leaf's first key ('proto_sums', 'feature', 'control', ...;
  'update' for a leaf at the top)."""
  first = train.take([0])
  one = ClientData(jnp.asarray(first.x[0]), jnp.asarray(first.y[0]), jnp.asarray(first.mask[0]),
                   jnp.asarray(first.num_examples[0]), jnp.int32(NO_STEP_LIMIT))
  state = jax.tree.map(lambda a: a[0], client_states)
  update = jax.eval_shape(algorithm.client_update, server_state, state, one,
                          jax.random.key(0))[0].update
  counts: Dict[str, int] = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(update):
    kind = upload_kind(path)
    counts[kind] = counts.get(kind, 0) + int(np.prod(leaf.shape))
  return counts


def upload_kind(path) -> str:
  """``uploaded_by_part``'s kind of the leaf at ``path`` (a pytree key path): 'params' or
  'batch_stats' when either names a level of it, else its first key ('update' at the
  top). A tuple key, as ``flax.traverse_util.flatten_dict`` makes (FedRep's shared
  part), counts as the levels it names."""
  keys = []
  for part in path:
    key = getattr(part, 'key', getattr(part, 'name', part))
    keys += [str(k) for k in key] if isinstance(key, tuple) else [str(key)]
  return next((k for k in ('params', 'batch_stats') if k in keys), keys[0] if keys else 'update')


def uploaded_parameters(algorithm: FederatedAlgorithm, server_state, client_states,
                        train: federated.FederatedData) -> int:
  """Numbers a client sends per round: every element of its ``ClientOutput.update``."""
  return sum(uploaded_by_part(algorithm, server_state, client_states, train).values())


def evaluated_rounds(run_dir: str, rounds: int) -> List[Dict[str, float]]:
  """Every evaluated round's accuracies up to ``rounds``, from ``run_dir``'s
  metrics.jsonl, for tables that report the test accuracy at the round of best
  validation accuracy (FedTTA Sec. 4.1.3)."""
  return [{k: v for k, v in record.items() if k == 'round' or k.endswith('accuracy')}
          for record in read_metrics(os.path.join(run_dir, 'metrics.jsonl'))
          if any(k.endswith('/accuracy') for k in record) and record['round'] <= rounds]


def settled_divergence(run_dir: str, rounds: int) -> Optional[DivergenceError]:
  """The divergence within ``rounds`` that ``run_dir``'s diverged.json records (None:
  none), which re-training would meet again (training is deterministic). The record
  must belong to the run it sits in: its fingerprint that of the run's run.json, its
  round past the run's newest checkpoint (a run keeps no checkpoint once diverged);
  else it is refused naming the file. Deleting the file retrains the run."""
  marker = os.path.join(run_dir, loop.DIVERGED_FILE)
  if not os.path.exists(marker):
    return None
  advice = 'delete it to train the run again'
  recorded = read_json(marker, advice)
  if not (isinstance(recorded, dict) and isinstance(recorded.get('round'), int) and
          recorded['round'] >= 1 and isinstance(recorded.get('error'), str)):
    raise workdir_lib.RunMismatchError(
        f'{marker} is not a record of a diverged run ({{"round": a round >= 1, "error": the '
        f'message, "fingerprint": the run\'s}}); {advice}.')
  own = loop.run_fingerprint(run_dir)
  if own is None or recorded.get('fingerprint', own) != own:
    raise workdir_lib.RunMismatchError(
        f'{marker} belongs to another run: its fingerprint is not the one of '
        f'{os.path.join(run_dir, "run.json")}' + (' (absent)' if own is None else '') +
        f'; {advice}.')
  kept = workdir_lib.checkpoint_rounds(run_dir)
  if kept and kept[-1] >= recorded['round']:
    raise workdir_lib.RunMismatchError(
        f'{marker} says the run diverged in round {recorded["round"]}, but the run holds a '
        f'checkpoint of round {kept[-1]} (a diverged run keeps none past its divergence): '
        f'it belongs to another run; {advice}.')
  return DivergenceError(recorded['error']) if recorded['round'] <= rounds else None


def settled_divergences(run_dirs: Sequence[str], rounds: int) -> Dict[int, DivergenceError]:
  """{index in ``run_dirs``: its ``settled_divergence``} of the runs that have one,
  read by process 0 and the same on every process (``distributed.primary_decides``)."""
  def read() -> Dict[int, str]:
    errors = {i: settled_divergence(run_dir, rounds) for i, run_dir in enumerate(run_dirs)}
    return {i: str(error) for i, error in errors.items() if error is not None}
  decided = distributed.primary_decides(read, f'the divergence records of {list(run_dirs)}')
  return {int(i): DivergenceError(error) for i, error in decided.items()}   # JSON: str keys


def log_settled(run_dir: str) -> None:
  log.info('%s: diverged before (%s); recorded again, not retrained (delete it to retrain)',
           run_dir, loop.DIVERGED_FILE)


def diverged_record(config: ml_collections.ConfigDict, run_dir: str, name: str, seed: int,
                    error: DivergenceError, **extra) -> Dict:
  """The record of a diverged run (with ``extra`` fields: a swept run's point), also
  written to ``run_dir``/results.json."""
  record = {'algorithm': name, 'seed': seed, 'metrics': {}, 'diverged': str(error),
            'rounds': config.rounds, 'train_seconds': float('nan'), **extra}
  with distributed.open_output(os.path.join(run_dir, 'results.json')) as f:
    json.dump(record, f, indent=1)
  return record
