"""`make images` (`python -m kvmesh_apps.deploy.build`): build every image of deploy/images with
podman. No registry is needed: the base OS is a local debootstrap of Debian (mirror read from
the host's apt sources at run time), the Python layer pip-installs torch and a wheel of this
checkout (the host's pip configuration, wheels and CA bundle are mounted into that build step
only, never copied into a layer), and each service image is a thin layer on top. podman runs
with runc and explicit ulimits (containers.conf written next to the build):
../shared/notes/containers-on-this-machine.md."""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kvmesh_apps.deploy.services import SERVICES

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "deploy" / "images"
WORK = ROOT / "build" / "images"
SUITE = "bookworm"
# Debian packages of the base OS (libcurl4, libibverbs1, librdmacm1, libnuma1: Mooncake's).
PACKAGES = "python3,python3-venv,ca-certificates,libibverbs1,librdmacm1,libnuma1,libcurl4,passwd"
# tagged by its contents: a change of packages makes a new one
BASE_OS = (
    "localhost/kvmesh-base-os:" + hashlib.sha256(f"{SUITE} {PACKAGES}".encode()).hexdigest()[:12]
)
BASE = "localhost/kvmesh-base:latest"
CONF = """[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
"""
# Host files pip needs inside the build step (where they exist): mounted read-only.
PIP_MOUNTS = ("/etc/pip.conf", "/etc/xdg/pip", "/opt/wheels", "/opt/pypi", "/opt/pypi-more")
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


def image(name: str) -> str:
    return f"localhost/kvmesh-{name}:latest"


def podman_env() -> dict[str, str]:
    """The environment podman runs in: runc, cgroupfs, ulimits the machine allows."""
    WORK.mkdir(parents=True, exist_ok=True)
    conf = WORK / "containers.conf"
    conf.write_text(CONF)
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


def missing_tools() -> list[str]:
    return [tool for tool in ("podman", "runc", "debootstrap") if shutil.which(tool) is None]


def _run(cmd: list[str], **kwargs) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=podman_env(), **kwargs)


def _exists(name: str) -> bool:
    return subprocess.run(["podman", "image", "exists", name], env=podman_env()).returncode == 0


def _mirror() -> str:
    """The host's Debian mirror (never written anywhere)."""
    for path in (Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list")):
        if path.is_file():
            found = re.search(r"(?:URIs:\s*|deb\s+)(\S+/debian)\s", path.read_text() + "\n")
            if found:
                return found.group(1)
    return "http://deb.debian.org/debian"


def build_base_os() -> None:
    if _exists(BASE_OS):
        return
    with tempfile.TemporaryDirectory(prefix="kvmesh-rootfs-") as rootfs:
        _run(
            ["debootstrap", "--variant=minbase", f"--include={PACKAGES}", SUITE, rootfs, _mirror()],
            stdout=subprocess.DEVNULL,
        )
        shutil.rmtree(Path(rootfs) / "var/cache/apt/archives", ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        _run(["podman", "import", "-", BASE_OS], stdin=tar.stdout, stdout=subprocess.DEVNULL)
        if tar.wait() != 0:  # a partial import must not stay under the tag it is reused by
            subprocess.run(["podman", "rmi", "-f", BASE_OS], env=podman_env())
            raise RuntimeError(f"tar of the base OS failed (rc {tar.returncode})")


def build_base() -> None:
    dist = WORK / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(ROOT)])
    mounts = [f"--volume={p}:{p}:ro" for p in PIP_MOUNTS if Path(p).exists()]
    if Path(CA_BUNDLE).is_file():  # the host's bundle (it may hold a local CA) for pip only
        mounts.append(f"--volume={CA_BUNDLE}:{CA_BUNDLE}:ro")
    if links := os.environ.get("PIP_FIND_LINKS"):  # e.g. a directory holding the CPU torch wheel
        mounts += [
            f"--build-arg=PIP_FIND_LINKS={links}",
            *(f"--volume={p}:{p}:ro" for p in links.split() if Path(p).is_dir()),
        ]
    _run(
        [
            "podman",
            "build",
            "--format=docker",
            "--network=host",
            *mounts,
            f"--build-arg=BASE_OS={BASE_OS}",
            "-f",
            str(IMAGES / "base.Containerfile"),
            "-t",
            BASE,
            str(WORK),
        ]
    )


def build(names: list[str]) -> None:
    build_base_os()
    build_base()
    for name in names:
        _run(
            [
                "podman",
                "build",
                "--format=docker",  # (docker format: it keeps HEALTHCHECK)
                "-f",
                str(IMAGES / f"{name}.Containerfile"),
                "-t",
                image(name),
                str(WORK),
            ]
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvmesh_apps.deploy.build")
    parser.add_argument("names", nargs="*", help="services (default: every one)")
    args = parser.parse_args(argv)
    if missing := missing_tools():
        print(f"missing: {', '.join(missing)} (make images installs them)", file=sys.stderr)
        return 2
    build(args.names or [s.name for s in SERVICES])
    return 0


if __name__ == "__main__":
    sys.exit(main())
