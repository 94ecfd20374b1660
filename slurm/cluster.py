#!/usr/bin/env python3
"""A real SLURM cluster on one machine, for tests and demos: the command line of slurm/localcluster/.

    python3 slurm/cluster.py up|down|status|env|kill-node NODE|start-node NODE [--dir DIR] [--nodes N] [--timeout S]

See slurm/README.md. Needs root. Standard library only.
"""

import sys

from localcluster.cli import main  # this script's directory is on sys.path

if __name__ == "__main__":
    sys.exit(main())
