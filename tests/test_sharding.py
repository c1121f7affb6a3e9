"""The cohort sharded over a 4-device 'clients' mesh equals the 1-device round."""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent('''
    import jax, jax.numpy as jnp, numpy as np, chex
    assert len(jax.devices()) == 4, jax.devices()
    import sys; sys.path.insert(0, 'tests')
    from helpers import tiny_config, toy_clients
    from fedjax_shift import models
    from fedjax_shift import algorithms
    from fedjax_shift.core.round import (RoundConfig, build_round, client_mesh, round_key,
                                         stack_client_states)
    config = tiny_config(**{'model.name': 'bn_mlp'})
    data, _, _ = toy_clients([5, 8, 3, 6, 7, 4, 9, 2], num_classes=3)
    for name in ['fedavg', 'fedbn']:
      module = models.create(config.model, 3)
      algorithm = algorithms.build(name, config, module, data.max_examples)
      server = algorithm.init(jax.random.key(0), jnp.asarray(data.x[0, :1]))
      clients = stack_client_states(algorithm, server, data.num_clients)
      round_config = RoundConfig(cohort_size=4)
      one = build_round(algorithm, round_config)[0]
      four = build_round(algorithm, round_config, mesh=client_mesh(4))[0]
      s1, c1, s4, c4 = server, clients, server, clients
      for r in range(3):
        key = round_key(jax.random.key(2), r)
        a = one(s1, c1, data, key); b = four(s4, c4, data, key)
        s1, c1, s4, c4 = a.server_state, a.client_states, b.server_state, b.client_states
      chex.assert_trees_all_close(s1, s4, atol=1e-5)
      chex.assert_trees_all_close(c1, c4, atol=1e-5)
      print(name, 'sharded == unsharded')
    # The cohort sorted by size in groups of 4 (each sharded over the 4 devices), cut to
    # planned padded sizes, equals the same groups on one device.
    from fedjax_shift.core import plan
    bounds = plan.group_bounds(data.num_examples, 8, 4)
    grouped = RoundConfig(cohort_size=8, client_chunk=4, group_examples=plan.plan_group_examples(
        bounds, plan.fit_example_buckets(bounds, 4, 2)))
    assert len(set(grouped.group_examples)) == 2, grouped
    one = build_round(algorithm, grouped)[0]
    four = build_round(algorithm, grouped, mesh=client_mesh(4))[0]
    key = round_key(jax.random.key(3), 0)
    a = one(server, clients, data, key); b = four(server, clients, data, key)
    chex.assert_trees_all_close(a.server_state, b.server_state, atol=1e-5)
    print('grouped sharded == unsharded')
    # The same groups gathered from a compact store, over the mesh, under a likely plan
    # that this cohort (every client) exceeds in its second group (5th largest client:
    # 6 examples > 3): the fallback runs, and equals the padded round on one device.
    from fedjax_shift.data import store
    likely = grouped._replace(group_examples=(grouped.group_examples[0], 3),
                              fallback_examples=grouped.group_examples)
    c = build_round(algorithm, likely, mesh=client_mesh(4))[0](server, clients,
                                                               store.compact(data), key)
    assert float(c.metrics['fallback_plan']) == 1.0
    chex.assert_trees_all_close(a.server_state, c.server_state, atol=1e-5)
    print('store sharded == padded')
''')


def test_four_device_round_equals_one_device():
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=4',
             JAX_PLATFORMS='cpu')
  proc = subprocess.run([sys.executable, '-c', SCRIPT], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'fedavg sharded == unsharded' in proc.stdout
  assert 'fedbn sharded == unsharded' in proc.stdout
  assert 'grouped sharded == unsharded' in proc.stdout
  assert 'store sharded == padded' in proc.stdout
