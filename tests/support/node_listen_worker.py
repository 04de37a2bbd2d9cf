"""Where node mode's gloo group listens, for tests/test_node.py: one process of two.

``python tests/support/node_listen_worker.py OUT`` with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set: it makes the
trainer's default gloo group, then node mode's group
(:func:`overlord.dist.channel.node_group`), and writes to ``OUT.RANK`` the
local addresses of the listening TCP sockets this process opened for each:
``{"trainer": [...], "node": [...]}``.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
from pathlib import Path


def _listening() -> set[str]:
    """``address:port`` of every listening TCP socket this process holds (IPv4 and IPv6)."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in mine:  # 0A: LISTEN
                continue
            hex_addr, hex_port = local.split(":")
            raw = bytes.fromhex(hex_addr)
            # /proc writes each 32-bit word of the address in host (little-endian) order
            words = b"".join(struct.pack(">I", w) for w in struct.unpack(f"<{len(raw) // 4}I", raw))
            found.add(f"{socket.inet_ntop(family, words)}:{int(hex_port, 16)}")
    return found


def main() -> None:
    """The trainer's group, then node mode's: what each made listen."""
    import torch.distributed as dist

    from overlord.dist.channel import node_group

    out = sys.argv[1]
    before = _listening()
    dist.init_process_group("gloo")
    trainer = _listening() - before
    node_group(30)
    node = _listening() - before - trainer
    rank = dist.get_rank()
    Path(f"{out}.{rank}").write_text(json.dumps({"trainer": sorted(trainer), "node": sorted(node)}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
