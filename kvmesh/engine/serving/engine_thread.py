"""What keeps a worker's torch work on one thread: the engine is built on a thread that exits
(`build_engine`), then every call runs on the step loop's thread (`Call`, see AsyncEngine).

Why: each thread that enters an OpenMP parallel region keeps a team of threads alive for as
long as it lives. Once a process holds more such threads than CPUs, libgomp throttles its
barrier spinning and its threads sleep at every barrier: SmolLM2's decode steps ran slower from
a second thread than from the thread that built the engine, and as fast from any thread once
the builder had exited (measured: docs/benchmarks-history.md, "fp32 linears as weight @ x^T, and
speculation baselines measured per batch").
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass
class Call:
    """An engine call waiting for the engine thread, and where its answer goes."""

    fn: Callable[..., Any]
    args: tuple
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    context: contextvars.Context  # the caller's (log bindings travel with the call)

    def settle(self, result: Any, error: BaseException | None) -> None:
        """On the caller's loop: (result, error) to a caller still waiting."""
        if not self.future.done():
            self.future.set_result((result, error))


def build_engine(build: Callable[[], T]) -> T:
    """`build()` on a thread that exits when it returns (see the module doc: its OpenMP team
    goes with it), the caller blocked until then; its exception re-raised here. The engine,
    or whatever else a process builds with torch before serving from another thread."""
    box: dict[str, Any] = {}
    context = contextvars.copy_context()  # the caller's log bindings (service, worker id)

    def run() -> None:
        try:
            box["engine"] = context.run(build)
        except BaseException as exc:  # re-raised in the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name="engine-build", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["engine"]
