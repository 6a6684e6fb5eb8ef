"""deploy/: the rendered files are what kvmesh_apps/deploy renders (so they follow the CLI), every
command they run parses with kvmesh's own CLI, and every manifest the overlays render passes
`kubernetes-validate --strict` (offline schemas)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvmesh.cli_args import build_parser
from kvmesh_apps.deploy.render import rendered
from kvmesh_apps.deploy.services import SERVICES

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ("dev", "production")


def test_rendered_files_are_committed():
    stale = [
        path
        for path, text in rendered().items()
        if not (ROOT / "deploy" / path).is_file() or (ROOT / "deploy" / path).read_text() != text
    ]
    assert not stale, f"run `make deploy`: {stale}"


@pytest.mark.parametrize("svc", [s for s in SERVICES if s.kvmesh_cli], ids=lambda s: s.name)
def test_every_service_command_parses(svc):
    args = [a.replace("$(POD_IP)", "10.0.0.7") for a in (*svc.command[1:], *svc.args)]
    parsed = build_parser(args).parse_args(args)
    assert parsed.service == svc.name and parsed.host == "0.0.0.0"
    if svc.name != "gateway":  # registered in etcd: peers dial the pod's address
        assert parsed.advertise_host == "10.0.0.7"


def _render(overlay: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (kubectl kustomize renders the overlays)")
    done = subprocess.run(
        [kubectl, "kustomize", str(ROOT / "deploy/k8s/overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlays_render_and_validate_strictly(overlay, tmp_path):
    docs = _render(overlay)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for name in ("gateway", "prefill", "decode", "kvstore"):
        assert ("Deployment", name) in kinds
    assert ("StatefulSet", "etcd") in kinds
    rendered_file = tmp_path / f"{overlay}.yaml"
    rendered_file.write_text(yaml.safe_dump_all(docs))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kubernetes_validate",
            "--strict",
            "--kubernetes-version",
            "1.32.0",
            str(rendered_file),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_production_pools_are_spread_with_gpus_budgets_and_autoscaling():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _render("production")}
    for pool, count in (("prefill", 2), ("decode", 4)):
        deployment = docs[("Deployment", pool)]
        assert deployment["spec"]["replicas"] == count
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert "hugepages-2Mi" not in container["resources"]["limits"]  # the pool is on the GPU
        assert pod["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
        assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "kvmesh-models"
        assert container["args"][-4:] == ["--device", "cuda", "--protocol", "rdma"]
        assert container["readinessProbe"]["grpc"]["port"] == 50051
        assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
        assert ("PodDisruptionBudget", pool) in docs and ("HorizontalPodAutoscaler", pool) in docs
    assert docs[("StatefulSet", "etcd")]["spec"]["replicas"] == 3
    store = docs[("Deployment", "kvstore")]["spec"]["template"]["spec"]["containers"][0]
    assert "--mooncake-master" in store["args"] and ("Deployment", "mooncake-master") in docs
    assert store["args"][-2:] == ["--protocol", "rdma"]  # the same transport as the workers
    for name in ("gateway", "kvstore"):
        pod = docs[("Deployment", name)]["spec"]["template"]["spec"]
        assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "kvmesh-models"
    for (kind, name), doc in docs.items():  # every kvmesh command the overlay runs parses
        if kind in ("Deployment", "StatefulSet"):
            (container,) = doc["spec"]["template"]["spec"]["containers"]
            if container.get("command", [""])[0] == "kvmesh":
                args = [
                    a.replace("$(POD_IP)", "10.0.0.7")
                    for a in (*container["command"][1:], *container["args"])
                ]
                assert build_parser(args).parse_args(args).service == name
