"""Everything under deploy/ that is rendered from the service table, as {path: text}
(`scripts/gen_deploy.py` writes it; a test compares it with the committed files)."""

from __future__ import annotations

from typing import Any

import yaml

from kvmesh_apps.deploy import images, k8s
from kvmesh_apps.deploy.services import MASTER_PORT

HEADER = images.HEADER


def _yaml(docs: list[dict[str, Any]]) -> str:
    return HEADER + yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False)


def _kustomization(resources: list[str], kind: str = "Kustomization", **extra: Any) -> str:
    version = "v1beta1" if kind == "Kustomization" else "v1alpha1"
    api = f"kustomize.config.k8s.io/{version}"
    return _yaml([{"apiVersion": api, "kind": kind, "resources": resources, **extra}])


def rendered() -> dict[str, str]:
    out = {f"images/{name}": text for name, text in images.files().items()}
    base = k8s.base()
    out.update({f"k8s/base/{name}": _yaml(docs) for name, docs in base.items()})
    out["k8s/base/kustomization.yaml"] = _kustomization(sorted(base))
    out["k8s/components/mooncake-store/mooncake-master.yaml"] = _yaml(k8s.mooncake_master())
    store_args = [
        {"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": v}
        for v in ("--backend", "mooncake", "--mooncake-master", f"mooncake-master:{MASTER_PORT}")
    ]
    out["k8s/components/mooncake-store/kustomization.yaml"] = _kustomization(
        ["mooncake-master.yaml"],
        kind="Component",
        patches=[
            {
                "target": {"kind": "Deployment", "name": "kvstore"},
                "patch": yaml.safe_dump(store_args, sort_keys=False),
            }
        ],
    )
    etcd = k8s.etcd_statefulset(replicas=3)
    out["k8s/overlays/production/etcd-members.yaml"] = _yaml(
        [
            {
                "apiVersion": "apps/v1",
                "kind": "StatefulSet",
                "metadata": {"name": "etcd"},
                "spec": {
                    "replicas": 3,
                    "template": {
                        "spec": {
                            "containers": [
                                {
                                    "name": "kvmesh",
                                    "args": etcd["spec"]["template"]["spec"]["containers"][0][
                                        "args"
                                    ],
                                }
                            ]
                        }
                    },
                },
            }
        ]
    )
    return out
