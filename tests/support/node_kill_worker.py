"""One trainer process of node mode started by hand (no torchrun agent), for tests/test_node.py.

``python tests/support/node_kill_worker.py PLAN OUT`` with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set by the test, as a
cluster scheduler would: it iterates its rank's batches through
``overlord.Loader`` (no stop step), writing the step it reached to
``OUT.RANK.step`` as it goes, until the stream fails; then it writes
``{"error": ..., "at": time.time()}`` to ``OUT.RANK`` and exits 1. With
``OVERLORD_TEST_RAISE`` set it raises an uncaught ``RuntimeError`` at step 3
instead (a trainer's bug), after writing the time to ``OUT.RANK.raised``.
``OVERLORD_TEST_RUNTIME=process``: the node's roles run in a data process.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    """Iterate until the node's stream fails; report how and when."""
    import torch.distributed as dist

    from overlord import Loader, LoaderError

    plan_path, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    progress = Path(f"{out}.{rank}.step")
    try:
        runtime = os.environ.get("OVERLORD_TEST_RUNTIME", "inline")
        with Loader(plan_path, runtime=runtime) as loader:
            for batch in loader.client(rank):
                progress.write_text(str(batch.step))
                if batch.step == 3 and os.environ.get("OVERLORD_TEST_RAISE"):
                    Path(f"{out}.{rank}.raised").write_text(str(time.time()))
                    raise RuntimeError("a trainer's bug at step 3")
                time.sleep(0.02)  # a trainer's step: the others run ahead of no one
    except LoaderError as e:
        Path(f"{out}.{rank}").write_text(json.dumps({"error": str(e), "at": time.time()}))
        sys.exit(1)


if __name__ == "__main__":
    main()
