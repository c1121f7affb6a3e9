"""fedjax_shift: federated learning under distribution shift in JAX/Flax.

Layering (each layer imports only from the layers before it; no two modules import
each other; tests/test_registry.py checks both with the ``ast`` module):

    registry, metrics, checkpoint     leaves: name tables, JSONL metrics, orbax
    data → models → core → algorithms / adapters → benchmarks
         → pipelines, report → config → (launch/, configs/, outside the package)

``data`` holds sources, shifts and partitions; ``models`` the Flax classifiers;
``core`` the engine (compiled round, test-time scan, evaluation); ``algorithms`` and
``adapters`` one file per method, each registering itself with its defaults;
``benchmarks`` the named protocols; ``pipelines`` the run loops (``config.pipeline``);
``config`` the base config filled from every registry, and the variants.
"""
__version__ = '0.1.0'
