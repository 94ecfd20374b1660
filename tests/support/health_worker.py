"""One rank of a gloo world that runs the node health check (engine/runtime/health.py) and prints rank 0's report.

``python -m tests.support.health_worker HOST GO_FILE CONFIG_JSON`` with RANK/WORLD_SIZE/MASTER_* set: joins
the world, prints ``ready``, waits for GO_FILE (so a test can slow this process from outside first), runs the
check reporting HOST as its node, and on rank 0 prints the report as one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from tests.support.timing import scaled


def main() -> None:
    host, go, cfg_json = sys.argv[1:4]
    import torch
    import torch.distributed as dist

    from engine.runtime.health import node_check
    from pipeline.schema.sections import HealthConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    print("ready", flush=True)
    deadline = time.monotonic() + scaled(120)
    while not Path(go).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    report = node_check(HealthConfig(**json.loads(cfg_json)), host=host)
    if report is not None:
        print(json.dumps(report.as_record()), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
