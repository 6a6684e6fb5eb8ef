"""The images (`make images`): built here with podman, the etcd, gateway, prefill and decode
containers start from them (non-root, the model in a mounted volume, configuration by flags
and environment only), their health checks pass, and the gateway answers a request. Skipped
with the reason where podman, runc or debootstrap is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh import env
from kvmesh.mesh.ports import free_ports
from kvmesh_apps.deploy import build

LIFETIME_S = 1800
pytestmark = pytest.mark.timeout(LIFETIME_S)
if missing := build.missing_tools():
    pytest.skip(f"needs {', '.join(missing)} (make images installs them)", allow_module_level=True)

MODEL = "smollm2-135m"
NAMES = ("etcd", "gateway", "prefill", "decode")


def _podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["podman", *args],
        capture_output=True,
        text=True,
        check=check,
        timeout=timeout,
        env=build.podman_env(),
    )


@pytest.fixture(scope="module")
def images() -> None:
    build.build(list(NAMES))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """A copy of the default model in a directory the containers' user owns (KVMESH_HOME)."""
    home = tmp_path_factory.mktemp("models")
    shutil.copytree(env.kvmesh_home() / "models" / MODEL, home / "models" / MODEL)
    for path in [home, *home.rglob("*")]:
        os.chown(path, 10001, 10001)
    return home


class Containers:
    def __init__(self, models: Path) -> None:
        self.prefix, self.models, self.names = f"kvmesh-test-{uuid.uuid4().hex[:6]}", models, []

    def run(self, service: str, probe_port: int, *args: str) -> str:
        name = f"{self.prefix}-{service}"
        # conmon, not this process, is the container's parent: --timeout bounds its life even
        # if this test is killed before stop() runs
        _podman(
            "run",
            "-d",
            "--rm",
            "--timeout",
            str(LIFETIME_S),
            "--name",
            name,
            "--network=host",
            "--env",
            f"KVMESH_PROBE_PORT={probe_port}",  # its health check's port
            "--volume",
            f"{self.models}:/models",
            build.image(service),
            *args,
        )
        self.names.append(name)
        return name

    def healthy(self, name: str, limit_s: float = 600) -> None:
        deadline = time.monotonic() + limit_s
        while _podman("healthcheck", "run", name, check=False).returncode != 0:
            state = _podman("inspect", "-f", "{{.State.Status}}", name, check=False).stdout
            assert "running" in state, f"{name} is {state}:\n{self.logs(name)}"
            assert time.monotonic() < deadline, f"{name} not healthy:\n{self.logs(name)}"
            time.sleep(2)

    def logs(self, name: str) -> str:
        return _podman("logs", "--tail", "40", name, check=False).stdout[-4000:]

    def stop(self) -> None:
        for name in reversed(self.names):
            _podman("rm", "-f", "-t", "10", name, check=False, timeout=60)


@pytest.fixture(scope="module")
def mesh(images, models) -> Iterator[tuple[Containers, int]]:
    etcd_port, peer_port, http_port, grpc_port = free_ports(4)
    etcd = f"127.0.0.1:{etcd_port}"
    containers = Containers(models)
    try:
        containers.run(
            "etcd",
            etcd_port,
            "--name=images-etcd",
            "--data-dir=/tmp/etcd",
            f"--listen-client-urls=http://{etcd}",
            f"--advertise-client-urls=http://{etcd}",
            f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-cluster=images-etcd=http://127.0.0.1:{peer_port}",
        )
        for role in ("prefill", "decode"):
            port, metrics = free_ports(2)
            containers.run(
                role,
                port,
                "--etcd",
                etcd,
                "--model",
                MODEL,
                "--port",
                str(port),
                "--metrics-port",
                str(metrics),
            )
        containers.run(
            "gateway",
            http_port,
            "--etcd",
            etcd,
            "--model",
            MODEL,
            "--http-port",
            str(http_port),
            "--grpc-port",
            str(grpc_port),
        )
        yield containers, http_port
    finally:
        containers.stop()


def test_images_are_non_root_and_carry_no_model(images):
    for name in NAMES:
        user = _podman("image", "inspect", "-f", "{{.Config.User}}", build.image(name)).stdout
        assert user.strip() == "10001:10001", (name, user)
    listing = _podman(
        "run", "--rm", "--entrypoint", "ls", build.image("decode"), "-A", "/models"
    ).stdout.split()
    assert listing == [], f"the image holds files in /models: {listing}"


def test_services_from_the_images_pass_their_health_checks_and_serve(mesh):
    containers, http_port = mesh
    for name in containers.names:
        containers.healthy(name)
    import openai

    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=0, timeout=300
    )
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a planet."}],
        max_tokens=8,
        temperature=0,
    )
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
