"""Simulated hosts for tests: network namespaces joined by a bridge on a private /24 that the
test creates and removes (needs root and `ip netns`). Only addresses inside it are used."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Hosts:
    prefix: str  # namespace names start with it
    addresses: dict[str, str]  # host name -> its address

    def namespace(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def command(self, host: str, argv: list[str]) -> list[str]:
        """`argv` run on `host` (inside its namespace)."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]


def unavailable() -> str | None:
    """Why simulated hosts cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is missing"
    probe = f"kvm-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.decode(errors='replace').strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def simulated_hosts(names: list[str], octet: int = 77) -> Iterator[Hosts]:
    """One namespace per host plus one holding the bridge; host i gets 10.231.<octet>.(i+1)
    (private: 10.231.<octet>.0/24 exists only inside these namespaces).
    Everything is deleted on exit, whatever happened."""
    prefix = f"kvm{uuid.uuid4().hex[:5]}"
    bridge_ns = f"{prefix}-br"
    hosts = Hosts(prefix, {n: f"10.231.{octet}.{i + 1}" for i, n in enumerate(names)})
    made: list[str] = []
    try:
        _ip("netns", "add", bridge_ns)
        made.append(bridge_ns)
        _ip("-n", bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge_ns, "link", "set", "br0", "up")
        for i, name in enumerate(names):
            ns = hosts.namespace(name)
            _ip("netns", "add", ns)
            made.append(ns)
            inner, outer = f"{prefix}i{i}", f"{prefix}o{i}"  # made inside the namespaces:
            _ip(
                "link",
                "add",
                "name",
                outer,
                "netns",
                bridge_ns,
                "type",
                "veth",  # never here
                "peer",
                "name",
                inner,
                "netns",
                ns,
            )
            _ip("-n", bridge_ns, "link", "set", outer, "master", "br0")
            _ip("-n", bridge_ns, "link", "set", outer, "up")
            _ip("-n", ns, "addr", "add", f"{hosts.addresses[name]}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for ns in reversed(made):  # deleting a namespace deletes the veth ends inside it
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
