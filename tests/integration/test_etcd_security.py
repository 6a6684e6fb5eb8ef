"""etcd over TLS with authentication (a real etcd, a throwaway CA): discovery works with the right
certificate and password, survives an etcd restart (which forgets auth tokens), and is refused
without TLS, without a client certificate, with another CA's certificate, with a wrong password
and to a certificate whose name is not an etcd user; a real service logs in with --etcd-user and
the password from the environment."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aetcd
import pytest

from kvmesh.errors import DiscoveryError, EtcdAuthError, InvalidRequestError
from kvmesh.mesh.certs import make_ca, make_leaf
from kvmesh.mesh.discovery import Registry, WorkerInfo, WorkerWatcher
from kvmesh.mesh.etcd_access import EtcdAccess
from kvmesh.mesh.etcd_server import EtcdServer
from kvmesh.mesh.tls import TlsFiles
from kvmesh.processes import spawn, terminate_group

pytestmark = pytest.mark.timeout(120)
USER, PASSWORD = "kvmesh", "etcd-pw-5e0c"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, TlsFiles]:
    root = tmp_path_factory.mktemp("certs")
    ca = make_ca(root)
    other_ca = make_ca(root / "other", "another CA")
    return {
        "etcd": make_leaf(root, "etcd", ca),
        "client": make_leaf(root, "client", ca),
        "cn-user": make_leaf(root, "cn-user", ca),
        "stranger": make_leaf(root / "other", "stranger", other_ca),
    }


@pytest.fixture(scope="module")
def etcd(certs) -> Iterator[EtcdServer]:
    with EtcdServer(tls=certs["etcd"]) as server:
        server.enable_auth(USER, PASSWORD)
        yield server


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def _listing(endpoint: str, access: EtcdAccess) -> list[WorkerInfo]:
    async def listing() -> list[WorkerInfo]:
        async with Registry(endpoint, "sec", access) as registry:
            return await registry.list_workers()

    return run(listing(), timeout=20)


def test_discovery_over_tls_with_a_password_survives_an_etcd_restart(etcd, certs):
    access = EtcdAccess.of_mesh(certs["client"], USER, PASSWORD)

    async def scenario() -> None:
        async with Registry(etcd.endpoint, "sec", access) as registry:
            registration = await registry.register(WorkerInfo("decode", "d0", "127.0.0.1:1"))
            watcher = WorkerWatcher(registry)
            await watcher.start()
            assert list(watcher.workers) == ["decode/d0"]
            await asyncio.to_thread(etcd.restart)  # etcd forgets every auth token
            await registry.register(WorkerInfo("prefill", "p0", "127.0.0.1:2"))  # logs in again
            deadline = time.monotonic() + 15
            while set(watcher.workers) != {"decode/d0", "prefill/p0"}:
                assert time.monotonic() < deadline, watcher.workers
                await asyncio.sleep(0.1)
            await asyncio.sleep(6)  # > the 5 s lease: the keep-alive renewed it after the restart
            assert {w.name for w in await registry.list_workers()} >= {"decode/d0"}
            await registration.close()
            assert "decode/d0" not in {w.name for w in await registry.list_workers()}
            await watcher.stop()

    run(scenario())


def test_etcd_refuses_every_other_way_in(etcd, certs, tmp_path):
    plain = etcd.endpoint.replace("https://", "")
    with pytest.raises(DiscoveryError):  # plaintext to a TLS port
        _listing(plain, EtcdAccess(user=USER, password=PASSWORD))
    ca_only = EtcdAccess(ca=certs["client"].ca, user=USER, password=PASSWORD)
    with pytest.raises(DiscoveryError):  # no client certificate (--client-cert-auth)
        _listing(etcd.endpoint, ca_only)
    stranger = certs["stranger"]
    foreign = EtcdAccess(certs["client"].ca, stranger.cert, stranger.key, USER, PASSWORD)
    with pytest.raises(DiscoveryError):  # a certificate of another CA
        _listing(etcd.endpoint, foreign)
    with pytest.raises(EtcdAuthError, match="invalid user ID or password"):
        _listing(etcd.endpoint, EtcdAccess.of_mesh(certs["client"], USER, "wrong"))
    with pytest.raises(DiscoveryError, match="permission denied"):  # its name is no etcd user
        _listing(etcd.endpoint, EtcdAccess.of_mesh(certs["cn-user"]))
    with pytest.raises(InvalidRequestError, match="https"):  # no CA to check etcd's certificate
        _listing(etcd.endpoint, EtcdAccess())


def test_a_refused_watch_fails_instead_of_waiting_for_ever(etcd, certs):
    """etcd answers a watch it refuses (here: outside the user's /kvmesh/ permission; also a
    stale token) with a reply created already cancelled, not an error."""
    access = EtcdAccess.of_mesh(certs["client"], USER, PASSWORD)

    async def scenario() -> None:
        async with Registry(etcd.endpoint, "sec", access) as registry:
            with pytest.raises(aetcd.ClientError, match="permission denied"):
                await asyncio.wait_for(registry.client.watch(b"/elsewhere/"), 20)
            watch = await registry.client.watch_prefix(registry.workers_prefix)  # permitted
            await watch.cancel()

    run(scenario())


def _serve_kvstore(etcd: EtcdServer, files: TlsFiles, log: Path, password: str | None):
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    env.pop("KVMESH_ETCD_PASSWORD", None)
    if password is not None:
        env["KVMESH_ETCD_PASSWORD"] = password
    command = [
        sys.executable,
        "-m",
        "kvmesh.cli",
        "serve",
        "kvstore",
        "--etcd",
        etcd.endpoint,
        "--cluster",
        "sec",
        "--etcd-user",
        USER,
        *files.as_flags(),
        "--page-bytes",
        "4096",
        "--kv-dtype",
        "fp32",
        "--model",
        "tiny",
        "--ram-mib",
        "1",
        "--disk-mib",
        "1",
    ]
    return spawn(command, log.open("ab"), env=env)


def test_a_service_logs_in_with_the_password_from_its_environment(etcd, certs, tmp_path):
    access = EtcdAccess.of_mesh(certs["client"], USER, PASSWORD)
    proc = _serve_kvstore(etcd, certs["client"], tmp_path / "kvstore.log", PASSWORD)
    try:
        deadline = time.monotonic() + 60
        while not [w for w in _listing(etcd.endpoint, access) if w.role == "kvstore"]:
            assert proc.poll() is None, (tmp_path / "kvstore.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the KV store never registered"
            time.sleep(0.2)
    finally:
        terminate_group(proc, 10)
    assert not [w for w in _listing(etcd.endpoint, access) if w.role == "kvstore"]
    missing = _serve_kvstore(etcd, certs["client"], tmp_path / "nopw.log", None)
    try:
        assert missing.wait(timeout=60) != 0
    finally:
        terminate_group(missing, 5)
    assert "KVMESH_ETCD_PASSWORD" in (tmp_path / "nopw.log").read_text()
