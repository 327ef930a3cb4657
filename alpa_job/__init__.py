"""alpa-cluster-kit's job package: train, inspect and doctor Alpa / JAX jobs on a Ray cluster.

Nothing here imports an engine (jax, flax, alpa) at module level, so the package stays importable
on the Alpa image's old stack (Python 3.9, ray 2.1.0) as well as the modern one.
"""

__version__ = "0.1.0"
