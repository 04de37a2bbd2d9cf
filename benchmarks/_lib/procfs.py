"""What the processes of a benchmark run cost, read from ``/proc`` (Linux only).

Memory: ``rollup`` (PSS and USS of one process). CPU: ``stat`` (parent and CPU
seconds of one process), ``tree_cpu`` (a process and everything below it) and
``CpuMeter`` (every process of the run, sampled on a thread, so processes that
end before the last reading still count). Which processes make up a run:
``parents``, ``descendants`` and ``run_pids`` (below given roots, or in this
private network namespace under ``tools/loopback``); ``short_name`` and
``classify`` name them for reports.
"""

from __future__ import annotations

import os
import threading
import time

# Ray titles an actor's process by its class: these are overlord's roles
ACTOR_TITLES = ("ray::SourceLoader", "ray::RoleHost", "ray::Planner", "ray::DataConstructor")
# what ``classify`` sorts a run's processes into
CATEGORIES = ["trainers", "loader workers", "driver", "ray system", "actors"]


def rollup(pid: int) -> dict[str, int] | None:
    """PSS (and its anonymous, file and shmem parts) and USS of one process, in bytes."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            text = f.read()
    except OSError:
        return None
    vals: dict[str, int] = {}
    for line in text.splitlines()[1:]:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            vals[key] = int(parts[0]) * 1024
    if "Pss" not in vals:
        return None  # a kernel thread, or gone
    return {
        "pss": vals["Pss"],
        "anon": vals.get("Pss_Anon", 0),
        "file": vals.get("Pss_File", 0),
        "shmem": vals.get("Pss_Shmem", 0),
        "uss": vals.get("Private_Clean", 0) + vals.get("Private_Dirty", 0),
    }


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def stat(pid: int) -> tuple[int, float] | None:
    """Parent pid and user+system CPU seconds of one process; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        # the command name may hold spaces and parentheses: fields start after the last ")"
        fields = raw[raw.rindex(b")") + 2 :].split()
        return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):  # gone, or read while it exited
        return None


def stats() -> dict[int, tuple[int, float]]:
    """``stat`` of every live process."""
    out = {}
    for pid in _pids():
        st = stat(pid)
        if st is not None:
            out[pid] = st
    return out


def parents() -> dict[int, int]:
    """Parent of every process."""
    return {pid: ppid for pid, (ppid, _) in stats().items()}


def descendants(roots: set[int], ppid: dict[int, int]) -> set[int]:
    """``roots`` and every process below them."""
    kids: dict[int, list[int]] = {}
    for pid, parent in ppid.items():
        kids.setdefault(parent, []).append(pid)
    out, todo = set(), [r for r in roots if r in ppid]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo += kids.get(pid, [])
    return out


def below(pid: int) -> set[int]:
    """Every live process under ``pid`` (not ``pid`` itself)."""
    return descendants({pid}, parents()) - {pid}


def alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` that still run (gone and zombie ones left out)."""
    out = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        if raw[raw.rindex(b")") + 2 :].split()[0] != b"Z":
            out.add(pid)
    return out


def tree_cpu(root: int) -> float:
    """User+system CPU seconds of ``root`` and all its live descendants."""
    now = stats()
    below = descendants({root}, {pid: ppid for pid, (ppid, _) in now.items()})
    return sum(now[pid][1] for pid in below)


def netns(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def private_netns() -> str | None:
    """This process's network namespace when it is its own (tools/loopback), else None."""
    mine = netns("self")
    return mine if mine is not None and mine != netns(1) else None


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def short_name(pid: int) -> str:
    """A process's name for reports: ``ray::Class``, a binary's or a script's base name."""
    cmd = cmdline(pid).split()
    if not cmd:
        return "?"
    if cmd[0].startswith("ray::"):
        return cmd[0]
    if "--child" in cmd:
        return cmd[cmd.index("--child") + 1]  # this script's trainer or driver
    for arg in cmd[:3]:
        if arg.endswith(".py") or "/ray/" in arg:
            return os.path.basename(arg)
    return os.path.basename(cmd[0])


def run_pids(roots: set[int]) -> set[int]:
    """Every process of the current run: below ``roots``, or in this loopback namespace."""
    ppid = parents()
    found = descendants(roots, ppid)
    ns = private_netns()
    if ns is not None:
        found |= {p for p in ppid if netns(p) == ns}
    return found - {os.getpid()}


def leftovers() -> set[int]:
    """Processes of earlier runs still alive (below this process, or in its namespace)."""
    return {p for p in run_pids({os.getpid()}) if rollup(p) is not None}


def classify(pid: int, trainers: set[int], driver: int | None) -> str:
    """Which of ``CATEGORIES`` a process of a run is in (by pid, then by its title)."""
    if pid in trainers:
        return "trainers"
    if pid == driver:
        return "driver"
    title = cmdline(pid)
    if title.startswith(ACTOR_TITLES):
        return "actors"
    if driver is None:
        return "loader workers"  # the baseline's only other processes: DataLoader workers
    return "ray system"


class CpuMeter:
    """CPU seconds of every process of the run (this one and below it), sampled from /proc.

    A process that ends between samples loses at most one interval of its time.
    What processes alive at the start had spent before, and the meter's own
    sampling, are not counted.
    """

    def __init__(self, every: float = 0.25):
        self.seen: dict[int, float] = {}
        self.titles: dict[int, str] = {}
        self.every = every
        self.own = 0.0  # CPU seconds the meter itself spent sampling
        self._lock = threading.Lock()  # the sampling thread and total() both sample
        self._stop = threading.Event()
        self._sample()
        # what processes alive now (this one) had spent before: not the run's
        self.before, self.own = dict(self.seen), 0.0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        t0 = time.thread_time()
        with self._lock:
            self._sample_locked()
            # the meter's own CPU (it walks /proc) is no part of the run: taken off this process
            self.own += time.thread_time() - t0

    def _sample_locked(self) -> None:
        for pid in [*run_pids({os.getpid()}), os.getpid()]:
            st = stat(pid)
            if st is None:
                continue
            self.seen[pid] = max(self.seen.get(pid, 0.0), st[1])
            title = short_name(pid)  # Ray retitles a worker with the actor it runs
            if title not in ("?", "ray::IDLE"):
                self.titles[pid] = title.split(".")[0].split(":")[-1] if "::" in title else title

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.every)

    def settle(
        self, idle_cores: float = 0.25, window_s: float = 1.0, limit_s: float = 300
    ) -> float:
        """Wait until the run's processes together burn under ``idle_cores`` (its loaders are idle).

        Called when the trainer stops: a source that kept up with the trainer
        holds a full read-ahead, one that starved it holds none. Letting every
        loader fill its read-ahead before the last reading charges each run the
        same: the tokens it delivered, plus a full read-ahead.
        """
        t0 = time.monotonic()
        before = self.total()
        while time.monotonic() < t0 + limit_s:
            time.sleep(window_s)
            now = self.total()
            if now - before < idle_cores * window_s:
                break
            before = now
        return time.monotonic() - t0

    def total(self) -> float:
        """CPU seconds so far."""
        self._sample()
        with self._lock:
            return sum(self.seen.values()) - sum(self.before.values()) - self.own

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.total()

    def by_title(self) -> dict[str, float]:
        """CPU seconds per kind of process (``ray::SourceLoader``, ``raylet``, ...)."""
        out: dict[str, float] = {}
        for pid, cpu in self.seen.items():
            name = self.titles.get(pid, "?")
            cpu -= self.before.get(pid, 0.0) + (self.own if pid == os.getpid() else 0.0)
            out[name] = out.get(name, 0.0) + cpu
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))
