"""Process lifecycle: stopping children we started in their own session (process group id ==
pid), and a service's own stop signal."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess


def terminate_group(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM the child's process group, SIGKILL it after `timeout`; only touches our child."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return  # already reaped: its pid may belong to someone else now
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=timeout)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


async def wait_for_signal() -> None:
    """Return on SIGTERM or SIGINT (a service's graceful stop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
