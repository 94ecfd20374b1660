"""Shared pytest fixtures."""

# Session fixture `slurm_cluster`: a real local SLURM cluster (tests/slurm_cluster.py, slurm/cluster.py);
# `cluster`: that cluster with its variables in os.environ, for tests driving the pipeline (tests/slurm_helpers.py).
try:
    from slurm_cluster import slurm_cluster  # noqa: F401  (tests/ on sys.path: rootdir "prepend" import)
    from slurm_helpers import cluster  # noqa: F401
except ImportError:  # tests/ as a package
    from .slurm_cluster import slurm_cluster  # noqa: F401
    from .slurm_helpers import cluster  # noqa: F401
