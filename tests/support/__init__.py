"""Helpers shared by the tests and the benchmarks (``from tests.support... import ...``).

- ``env``: the repository root, a subprocess environment with the checkout importable, one rank's environment.
- ``cli``: ``python -m pipeline`` as a subprocess, a run's directory and metrics, a run root seeded from another.
- ``engine_worker``: one rank of a tiny training run (model, optimizer, Trainer) and ``launch``/``serve`` for
  worker scripts; the other ``*_worker`` modules are such scripts (eval, generation, HF import, reward, RL).
- ``synthetic``: tiny in-memory sample sources; ``hf_models``: tiny random Hugging Face models.
- ``slurm_cluster``, ``slurm_helpers``: the session SLURM cluster fixture and helpers for tests driving it.
"""
