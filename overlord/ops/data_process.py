"""The node's data process: ``python -m overlord.ops.data_process FD PARENT_PID``.

Started by :class:`overlord.dist.data_process.DataProcess`, never by hand.
``FD`` is its end of a control connection to the process that started it;
the first message there is its configuration (JSON: the plan, its folder,
the state to start from, where to listen and the key ranks connect with).
It runs the plan's roles (an embedded Loader, its allocators those of a
loader process), answers ``{"ready": state}`` (or ``{"error": ...}``) and
serves every rank (:class:`overlord.dist.data_server.DataServer`), and answers
its starter's questions of the Loader (``{"ask": name, "args": [...], "reports":
{rank: count}}``: one of :data:`ASKS`, answered ``{"answer": ...}`` in JSON or
``{"error": ...}`` once the planner has the reports its streams sent) until its
starter asks it to close (``{"close": true}``: it waits for every rank to
close its stream, at most ``loading.timeout_s``), or is gone (the control
connection ends, or its parent's pid changes): then every rank still
reading receives an error naming the starter's rank, and the process exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from multiprocessing.connection import Connection, Listener
from typing import Any

from overlord.batch import Batch
from overlord.dist.data_server import DataServer, describe, encode, steps_ahead
from overlord.loader import Loader
from overlord.plan.spec import validate_plan
from overlord.runtime.hosting import lean_allocators

WATCH_S = 0.2  # how often the parent is looked for
# what the starter may ask of the Loader here: its figures, and what steers its roles
ASKS = frozenset(
    {"stats", "monitor", "feedback", "quarantine", "metrics_url", "repartition", "set_threads"}
)


def _start(config: dict[str, Any]) -> tuple[Loader, DataServer]:
    plan = validate_plan(config["plan"], base_dir=config["base_dir"])
    # the server's thread builds ahead of the ranks itself: the roles work on that thread
    loader = Loader(
        plan, runtime="inline", state=config["state"], node=False, build_ahead=False,
        journal_dir=config.get("journal_dir"),
    )  # fmt: skip
    try:
        world = plan.world
        # a DP rank's batch is built once, its views cut once for all its peers
        serve = loader.client if world.peers == 1 else loader.rank_client
        clients = [serve(r) for r in range(world.size)]
        streams: list[Iterator[Batch]] = list(clients)
        start = loader.state_dict()
        listener = Listener(config["address"], "AF_UNIX", authkey=bytes.fromhex(config["authkey"]))
        # the state after a step is the same for every rank: rank 0's stream's
        first = clients[0]
        ahead = steps_ahead(plan.batch.prefetch_steps)
        server = DataServer(
            streams, first.state_dict, start, listener, ahead, plan.loading.timeout_s,
            node=bool(config["node"]),
        )  # fmt: skip
    except BaseException:
        loader.close()
        raise
    return loader, server


def answer(loader: Loader, name: str, args: list[Any]) -> dict[str, Any]:
    """The reply to the starter's question ``name(*args)`` of the Loader: its answer or error."""
    try:
        if name not in ASKS:
            raise ValueError(f"the data process answers {sorted(ASKS)}, not {name!r}")
        got = getattr(loader, name)
        reply = {"answer": got(*args) if callable(got) else got}
        encode(reply)  # an answer that is not JSON is an error here, not a dead process
        return reply
    except Exception as e:  # raised again in the starter, with its type
        return {"error": describe(e)}


def main(argv: list[str]) -> int:
    """Serve until the starter closes or is gone; 0 on an orderly close."""
    control = Connection(int(argv[1]))
    parent = int(argv[2])
    config = json.loads(control.recv_bytes())
    lean_allocators()  # this process hosts every loader of the node, as a Ray loader process
    try:
        loader, server = _start(config)
    except Exception as e:
        control.send_bytes(encode({"error": describe(e)}))
        return 1
    server.start()
    control.send_bytes(encode({"ready": server.start_state}))
    owner = config.get("owner", 0)
    code = 0
    try:
        while True:
            if os.getppid() != parent:
                raise EOFError("the parent's pid changed")
            if not control.poll(WATCH_S):
                continue
            message = json.loads(control.recv_bytes())
            if message.get("close"):
                server.wait_for_byes(server.timeout_s)
                break
            sent = {int(r): int(n) for r, n in message.get("reports", {}).items()}
            server.wait_for_reports(sent, server.timeout_s)  # what the trainers sent before
            reply = answer(loader, message["ask"], message.get("args", []))
            control.send_bytes(encode({**reply, "id": message.get("id")}))
    except (EOFError, OSError):
        code = 1
        server.fail(
            f"rank {owner} of the node is gone: the process that started overlord's data "
            "process (and served from it) died, so every rank stops"
        )
    finally:
        server.close()
        try:
            loader.close()
        finally:
            with contextlib.suppress(OSError):
                control.send_bytes(encode({"closed": True}))
    return code


if __name__ == "__main__":
    sys.stdout.flush()
    # a role's thread still waiting would hold the interpreter up: every slot is unlinked
    # and every rank told by now, so the process ends here
    os._exit(main(sys.argv))
