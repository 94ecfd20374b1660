"""Hyperparameter search: an Optuna study over a ``-m`` sweep, its controller, status and cancel (docs/search.md)."""
