"""The Kubernetes base (deploy/k8s/base) and the Mooncake Store component, rendered from the
service table: one Deployment per service (the etcd StatefulSet aside), readiness from gRPC
health (`grpc.health.v1`) or the gateway's /health, SIGTERM drain within the grace period, the
services listening on every interface of the pod and advertising its IP (gRPC, metrics, the
transfer engine: --advertise-host from the downward API), the model fetched into a
volume at start. Overlays (dev, production) are hand-written patches on top."""

from __future__ import annotations

from typing import Any

from kvmesh_apps.deploy.services import (
    DRAIN_TIMEOUT_S,
    ETCD_CLIENT_PORT,
    ETCD_PEER_PORT,
    MASTER_PORT,
    MODEL_DIR,
    Service,
    service,
)

Manifest = dict[str, Any]
LABEL = "app.kubernetes.io/name"
PART_OF = {"app.kubernetes.io/part-of": "kvmesh"}
_ENV = [
    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    {"name": "MC_TCP_BIND_ADDRESS", "value": "$(POD_IP)"},  # the transfer engine's address
    {"name": "KVMESH_HOME", "value": MODEL_DIR},
]
_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
_POD_SECURITY = {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001}


def _probes(svc: Service) -> dict[str, Any]:
    if svc.probe == "http":
        ready: dict[str, Any] = {"httpGet": {"path": "/health", "port": "http"}}
        live: dict[str, Any] = {"httpGet": {"path": "/live", "port": "http"}}
    elif svc.probe == "grpc":
        ready = live = {"grpc": {"port": svc.ports["grpc"]}}
    else:
        ready = live = {"tcpSocket": {"port": next(iter(svc.ports))}}
    return {
        # loading (and at first start fetching) the model takes a while: up to 10 minutes
        "startupProbe": {**ready, "periodSeconds": 5, "failureThreshold": 120},
        "readinessProbe": {**ready, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {**live, "periodSeconds": 10, "failureThreshold": 6},
    }


def _container(svc: Service, args: list[str] | None = None) -> Manifest:
    return {
        "name": "kvmesh",  # one name in every pod: overlays patch containers by it
        "image": f"kvmesh-{svc.name}:latest",
        "command": list(svc.command),
        "args": list(svc.args) if args is None else args,
        "env": _ENV,
        "ports": [{"name": name, "containerPort": port} for name, port in svc.ports.items()],
        **_probes(svc),
        "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "8Gi"}},
        "securityContext": _SECURITY,
        "volumeMounts": [
            {"name": "models", "mountPath": MODEL_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }


def _scrape(svc: Service) -> dict[str, str]:
    """Prometheus annotations where the service exports metrics (workers, gateway)."""
    port = svc.ports.get("metrics", svc.ports.get("http"))
    return {} if port is None else {"prometheus.io/scrape": "true", "prometheus.io/port": str(port)}


def _pod(svc: Service, container: Manifest) -> Manifest:
    return {
        "metadata": {"labels": {LABEL: svc.name, **PART_OF}, "annotations": _scrape(svc)},
        "spec": {
            "securityContext": _POD_SECURITY,
            # a worker drains on SIGTERM (NOT_SERVING, lease revoked, in-flight requests end)
            "terminationGracePeriodSeconds": DRAIN_TIMEOUT_S + 15,
            "containers": [container],
            "volumes": [{"name": "models", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}],
        },
    }


def deployment(name: str, replicas: int = 1) -> Manifest:
    svc = service(name)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": {LABEL: name, **PART_OF}},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {LABEL: name}},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "template": _pod(svc, _container(svc)),
        },
    }


def cluster_service(name: str, headless: bool = False) -> Manifest:
    svc = service(name)
    spec: dict[str, Any] = {
        "selector": {LABEL: name},
        "ports": [{"name": n, "port": p, "targetPort": n} for n, p in svc.ports.items()],
    }
    if headless:
        spec = {"clusterIP": "None", "publishNotReadyAddresses": True, **spec}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": {LABEL: name, **PART_OF}},
        "spec": spec,
    }


def etcd_statefulset(replicas: int = 1) -> Manifest:
    """etcd members etcd-0..N-1 behind the headless Service `etcd` (overlays may point the
    mesh at an external etcd instead)."""
    svc = service("etcd")
    members = ",".join(f"etcd-{i}=http://etcd-{i}.etcd:{ETCD_PEER_PORT}" for i in range(replicas))
    args = [
        "--name=$(POD_NAME)",
        "--data-dir=/var/lib/etcd/data",
        f"--listen-client-urls=http://0.0.0.0:{ETCD_CLIENT_PORT}",
        f"--advertise-client-urls=http://$(POD_NAME).etcd:{ETCD_CLIENT_PORT}",
        f"--listen-peer-urls=http://0.0.0.0:{ETCD_PEER_PORT}",
        f"--initial-advertise-peer-urls=http://$(POD_NAME).etcd:{ETCD_PEER_PORT}",
        f"--initial-cluster={members}",
        "--initial-cluster-state=new",
    ]
    container = {
        **_container(svc, args),
        "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"}],
    }
    pod = _pod(svc, container)
    pod["spec"]["volumes"] = []
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "etcd", "labels": {LABEL: "etcd", **PART_OF}},
        "spec": {
            "serviceName": "etcd",
            "replicas": replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": {LABEL: "etcd"}},
            "template": pod,
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": "data"},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": "1Gi"}},
                    },
                }
            ],
        },
    }


def mooncake_master() -> list[Manifest]:
    """The Mooncake Store master (the KV store's second tier), for the production overlay."""
    master = deployment("mooncake-master")
    container = master["spec"]["template"]["spec"]["containers"][0]
    container["args"] = [f"--rpc_port={MASTER_PORT}", "--rpc_address=$(POD_IP)"]
    return [master, cluster_service("mooncake-master")]


def base() -> dict[str, list[Manifest]]:
    """File name -> its documents."""
    return {
        "etcd.yaml": [cluster_service("etcd", headless=True), etcd_statefulset()],
        "gateway.yaml": [deployment("gateway"), cluster_service("gateway")],
        "prefill.yaml": [deployment("prefill")],
        "decode.yaml": [deployment("decode")],
        "kvstore.yaml": [deployment("kvstore")],
    }
