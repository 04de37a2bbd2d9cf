"""Opening a source's files, local or on an object store, with transient errors retried.

A URL (``s3://``, ``gs://``, any fsspec protocol) is opened through fsspec with
the source's ``storage_options`` (endpoint, credentials, anonymous); without
them, credentials come from the standard environment (for S3: ``AWS_*``
variables, ``~/.aws``). fsspec reads a remote file by ranges (its default
read-ahead block cache), so a file is never downloaded whole.

A transient error (throttling, a 5xx, a reset connection: what s3fs raises as
``OSError``, or botocore's and aiohttp's own errors) is retried with
exponential backoff, up to ``loading.retries`` times per call. Every read goes
through :class:`RetryingFile`, which keeps its own position: a retry reopens
the file and seeks back to where the failed read started, so a retried read
gives exactly the bytes the first try would have, nothing lost or repeated,
whatever reads the file (a block of a plain JSONL file, a Parquet row group, a
compressed stream, a tar). The last error raises :class:`SourceError` naming
the URL. Local paths are read directly: a local disk error is not transient.

Before a job lists its files, every endpoint its sources name (an ``endpoint_url`` in
their ``storage_options``, an ``http(s)://`` URL's host) is tried once with a TCP
connection, all at once and within ``loading.timeout_s``
(:func:`unreachable_endpoints`): an endpoint that cannot be reached is named with every
source that uses it, instead of each source's listing failing in turn after its
retries and the client library's own.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import urlsplit

import fsspec

from overlord.errors import SourceError

BACKOFF_S = 0.05  # wait before the first retry; doubled at each next one
BACKOFF_MAX_S = 5.0
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
T = TypeVar("T")


def is_url(path: str) -> bool:
    """Whether ``path`` is an fsspec URL rather than a local path."""
    return "://" in path


def transient(e: BaseException) -> bool:
    """Whether an error may go away if the call is made again."""
    if isinstance(e, _PERMANENT):
        return False
    if isinstance(e, (OSError, TimeoutError)):
        return True
    module = type(e).__module__ or ""
    return module.split(".")[0] in ("botocore", "aiohttp", "urllib3", "requests")


class Retries:
    """How often a call is retried, and a thread-safe count of the retries made."""

    def __init__(self, attempts: int = 5, backoff_s: float = BACKOFF_S):
        self.attempts = attempts  # retries after the first try
        self.backoff_s = backoff_s
        self._count = 0
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        """Retries made so far."""
        return self._count

    def call(
        self, source: str, url: str, what: str, fn: Callable[[], T], reset: Callable[[], None]
    ) -> T:
        """``fn()``, retried after ``reset()`` on a transient error; else SourceError."""
        for attempt in range(self.attempts + 1):
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - sorted by transient()
                if not transient(e):
                    raise
                if attempt == self.attempts:
                    raise SourceError(
                        source,
                        url,
                        None,
                        f"{what} failed after {self.attempts} retries ({type(e).__name__}: {e})",
                    ) from e
                with self._lock:
                    self._count += 1
                reset()
                time.sleep(min(BACKOFF_MAX_S, self.backoff_s * 2**attempt))
        raise AssertionError("unreachable")


class RetryingFile(io.RawIOBase):
    """A remote file read by position, each open and read retried (see the module)."""

    def __init__(self, source: str, url: str, storage_options: Mapping[str, Any], retries: Retries):
        super().__init__()
        self.source, self.url, self.retries = source, url, retries
        self._fs, self._path = fsspec.core.url_to_fs(url, **dict(storage_options))
        self._f: Any = None
        self._pos = 0
        self._size: int | None = None

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        return self.retries.call(self.source, self.url, what, fn, self._drop)

    def _drop(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            with contextlib.suppress(Exception):  # a broken connection: dropped anyway
                f.close()

    def size(self) -> int:
        """The file's size in bytes."""
        if self._size is None:
            self._size = int(self._call("size", lambda: self._fs.size(self._path)))
        return self._size

    def _read(self, n: int) -> bytes:
        if self._f is None:
            self._f = self._fs.open(self._path, "rb")
        if self._f.tell() != self._pos:
            self._f.seek(self._pos)
        return bytes(self._f.read(n))

    def read(self, n: int | None = -1) -> bytes:
        """Up to ``n`` bytes (all the rest if negative) from the position."""
        want = -1 if n is None else n
        data = self._call(f"reading at byte {self._pos}", lambda: self._read(want))
        self._pos += len(data)
        return data

    def readall(self) -> bytes:
        """The rest of the file."""
        return self.read(-1)

    def readinto(self, b: Any) -> int:
        """Read into ``b``; the bytes read."""
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def readable(self) -> bool:
        """True."""
        return True

    def seekable(self) -> bool:
        """True: a read at any position is a range request."""
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        """Move to ``offset`` (from the start, the position or the end)."""
        if whence == 0:
            self._pos = offset
        elif whence == 1:
            self._pos += offset
        else:
            self._pos = self.size() + offset
        return self._pos

    def tell(self) -> int:
        """The position."""
        return self._pos

    def close(self) -> None:
        """Close the connection."""
        self._drop()
        super().close()


def open_file(
    source: str,
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    retries: Retries | None = None,
) -> Any:
    """A file opened for reading in binary: a :class:`RetryingFile` for a URL."""
    if not is_url(url):
        return fsspec.open(url, "rb").open()
    return RetryingFile(source, url, storage_options or {}, retries or Retries())


def file_size(f: Any, url: str) -> int:
    """The size of file ``url``, which :func:`open_file` opened as ``f``."""
    return f.size() if isinstance(f, RetryingFile) else os.path.getsize(url)


def endpoint_of(url: str, storage_options: Mapping[str, Any] | None) -> str | None:
    """Where a URL's requests go, when the plan says: its ``endpoint_url``, an http(s) host.

    None for a local path, or for a store whose client finds its endpoint itself (S3 by its
    region, GCS): those are not tried ahead.
    """
    if not is_url(url):
        return None
    options = dict(storage_options or {})
    client = options.get("client_kwargs")
    found = options.get("endpoint_url") or (
        client.get("endpoint_url") if isinstance(client, Mapping) else None
    )
    if isinstance(found, str) and found:
        return found
    if url.startswith(("http://", "https://")):
        parts = urlsplit(url)
        return f"{parts.scheme}://{parts.netloc}"
    return None


def _connect(endpoint: str, timeout_s: float) -> str | None:
    """Why no TCP connection to ``endpoint`` opens within ``timeout_s``; None if one does."""
    parts = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
    try:
        port = parts.port or (80 if parts.scheme == "http" else 443)
    except ValueError as e:
        return f"its port is not a number ({e})"
    if not parts.hostname:
        return "it names no host"
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout_s):
            return None
    except TimeoutError:
        return f"no answer within loading.timeout_s ({timeout_s:g} s)"
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"


def unreachable_endpoints(endpoints: Iterable[str], timeout_s: float) -> dict[str, str]:
    """The endpoints that cannot be reached, each with why; tried at once, within ``timeout_s``."""
    todo = sorted(set(endpoints))
    if not todo:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(todo))) as pool:
        why = list(pool.map(lambda e: _connect(e, timeout_s), todo))
    return {e: w for e, w in zip(todo, why) if w is not None}


def endpoint_problems(
    sources: Iterable[tuple[str, list[str], Mapping[str, Any] | None]], timeout_s: float
) -> list[tuple[str, list[str]]]:
    """Every endpoint of ``sources`` (name, patterns, storage options) that cannot be reached.

    Returns, per such endpoint, a message naming it and every source that uses it, and the
    names of those sources (whose files cannot be listed).
    """
    users: dict[str, list[str]] = {}
    for name, patterns, options in sources:
        for pattern in patterns:
            endpoint = endpoint_of(pattern, options)
            if endpoint is not None and name not in users.get(endpoint, []):
                users.setdefault(endpoint, []).append(name)
    down = unreachable_endpoints(users, timeout_s)
    return [
        (
            f"endpoint {endpoint} cannot be reached ({why}); the sources that use it: "
            + ", ".join(f"'{n}'" for n in users[endpoint])
            + ". Check that the store is up and its address (storage_options: endpoint_url)",
            users[endpoint],
        )
        for endpoint, why in down.items()
    ]
