"""Reaching Ray within a time limit, and noticing when its head is gone.

Ray's own ``ray.init`` follows the address file the last ``ray start`` on the machine left
(another user's cluster, or a stale one it then retries for many minutes, deaf to Ctrl-C),
and when the head of a connected cluster dies it aborts the process from C++ a minute later
with no word of what happened. Here:

- without an address (and no ``RAY_ADDRESS``), :func:`init_ray` always starts a new local
  instance of this process's own, asked to use 127.0.0.1, with the dashboard off;
- with one, it joins that cluster, and gives up after the connect timeout (``timeout``,
  else ``OVERLORD_CONNECT_TIMEOUT``, else 60 s) with an error naming the address. Joining
  runs on a thread of its own, so that the wait is bounded and Ctrl-C or SIGTERM end it;
- once connected, a watch thread checks that the head's GCS still accepts connections;
  when it has not for :data:`HEAD_GRACE_S`, the process ends with an overlord error
  (exit status :data:`HEAD_GONE_EXIT`) instead of Ray's abort.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from overlord.errors import LoaderError

NAMESPACE = "overlord"
DEFAULT_CONNECT_TIMEOUT = 60.0
TIMEOUT_ENV = "OVERLORD_CONNECT_TIMEOUT"
# how long the head's GCS may refuse connections before the process ends; Ray's own
# abort comes after 60 s (RAY_gcs_rpc_server_reconnect_timeout_s), so this must be shorter
HEAD_GRACE_S = 10.0
HEAD_GONE_EXIT = 1
_PROBE_EVERY_S = 1.0


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError("the ray runtime needs Ray: pip install 'overlord-data[ray]'") from e
    return ray


def connect_timeout(value: float | None = None) -> float:
    """Seconds a connect to Ray may take: ``value``, else ``OVERLORD_CONNECT_TIMEOUT``, else 60."""
    where = "connect_timeout"
    if value is None:
        text = os.environ.get(TIMEOUT_ENV)
        if text is None:
            return DEFAULT_CONNECT_TIMEOUT
        where = f"{TIMEOUT_ENV}={text!r} (environment)"
        try:
            value = float(text)
        except ValueError:
            raise LoaderError(f"{where}: expected a number of seconds above 0") from None
    if not (math.isfinite(value) and value > 0):
        raise LoaderError(f"{where}: expected a number of seconds above 0, found {value}")
    return float(value)


def _resolve_auto() -> str:
    """What ``address="auto"`` means: the one Ray instance running on this machine, if any."""
    try:
        # Ray's own lookup (its address file, else its running GCS processes)
        from ray._private.services import canonicalize_bootstrap_address

        found = canonicalize_bootstrap_address("auto")
    except ImportError:  # a Ray without it: let ray.init judge "auto" itself
        return "auto"
    except (ConnectionError, ValueError) as e:
        raise LoaderError(f"cannot find the Ray cluster of this machine: {e}") from None
    if not found:
        raise LoaderError(
            "no Ray cluster runs on this machine (address 'auto'): start the job first "
            "('overlord serve PLAN --name JOB'), or give the cluster's address (RAY_ADDRESS)"
        )
    return str(found)


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``host:port`` or ``scheme://host:port``; None for other forms."""
    target = address.split("://", 1)[-1]
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (an address, or a name it resolves to) is this machine's loopback."""
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _probe(address: str, timeout: float = 5.0) -> None:
    """Fail fast when nothing listens at ``address``: Ray itself retries for minutes."""
    where = _host_port(address)
    if where is None:
        return  # a form we do not parse: let Ray judge it
    try:
        socket.create_connection(where, timeout=timeout).close()
    except OSError as e:
        raise LoaderError(
            f"cannot reach the Ray cluster at '{address}' ({e.strerror or e}): check the address "
            "and that the cluster is up"
        ) from None


class _Joining:
    """One ``ray.init(address=...)`` on a thread of its own, which the caller may abandon.

    An abandoned join that succeeds later disconnects at once, so that a timed-out
    connect leaves this process as it found it; while it is still inside ``ray.init``,
    the next connect in this process is refused (:func:`_refuse_pending`).
    """

    def __init__(self, ray: Any, address: str, kwargs: dict[str, Any]):
        self.address = address
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.abandoned = False
        self._lock = threading.Lock()
        self.thread = threading.Thread(
            target=self._run, args=(ray, kwargs), name="overlord-ray-connect", daemon=True
        )

    def _run(self, ray: Any, kwargs: dict[str, Any]) -> None:
        try:
            ray.init(address=self.address, **kwargs)
        except BaseException as e:  # handed to the caller, who may have gone
            self.error = e
        with self._lock:
            if self.abandoned and self.error is None:
                with contextlib.suppress(Exception):
                    ray.shutdown()
            self.done.set()

    def wait(self, timeout: float) -> bool:
        """True if ``ray.init`` ended within ``timeout``; else the join is abandoned."""
        try:
            finished = self.done.wait(timeout)
        except BaseException:  # Ctrl-C or SIGTERM while waiting: nobody wants it any more
            self.abandon()
            raise
        if not finished:
            self.abandon()
        return finished

    def abandon(self) -> None:
        with self._lock:
            self.abandoned = True
            if self.done.is_set() and self.error is None:
                with contextlib.suppress(Exception):
                    _ray().shutdown()


_pending: list[_Joining] = []


def _refuse_pending() -> None:
    """Refuse a connect while an abandoned one is still inside ``ray.init`` in this process."""
    _pending[:] = [j for j in _pending if not j.done.is_set()]
    if _pending:
        raise LoaderError(
            f"an earlier connect of this process to the Ray cluster at '{_pending[0].address}' "
            "ran out of time and is still inside ray.init: Ray allows one connection per "
            "process, so connect from a new process"
        )


class _NotTheMainThread(logging.Filter):
    """Drops Ray's warning that it sets no SIGTERM handler on a thread other than the main one.

    overlord joins on a thread on purpose, and the program's own handler stays.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


def _join(ray: Any, address: str, timeout: float, common: dict[str, Any]) -> None:
    start = time.monotonic()
    _probe(address, timeout=min(5.0, timeout))
    joining = _Joining(ray, address, common)
    quiet = _NotTheMainThread()
    worker_log = logging.getLogger("ray._private.worker")
    worker_log.addFilter(quiet)
    where = _host_port(address)
    # a cluster on this machine's loopback (a local `overlord serve`'s) listens there alone:
    # Ray would otherwise look for it at the machine's interface address
    on_loopback = where is not None and is_loopback(where[0])
    try:
        with _loopback_node() if on_loopback else contextlib.nullcontext():
            joining.thread.start()
            finished = joining.wait(max(0.0, timeout - (time.monotonic() - start)))
    finally:
        worker_log.removeFilter(quiet)
    if not finished:
        _pending.append(joining)
        raise LoaderError(
            f"no answer from the Ray cluster at '{address}' within {timeout:g} s: something "
            "accepts connections there but has not answered as Ray's GCS. Check the address "
            "and that the cluster is up, or allow more time (--connect-timeout, "
            f"connect_timeout=, {TIMEOUT_ENV})"
        )
    if joining.error is not None:
        e = joining.error
        if isinstance(e, (ConnectionError, RuntimeError, ValueError, TimeoutError)):
            raise LoaderError(
                f"cannot reach the Ray cluster at '{address}': {e}. Check the address, that "
                "the cluster is up, and RAY_AUTH_MODE=token if it uses token authentication"
            ) from None
        raise e


# Ray on Linux takes the machine's interface address as the node's, even when asked for
# 127.0.0.1 (it resolves loopback to a "remotely reachable" address), and then its servers
# listen on every interface. Its one switch for a node of loopback alone is the one meant
# for laptops: with it off, the node's address is 127.0.0.1, and the GCS, the raylet and
# every worker listen there. Ray reads it when it is imported, in each of its processes.
_LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def _loopback_node() -> Iterator[None]:
    """While a local instance starts: its node on 127.0.0.1, in this process and its own."""
    constants: Any = sys.modules.get("ray._private.ray_constants")
    before_env = os.environ.get(_LOOPBACK_SWITCH)
    before = getattr(constants, "ENABLE_RAY_CLUSTER", None)
    os.environ[_LOOPBACK_SWITCH] = "0"  # the processes it starts inherit it
    if before is not None:
        constants.ENABLE_RAY_CLUSTER = False  # this process imported Ray already
    try:
        yield
    finally:
        # a later join of another cluster from this process takes its address as usual
        if before_env is None:
            os.environ.pop(_LOOPBACK_SWITCH, None)
        else:
            os.environ[_LOOPBACK_SWITCH] = before_env
        if before is not None:
            constants.ENABLE_RAY_CLUSTER = before


def _start_local(ray: Any, common: dict[str, Any]) -> None:
    """A new local instance on 127.0.0.1; a SIGTERM handler the program had set is kept.

    Ray replaces the SIGTERM handler while it starts its processes (its own stops them and
    exits with status 1). A program's own handler (the ``overlord`` command's) is put back;
    a SIGTERM that Ray's handler took during the start is delivered again to it.
    """
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    keep = previous not in (None, signal.SIG_DFL)
    try:
        # "local": a new instance of this process's own. Without it Ray joins whatever cluster
        # the machine's address file names (another user's `ray start`, or a stale one it
        # then waits for): a job runs only where it was told to
        with _loopback_node():
            ray.init(
                address="local", include_dashboard=False, _node_ip_address="127.0.0.1", **common
            )
    except BaseException as e:  # Ctrl-C among others: what was started so far is stopped
        with contextlib.suppress(Exception):
            ray.shutdown()
        if isinstance(e, SystemExit) and main:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)
        raise
    finally:
        if main and keep:
            signal.signal(signal.SIGTERM, previous)


def init_ray(address: str | None, timeout: float | None = None) -> bool:
    """Connect to Ray at ``address`` (else ``RAY_ADDRESS``), or start a private local instance.

    True if this call started one. Without an address, the instance is always a new one
    of this process's, never a cluster another process recorded on the machine. Joining a
    cluster gives up after ``timeout`` seconds (see :func:`connect_timeout`) with a
    :class:`~overlord.errors.LoaderError` naming the address.
    """
    seconds = connect_timeout(timeout)
    address = address or os.environ.get("RAY_ADDRESS")
    token = os.path.expanduser("~/.ray/auth_token")
    if address and "RAY_AUTH_MODE" not in os.environ and os.path.exists(token):
        # a cluster started on this machine uses Ray's token authentication (its default),
        # and a client finds the token only in token mode, set before Ray is imported
        os.environ["RAY_AUTH_MODE"] = "token"
    ray = _ray()
    if ray.is_initialized():
        return False
    _refuse_pending()
    common = {"namespace": NAMESPACE, "logging_level": "WARNING", "log_to_driver": False}
    if address:
        _join(ray, _resolve_auto() if address == "auto" else address, seconds, common)
        started = False
    else:
        _start_local(ray, common)
        started = True
    watch_head(ray.get_runtime_context().gcs_address)
    return started


def shutdown_ray() -> None:
    """Leave Ray (stopping the local instance, if this process started it), unwatched."""
    stop_watching()
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


# ---- the head's watch ----------------------------------------------------------------------


class _HeadWatch:
    """A daemon thread that ends the process when the GCS at ``address`` stays unreachable."""

    def __init__(self, address: str, grace: float):
        self.address, self.grace = address, grace
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="overlord-ray-head", daemon=True)

    def _current(self) -> str | None:
        """The GCS address this process is connected to now; None once it has left Ray."""
        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():
            return None
        try:
            return str(ray.get_runtime_context().gcs_address)
        except Exception:  # disconnecting right now
            return None

    def _run(self) -> None:
        where = _host_port(self.address)
        if where is None:
            return
        since: float | None = None
        while not self.stopped.wait(_PROBE_EVERY_S):
            if self._current() != self.address:
                return  # this process left that cluster (ray.shutdown), or joined another
            try:
                socket.create_connection(where, timeout=_PROBE_EVERY_S).close()
                since = None
                continue
            except OSError:
                since = since if since is not None else time.monotonic()
            if time.monotonic() - since < self.grace or self.stopped.is_set():
                continue
            if self._current() != self.address:
                return
            sys.stderr.write(
                f"overlord: the Ray head at {self.address} is gone: its GCS has refused "
                f"connections for {self.grace:g} s, so this process cannot reach the job's "
                "actors any more. It stops now; restart the job (overlord serve) and its "
                "trainers\n"
            )
            sys.stderr.flush()
            # Ray would abort this process from C++ a minute later; nothing Ray holds can be
            # cleaned up without the head, so the process ends here, with overlord's words
            os._exit(HEAD_GONE_EXIT)


_watch: list[_HeadWatch] = []


def watch_head(address: str, grace: float = HEAD_GRACE_S) -> None:
    """Watch the head at ``address`` from this process (one watch at a time)."""
    stop_watching()
    w = _HeadWatch(address, grace)
    _watch.append(w)
    w.thread.start()


def stop_watching() -> None:
    """Stop the head's watch: before this process shuts down Ray, the head it stops."""
    while _watch:
        _watch.pop().stopped.set()
