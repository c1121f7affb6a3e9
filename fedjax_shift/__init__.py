"""fedjax_shift: federated learning under distribution shift in JAX/Flax."""
__version__ = '0.1.0'
