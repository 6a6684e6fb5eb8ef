"""Process lifecycle: children in their own session (process group id == pid) that die with us,
stopping their groups, and stop signals turned into an orderly stop."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import IO, Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1
# Looked up here, in the parent: the forked child must not load libraries before exec.
_PRCTL = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)


def die_with_parent() -> Callable[[], None] | None:
    """A Popen `preexec_fn`: the child gets SIGKILL when this process dies, even by SIGKILL.

    None off the main thread: PR_SET_PDEATHSIG fires when the *thread* that forked the child
    exits, so a child spawned from a pool thread (asyncio.to_thread) would die with that thread.
    """
    if _PRCTL is None or threading.current_thread() is not threading.main_thread():
        return None
    parent = os.getpid()

    def setup() -> None:  # in the child, between fork and exec
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl: no signal would come
            os.kill(os.getpid(), signal.SIGKILL)

    return setup


def spawn(
    cmd: list[str],
    log: IO[bytes],
    env: Mapping[str, str] | None = None,
    cpus: frozenset[int] | None = None,
) -> subprocess.Popen:
    """Start `cmd` in its own session (so its whole group can be stopped) that dies with us;
    stdout and stderr go to `log`; `cpus`: every thread it will have runs on these only."""
    return subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        preexec_fn=_child_setup(die_with_parent(), cpus),  # no locks taken there
    )


def _child_setup(
    die: Callable[[], None] | None, cpus: frozenset[int] | None
) -> Callable[[], None] | None:
    if cpus is None:
        return die

    def setup() -> None:  # between fork and exec: the child's threads all inherit the set
        os.sched_setaffinity(0, cpus)
        if die is not None:
            die()

    return setup


def stop_groups(procs: Iterable[subprocess.Popen], grace: float) -> None:
    """SIGTERM every child's process group at once, SIGKILL those still there after `grace`
    seconds; waits for all. Only touches our own, not yet reaped, children."""
    procs = list(procs)
    for proc in procs:
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


def terminate_group(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM the child's process group, SIGKILL it after `timeout`."""
    stop_groups([proc], timeout)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is not None:
        return  # already reaped: its pid may belong to someone else now
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)  # the child leads its own group (start_new_session)


class StopSignal(BaseException):
    """A stop signal turned into an exception, so the caller's `finally` runs. A BaseException,
    like KeyboardInterrupt: `except Exception` must not swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP (main thread only) raise one StopSignal where the main thread
    is: at once, or at the end of a `deferred()` block. After the first, or once `disarm()` was
    called (a stop is running), signals are only counted: nothing interrupts the stop."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.ignored = 0
        self._armed = True
        self._deferring = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def disarm(self) -> None:
        self._armed = False

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Hold a stop signal back while a step that must not be cut runs (spawn a child and
        record it; a call into asyncio, which would bury the exception in some task)."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
        self._raise_pending()

    def _handle(self, signum: int, frame: object) -> None:  # noqa: ARG002
        if self.received is not None or not self._armed:
            self.ignored += 1
            return
        self.received = signum
        self._raise_pending()

    def _raise_pending(self) -> None:
        if self.received is not None and self._armed and not self._deferring:
            self._armed = False
            raise StopSignal(self.received)


def exit_now(code: int) -> None:
    """End this process with `code` at once, after flushing its output: no interpreter
    finalization (a service whose transfer engine's ~1 s destructor it skips: transfer.py)."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
