"""The planner's journal: differential checkpoints that let a killed planner resume exactly.

The planner's state is small (a cursor and a mixture account per source), and
a step changes little of it. The journal holds a full *snapshot* every
``snapshot_every`` steps and, between snapshots, one *delta* per planned step
(the cursors that moved and the tokens each source placed), written before
the step's plan is handed out; and a record each time the step that every
rank consumed advances, written before the loaders release its items. The
trainers' reports add records of their own (``fit``, ``mix``, ``rep``:
:mod:`overlord.roles.feedback`); a reader skips the kinds it does not know.
An addition to a live job's quarantine (:mod:`overlord.roles.quarantine`)
is a record of its own (``"t": "quar"``); a resume holds every addition the
journal recorded, whichever segment it starts from (each applies from its
own step).

Each snapshot starts a new segment file ``seg-<step>.log``. A record is one
line: its digest, a space, its JSON text. The first line of a segment is a
header record, ``{"t": "head", "journal": 2, "start": <step>}``: the format
version, and the step in the file's name. Each record's digest is a link of a
chain: the first 32 hex digits of the sha256 of the previous record's digest
and this record's text (the header's previous digest is a fixed seed). So a
record's digest covers the format version, the segment's start and every
record before it: an edited record fails, and so does a record deleted,
reordered, repeated or moved from another segment. A CRC-32 would catch a
torn write too, but it is linear: an edit whose CRC is fixed up (by hand, or
by a tool that "repairs" files) passes it. 128 bits of sha256 make an
accidental match impossible. Like a checkpoint's digest, the chain carries no
key: it catches damage and edits, not a writer who recomputes every digest
after the one it edits (the journal's folder is the job's alone to write).

Reading takes the records up to a torn last record (no final newline: the
writer died in the middle of it), reports it, and resumes before it. Any
other record that fails (its digest, its JSON, a header of an unknown
version) refuses the journal with a :class:`JournalError` naming the file,
the record, its byte offset and the field: a damaged journal is never
resumed. Segments written before the header and the chain (a CRC-32 of each
line's text, 8 hex digits, format 1) still read, and a planner that resumes
one appends records of that format to it until its next snapshot, which
starts a segment of format 2. Nothing here is pickled; a journal that cannot
be written (a full disk) raises a :class:`JournalError` naming the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from overlord.errors import CheckpointError, LoaderError
from overlord.state import format as statefmt

_SEGMENT = re.compile(r"^seg-(\d{10})\.log$")


class JournalError(CheckpointError):
    """A journal record is torn or corrupt; says which file, record and byte."""


VERSION = 2  # the header and the chained digests; 1: a CRC-32 per line, no header
SEED = "overlord-journal"  # the header's previous digest: the chain starts here
_DIGEST_HEX = 32  # 128 bits of sha256
_CRC_HEX = 8  # format 1


def link(previous: str, text: bytes) -> str:
    """The digest of a record of ``text`` that follows a record of digest ``previous``.

    >>> link(SEED, b'{"t":"cons","s":3}') == link(SEED, b'{"t":"cons","s":4}')
    False
    """
    return hashlib.sha256(previous.encode() + b" " + text).hexdigest()[:_DIGEST_HEX]


def encode(record: dict[str, Any], previous: str | None = None) -> bytes:
    """One journal line: its digest (chained to ``previous``), a space, the JSON text, a newline.

    Without ``previous``, a line of format 1 (the CRC-32 of the text), as journals
    written before the chain held and as :meth:`Journal.continue_after` appends to them.

    >>> encode({"t": "cons", "s": 3}).decode().strip()
    '0c4cea20 {"t":"cons","s":3}'
    >>> len(encode({"t": "cons", "s": 3}, SEED).split()[0])
    32
    """
    text = json.dumps(record, separators=(",", ":"))
    if previous is None:
        return f"{zlib.crc32(text.encode()):08x} {text}\n".encode()
    return f"{link(previous, text.encode())} {text}\n".encode()


def header(start: int) -> dict[str, Any]:
    """The first record of a segment whose snapshot is the state before step ``start``."""
    return {"t": "head", "journal": VERSION, "start": start}


def decode(line: bytes, where: str, previous: str | None = None) -> dict[str, Any]:
    """The record of one line; :class:`JournalError` if it is torn or corrupt.

    ``previous`` is the digest of the record before it (format 2); None reads
    a line of format 1, checked by its CRC-32.
    """
    if not line.endswith(b"\n"):
        raise JournalError(f"{where}: torn record (no end of line): the writer stopped in it")
    found, _, text = line[:-1].partition(b" ")
    if previous is None:
        try:
            ok = len(found) == _CRC_HEX and int(found, 16) == zlib.crc32(text)
        except ValueError:
            ok = False
        if not ok:
            raise JournalError(
                f"{where}: field 'crc32': checksum mismatch (expected {zlib.crc32(text):08x}, "
                f"found {found[:_DIGEST_HEX].decode(errors='replace')!r}): the record is corrupt"
            )
    else:
        want = link(previous, text)
        if found != want.encode():
            raise JournalError(
                f"{where}: field 'digest': expected {want}, found "
                f"{found[:_DIGEST_HEX].decode(errors='replace')!r}: the record was changed, "
                "damaged, or moved from another place after it was written; the journal is "
                "refused (resume the job from a checkpoint)"
            )
    try:
        record = json.loads(text)
    except ValueError as e:
        raise JournalError(f"{where}: not JSON ({e})") from None
    if not isinstance(record, dict) or "t" not in record:
        raise JournalError(f"{where}: field 't': missing, not a journal record")
    return record


@dataclass
class Recovered:
    """What one segment of a journal holds: its snapshot and the valid records after it."""

    snapshot: dict[str, Any]  # the planner state before step ``snapshot["step"]``
    deltas: list[dict[str, Any]] = field(default_factory=list)  # one per step, in order
    consumed: int = -1  # the last step every rank consumed
    loaders: dict[str, Any] | None = None  # the latest replica sets
    problems: list[str] = field(default_factory=list)  # torn or corrupt records skipped
    segment: Path | None = None  # the segment read
    end: int = 0  # where its valid records end (bytes)
    chain: str | None = None  # the digest of its last valid record (None: format 1)
    quarantine: list[dict[str, Any]] = field(default_factory=list)  # additions recorded


def read_segment(path: Path, strict: bool = True) -> tuple[list[dict[str, Any]], int, str | None]:
    """Valid records of one segment, the byte offset where they end, and the problem found.

    The header (format 2) is checked and left out. A torn last record raises
    :class:`JournalError` with ``strict``; otherwise reading stops there and the
    problem is returned. Any other bad record raises, ``strict`` or not.
    """
    records, end, problem, _ = _read(path, strict)
    return records, end, problem


def _read(path: Path, strict: bool) -> tuple[list[dict[str, Any]], int, str | None, str | None]:
    """:func:`read_segment`, and the digest of the last valid record (None: format 1)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise JournalError(f"cannot read journal {path}: {e.strerror or e}") from None
    records: list[dict[str, Any]] = []
    # format 1 began with the snapshot's CRC-32, 8 hex digits; format 2 with a header
    chain: str | None = None if data[: _CRC_HEX + 1].endswith(b" ") else SEED
    offset, index = 0, 0
    while offset < len(data):
        end = data.find(b"\n", offset)
        line = data[offset:] if end < 0 else data[offset : end + 1]
        where = f"journal {path}, record {index} at byte {offset}"
        try:
            record = decode(line, where, chain)
        except JournalError as e:
            if strict or end >= 0:  # a whole line that fails was damaged, not torn
                raise
            return records, offset, str(e), chain
        if chain is not None:
            chain = line[:_DIGEST_HEX].decode()
        if index == 0 and chain is not None:
            _check_header(record, path, where)
        else:
            records.append(record)
        offset += len(line)
        index += 1
    return records, offset, None, chain


def _check_header(record: dict[str, Any], path: Path, where: str) -> None:
    if record.get("t") != "head":
        raise JournalError(f"{where}: field 't': expected the header 'head', found {record['t']!r}")
    if record.get("journal") != VERSION:
        raise JournalError(
            f"{where}: field 'journal': format version {record.get('journal')!r} is not "
            f"supported: expected {VERSION} (or 1, without a header)"
        )
    if _SEGMENT.match(path.name) and record.get("start") != start_of(path):
        raise JournalError(
            f"{where}: field 'start': expected {start_of(path)} (the step in the file's name), "
            f"found {record.get('start')!r}: the segment was renamed or copied from elsewhere"
        )


def start_of(segment: Path) -> int:
    """The step a segment's snapshot is the state before."""
    return int(segment.name[4:-4])


def segments(directory: Path) -> list[Path]:
    """The journal's segment files, oldest first."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _SEGMENT.match(p.name))


def recover(directory: str | Path, only: list[Path] | None = None) -> list[Recovered]:
    """Read a journal back: every segment with an intact snapshot, oldest first.

    ``only``: these segments of it alone (a replay reads the one it needs).

    A torn last record ends its segment; the problem is in that segment's
    ``problems`` (and a segment whose snapshot is torn is left out, with its
    problem given to the next one). Any other bad record raises
    :class:`JournalError`.
    """
    out: list[Recovered] = []
    problems: list[str] = []
    for seg in segments(Path(directory)) if only is None else only:
        records, end, problem, chain = _read(seg, strict=False)
        if not records or records[0]["t"] != "snap":
            problems.append(problem or f"journal {seg}: does not start with a snapshot")
            continue
        r = Recovered(records[0]["state"], problems=problems, segment=seg, end=end, chain=chain)
        problems = []
        r.consumed = int(records[0].get("consumed", -1))
        r.loaders = records[0].get("loaders")
        for rec in records[1:]:
            if rec["t"] == "plan":
                expected = r.snapshot["step"] + len(r.deltas)
                if rec["s"] != expected:
                    r.problems.append(
                        f"journal {seg}: delta of step {rec['s']} where step {expected} was due"
                    )
                    break
                r.deltas.append(rec["d"])
            elif rec["t"] == "cons":
                r.consumed = max(r.consumed, int(rec["s"]))
            elif rec["t"] == "ldr":
                r.loaders = rec["loaders"]
            elif rec["t"] == "quar":
                r.quarantine.append(rec["e"])
        if problem:
            r.problems.append(problem + "; the records before it are used")
        out.append(r)
    if problems and not out:
        raise JournalError("the journal has no intact snapshot: " + "; ".join(problems))
    if problems:
        out[-1].problems += problems
    return out


@dataclass
class Resume:
    """Where a restarted planner resumes, from its journal."""

    state: dict[str, Any]  # the state before ``step``, the one after the last every rank consumed
    step: int
    loaders: dict[str, Any] | None  # the latest loader layout recorded
    replan: dict[int, dict[str, Any]]  # the deltas of the steps it will plan again, to check
    problems: list[str]  # torn or corrupt records that were skipped
    last: Recovered  # the segment to go on writing

    def event(self) -> dict[str, Any]:
        """The restart, as the run summary lists it."""
        return {
            "event": "planner-recovered",
            "step": self.step,
            "replanned": len(self.replan),
            "problems": self.problems,
        }


def resume(directory: str | Path, weights: statefmt.Weights) -> Resume | None:
    """The point a planner restarted on this journal resumes at (None: an empty journal).

    Raises :class:`LoaderError` if the journal cannot restore the state after
    the last step every rank consumed.
    """
    segments = recover(directory)
    if not segments:
        return None
    consumed = max(r.consumed for r in segments)
    want = consumed + 1
    states, deltas = statefmt.replay([(r.snapshot, r.deltas) for r in segments], weights)
    problems = [p for r in segments for p in r.problems]
    if want not in states:
        raise LoaderError(
            f"the planner's journal in {directory} cannot restore step {want} (every rank "
            f"consumed step {consumed}); it holds steps {min(states)}..{max(states)}"
            + (f". Problems: {'; '.join(problems)}" if problems else "")
        )
    replan = {s: d for s, d in deltas.items() if s >= want}
    state = states[want]
    added = [e for r in segments for e in r.quarantine]
    if added:  # a state holds every addition: each applies from its own step
        held = list(state.get("quarantine", []))
        state = {**state, "quarantine": held + [e for e in added if e not in held]}
    return Resume(state, want, segments[-1].loaders, replan, problems, segments[-1])


class Journal:
    """Appends the planner's records; starts a segment at every snapshot.

    ``keep``: keep every segment, not only those a restarted planner may need, so
    that any step planned can be rebuilt later (``overlord replay``); a trainers'
    rewind still starts the journal over from the state rewound to.
    """

    def __init__(self, directory: str | Path, fsync: bool = False, keep: bool = False):
        self.directory = Path(directory)
        self.keep = keep
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise JournalError(f"cannot write the planner's journal in {directory}: {e}") from None
        self.fsync = fsync
        self._file: Any = None
        self._path: Path | None = None  # the segment written to
        self._chain: str | None = SEED  # the digest of the last record written (None: format 1)
        self.bytes: dict[str, int] = {"head": 0, "snap": 0, "plan": 0, "cons": 0, "ldr": 0}
        self.records: dict[str, int] = {"head": 0, "snap": 0, "plan": 0, "cons": 0, "ldr": 0}
        self.write_s = 0.0
        self._starts = [start_of(p) for p in segments(self.directory)]  # first step of each
        self._replan: dict[int, dict[str, Any]] = {}  # deltas a restarted planner re-plans

    def resume(self, weights: statefmt.Weights) -> Resume | None:
        """Where a planner restarted on this journal resumes; appends after it from now on.

        The steps after that point are planned again: :meth:`planned` checks
        them against what the journal holds instead of writing them twice.
        """
        found = resume(self.directory, weights)
        if found is not None:
            self.continue_after(found.last)
            self._replan = dict(found.replan)
        return found

    def planned(self, step: int, before: dict[str, Any], after: dict[str, Any]) -> bool:
        """Record what planning ``step`` changed; False if it was a re-plan (checked, not kept).

        Raises :class:`LoaderError` if a re-planned step differs from the journal's.
        """
        change = statefmt.delta(before, after)
        if step in self._replan:
            held = self._replan.pop(step)
            if change != held:
                same_data = {k: v for k, v in change.items() if k != "f"} == {
                    k: v for k, v in held.items() if k != "f"
                }  # only the feedback differs (overlord.roles.feedback): not the data
                raise LoaderError(
                    f"re-planning step {step} after a planner restart gave another plan than "
                    "the journal holds: "
                    + (
                        "the refit or mixture adaptation recorded for it was not applied"
                        if same_data
                        else "a source's data changed while the job ran"
                    )
                )
            return False
        self.delta(step, change)
        return True

    def continue_after(self, recovered: Recovered) -> None:
        """Append to the recovered segment, cutting off its torn or corrupt end first."""
        seg = recovered.segment
        assert seg is not None
        for later in segments(self.directory):
            if later.name > seg.name:  # its snapshot was unreadable
                later.unlink()
                self._starts.remove(start_of(later))
        self._path, self._chain = seg, recovered.chain  # a segment of format 1 goes on in it
        with self._writing():
            with open(seg, "r+b") as f:
                f.truncate(recovered.end)
            self._file = open(seg, "ab")  # noqa: SIM115 (kept open: one write per step)

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """An OSError (a full disk, a folder removed) as a :class:`JournalError` naming the file."""
        try:
            yield
        except OSError as e:
            raise JournalError(
                f"cannot write the planner's journal {self._path or self.directory}: "
                f"{e.strerror or e} (recovery.journal_dir sets its folder)"
            ) from None

    def _write(self, record: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        line = encode(record, self._chain)
        with self._writing():
            self._file.write(line)
            self._file.flush()
            if self.fsync:
                os.fsync(self._file.fileno())
        if self._chain is not None:
            self._chain = line[:_DIGEST_HEX].decode()
        self.write_s += time.perf_counter() - t0
        t = record["t"]  # a kind of record added later counts from its first
        self.bytes[t] = self.bytes.get(t, 0) + len(line)
        self.records[t] = self.records.get(t, 0) + 1

    def snapshot(self, state: dict[str, Any], consumed: int, loaders: dict[str, Any]) -> None:
        """Start a segment with the full state before step ``state["step"]``."""
        step = int(state["step"])
        path = self.directory / f"seg-{step:010d}.log"
        tmp = path.with_suffix(".tmp")
        with self._writing():
            if self._file is not None:
                self._file.close()
                self._file = None
            self._path = tmp
            tmp.write_bytes(b"")
            self._file = open(tmp, "ab")  # noqa: SIM115
        self._chain = SEED
        self._write(header(step))
        self._write({"t": "snap", "state": state, "consumed": consumed, "loaders": loaders})
        with self._writing():
            os.replace(tmp, path)  # a segment exists only once its snapshot is whole
        self._path = path
        self._starts.append(step)

    def restart(self, state: dict[str, Any], consumed: int, loaders: dict[str, Any]) -> None:
        """The job went back to ``state`` (trainers rewound it): this segment alone from now on."""
        step = int(state["step"])
        self._replan.clear()
        self.snapshot(state, consumed, loaders)
        for s in [s for s in self._starts if s != step]:
            (self.directory / f"seg-{s:010d}.log").unlink(missing_ok=True)
        self._starts = [step]

    def delta(self, step: int, delta: dict[str, Any]) -> None:
        """What planning step ``step`` changed."""
        self._write({"t": "plan", "s": step, "d": delta})

    def consumed(self, step: int) -> None:
        """Every rank consumed up to ``step``; drop segments no recovery can start from."""
        self._write({"t": "cons", "s": step})
        if self.keep:  # a journal kept for replays: every segment stays
            return
        # a recovery starts from the state before step+1: keep the newest segment
        # that starts at or before it, and those after
        usable = [s for s in self._starts if s <= step + 1]
        for s in [s for s in self._starts if usable and s < usable[-1]]:
            (self.directory / f"seg-{s:010d}.log").unlink(missing_ok=True)
            self._starts.remove(s)

    def loaders(self, loaders: dict[str, Any]) -> None:
        """The replica sets, partitions or autoscaler state changed (failover, scaling)."""
        self._write({"t": "ldr", "loaders": loaders})

    def quarantined(self, entry: dict[str, Any]) -> None:
        """An addition to the quarantine (``{"ids", "files", "from_step"}``), made live."""
        self._write({"t": "quar", "e": entry})

    def stats(self) -> dict[str, Any]:
        """Bytes and records written, per kind, and the time spent writing."""
        return {"bytes": dict(self.bytes), "records": dict(self.records), "write_s": self.write_s}

    def close(self) -> None:
        """Close the file (the job's owner removes the folder)."""
        if self._file is not None:
            with contextlib.suppress(OSError):  # a full disk was named when it was written to
                self._file.close()
            self._file = None
