"""pipeline/slurm"""
