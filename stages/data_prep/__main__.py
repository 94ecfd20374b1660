"""One rank of ``mpiexec -n dp python -m stages.data_prep <work dir>`` (started by ``world.run_under_mpiexec``)."""

import sys
from pathlib import Path

from stages.data_prep import main
from stages.data_prep.world import mpi_rank_main

if __name__ == "__main__":
    mpi_rank_main(Path(sys.argv[1]), main)
