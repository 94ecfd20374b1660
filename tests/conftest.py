"""Shared pytest fixtures."""

# Session fixture `slurm_cluster`: a real local SLURM cluster (tests/slurm_cluster.py, slurm/cluster.py).
try:
    from slurm_cluster import slurm_cluster  # noqa: F401  (tests/ on sys.path: rootdir "prepend" import)
except ImportError:  # tests/ as a package
    from .slurm_cluster import slurm_cluster  # noqa: F401
