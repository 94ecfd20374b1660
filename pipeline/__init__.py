"""The pipeline's layers, top down: cli > submit > reporting > (stages, engine) > schema > records | slurm."""
