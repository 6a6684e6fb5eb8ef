"""One mesh for the modules of this package (a package-scoped fixture: started once, stopped
when the last of them is done): etcd + gateway + 2 prefill + 2 decode workers on loopback.
The modules run in name order: test_agent_sdks, test_api, test_cache_routing, then
test_failures (they kill workers)."""

from __future__ import annotations

import pytest

from kvmesh import LLM
from kvmesh.mesh.launcher import UpOptions
from kvmesh.mesh.up_config import gateway_config, worker_configs
from tests.integration.chat_client import client_for
from tests.integration.mesh_probes import (
    module_mesh,
)


@pytest.fixture(scope="package")
def mesh():
    options = UpOptions(
        workers=worker_configs("--kv-cache-mib", "96", "--max-num-seqs", "16"),
        prefill=2,
        decode=2,
        gateway=gateway_config("--affinity-slack-tokens", "600"),
    )
    with module_mesh(options) as running:
        yield running


@pytest.fixture(scope="package")
def client(mesh):
    return client_for(mesh)


@pytest.fixture(scope="package")
def reference():
    return LLM(dtype="fp32", kv_cache_bytes=160 << 20)
