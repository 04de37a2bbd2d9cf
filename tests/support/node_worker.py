"""One trainer process under ``torchrun``: its rank's batches through overlord's node mode.

Run by tests/test_node.py as ``python -m torch.distributed.run --standalone
--nproc_per_node N tests/node_worker.py PLAN OUT STEPS [STATE]``; writes the
rank's dump lines and its final state to OUT, read through
``overlord.streams.open_stream``. With ``OVERLORD_TEST_DATASET=1`` it reads
through ``OverlordIterableDataset.from_plan`` in a torch DataLoader instead,
and writes a digest of each batch's ``input_ids``; with
``OVERLORD_TEST_LOADER=1`` it reads through ``overlord.Loader``; with
``OVERLORD_TEST_MESH=1`` through ``overlord.Loader(plan).rank_client(RANK)``,
writing :func:`digest` of each batch; with ``OVERLORD_TEST_REPORT=1`` every rank
reports each step (rank 0 writes what its planner received).
``OVERLORD_TEST_RUNTIME=process`` runs the node's roles in a data process
instead (every path above). Ray is blocked: node mode must not need it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from importlib.abc import MetaPathFinder
from pathlib import Path


class _NoRay(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
        if name == "ray" or name.startswith("ray."):
            raise ImportError("Ray is blocked: node mode must work without it")
        return None


def digest(batch) -> list:  # type: ignore[no-untyped-def]
    """What identifies a mesh rank's batch: step, DP rank, CP fields, samples, every array."""
    arrays = {k: hashlib.sha256(a.tobytes()).hexdigest() + str(a.shape)
              for k, a in batch.arrays().items()}  # fmt: skip
    samples = [list(s) for s in batch.samples]
    return [batch.step, batch.rank, batch.cp_layout, batch.cp_rank, batch.cp_size, samples, arrays]


def mesh(plan_path: str, steps: int, rank: int, runtime: str) -> dict:
    """This process's mesh rank's batches through ``overlord.Loader`` (in node mode here)."""
    from overlord import Loader

    result: dict = {"lines": [], "error": None}
    with Loader(plan_path, runtime=runtime) as loader:
        result["kind"] = "node" if loader.node else "embedded"
        try:
            loader.client(rank)
        except ValueError as e:
            result["client_error"] = str(e)
        for batch in loader.rank_client(rank, stop_step=steps):
            result["lines"].append(digest(batch))
        result["state"] = loader.state_dict()
    return result


def main() -> None:
    """Import overlord only now, with Ray blocked."""
    import torch.distributed as dist

    from overlord import Loader, LoaderError
    from overlord.ops.run import dump_line
    from overlord.streams import open_stream

    plan_path, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    runtime: str | None = os.environ.get("OVERLORD_TEST_RUNTIME", "inline")
    runtime = None if runtime == "default" else runtime  # the runtime a user leaves unset
    state = json.loads(Path(sys.argv[4]).read_text()) if len(sys.argv) > 4 else None
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result: dict = {"lines": [], "error": None}
    if os.environ.get("OVERLORD_TEST_MESH"):
        result = mesh(plan_path, steps, rank, runtime)
        with open(f"{out}.{rank}", "w") as f:
            json.dump(result, f)
        dist.barrier()
        dist.destroy_process_group()
        return
    if os.environ.get("OVERLORD_TEST_DATASET"):
        import torch.utils.data

        from overlord.torch import OverlordIterableDataset

        ds = OverlordIterableDataset.from_plan(
            plan_path, state=state, stop_step=steps, runtime=runtime
        )
        for batch in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0):
            ids = batch["input_ids"].numpy().tobytes()
            result["lines"].append(hashlib.sha256(ids).hexdigest())
        result["state"] = ds.overlord_state()
        ds.close()
        with open(f"{out}.{rank}", "w") as f:
            json.dump(result, f)
        dist.barrier()
        dist.destroy_process_group()
        return
    loader = None
    if os.environ.get("OVERLORD_TEST_LOADER"):  # overlord.Loader, as a user would write it
        loader = Loader(plan_path, state=state, runtime=runtime)
        result["kind"] = "node" if loader.node else "embedded"
        client = loader.client(rank, stop_step=steps)
    else:  # the stream opener: a NodeClient here
        client = open_stream(
            plan_path, state=state, stop_step=steps, loader=Loader, runtime=runtime
        )
        result["kind"] = type(client).__name__
    try:
        result["start"] = client.state_dict()
        report = os.environ.get("OVERLORD_TEST_REPORT")
        for batch in client:
            result["lines"].append(dump_line(batch))
            if report:  # the rank's step time, and a loss for each source of its batch
                losses = {x.source: 1.0 + rank for x in batch.samples}
                client.report(batch.step, 0.01 * (rank + 1), losses)
        result["state"] = client.state_dict()
        if report and rank == 0:
            client._clients[0].flush()  # type: ignore[attr-defined]
            result["feedback"] = client.loader.stats()["feedback"]  # type: ignore[attr-defined]
        if loader is not None:
            import pyarrow as pa

            result["arrow_pool"] = pa.default_memory_pool().backend_name
            result["loader_state"] = loader.state_dict()
            if rank == 0 and runtime == "inline":
                result["records"] = sum(s["records"] for s in loader.stats()["loaders"])
    except LoaderError as e:
        result["error"] = str(e)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    (loader or client).close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.meta_path.insert(0, _NoRay())  # as a script only: pytest imports this module too
    main()
