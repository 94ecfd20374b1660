"""tests.slurm"""
