"""fedjax_shift: federated learning under distribution shift in JAX/Flax.

Layering (each layer imports only from the layers before it; siblings in braces never
import each other; no two modules import each other; tests/test_registry.py checks all
three with the ``ast`` module):

    registry, metrics, checkpoint     leaves: name tables, JSONL metrics, orbax
    data → models → core → parts → {algorithms, adapters, benchmarks} → report
         → pipelines → papers → config → (launch/, configs/, outside the package)

``data`` holds sources, shifts and partitions; ``models`` the Flax classifiers;
``core`` the engine (compiled round, test-time scan, evaluation); ``parts`` what
training and test-time methods share; ``algorithms`` and ``adapters`` one file per
method, each registering itself with its defaults; ``benchmarks`` the named protocols;
``report`` the generic tables and plots and the registry of paper tables;
``pipelines`` the run loops (``config.pipeline``) over one loop (``pipelines/loop.py``);
``papers`` one folder per paper (its tables, numbers, probes, README); ``config`` the
base config filled from every registry, and the variants.
"""
__version__ = '0.1.0'
