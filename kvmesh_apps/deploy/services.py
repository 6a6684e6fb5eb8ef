"""The mesh's services as deployments see them, defined once: the image each runs, its command
and flags, its ports and how its health is probed. `images.py` renders the Containerfiles and
`k8s.py` the Kubernetes base from this table (`make deploy` writes them; a test checks that the
committed files are what this renders and that every command parses with kvmesh's own CLI)."""

from __future__ import annotations

from dataclasses import dataclass, field

GRPC_PORT = 50051  # every worker's and the KV store's gRPC port inside a pod / container
METRICS_PORT = 9400  # Prometheus /metrics
HTTP_PORT = 8000  # the gateway's REST front (its /metrics too)
ETCD_CLIENT_PORT, ETCD_PEER_PORT = 2379, 2380  # in their own pod / container only
MASTER_PORT = 50080  # mooncake_master's RPC port
DRAIN_TIMEOUT_S = 30  # --drain-timeout; pods get this plus a margin to end on SIGTERM
MODEL = "smollm2-135m"
MODEL_DIR = "/models"  # KVMESH_HOME: a volume the model is fetched into, never in the image
ETCD = f"etcd:{ETCD_CLIENT_PORT}"  # the etcd Service's name in the namespace
ANY = "0.0.0.0"  # noqa: S104 - every interface of the pod (kubectl port-forward reaches it too)
HOST = "$(POD_IP)"  # what a service advertises: the pod's own address (downward API)


@dataclass(frozen=True)
class Service:
    name: str  # image kvmesh-<name>, Deployment / StatefulSet <name>
    command: tuple[str, ...]  # the container's entrypoint
    args: tuple[str, ...] = ()  # flags the manifests pass (overlays may add more)
    ports: dict[str, int] = field(default_factory=dict)  # name -> container port
    probe: str = "grpc"  # grpc (grpc.health.v1 on the grpc port) | http (/health) | tcp
    kvmesh_cli: bool = True  # command is `kvmesh ...` (its flags are checked against the CLI)
    # flags the image's entrypoint carries after the command, so that a plain `podman run`
    # listens where its HEALTHCHECK looks (a later flag of the same name wins)
    image_flags: tuple[str, ...] = ()


def _serve(role: str, *args: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Listens on every interface; a service peers find in etcd advertises the pod's address."""
    where = ("--host", ANY) if role == "gateway" else ("--host", ANY, "--advertise-host", HOST)
    return ("kvmesh", "serve", role), ("--etcd", ETCD, *where, *args)


def _worker(role: str) -> Service:
    command, args = _serve(
        role,
        "--model",
        MODEL,
        "--port",
        str(GRPC_PORT),
        "--metrics-port",
        str(METRICS_PORT),
        "--drain-timeout",
        str(DRAIN_TIMEOUT_S),
    )
    return Service(
        role,
        command,
        args,
        {"grpc": GRPC_PORT, "metrics": METRICS_PORT},
        image_flags=("--port", str(GRPC_PORT), "--metrics-port", str(METRICS_PORT)),
    )


_gateway_command, _gateway_args = _serve(
    "gateway", "--model", MODEL, "--http-port", str(HTTP_PORT), "--grpc-port", str(GRPC_PORT)
)
_store_command, _store_args = _serve(
    "kvstore", "--port", str(GRPC_PORT), "--metrics-port", str(METRICS_PORT)
)
_draft_command, _draft_args = _serve(
    "draft", "--model", MODEL, "--port", str(GRPC_PORT), "--metrics-port", str(METRICS_PORT)
)

_PORT_FLAGS = ("--port", str(GRPC_PORT), "--metrics-port", str(METRICS_PORT))
_ETCD_FLAGS = (
    "--data-dir=/var/lib/etcd/data",
    f"--listen-client-urls=http://0.0.0.0:{ETCD_CLIENT_PORT}",
    f"--advertise-client-urls=http://127.0.0.1:{ETCD_CLIENT_PORT}",
)
_METRICS = {"grpc": GRPC_PORT, "metrics": METRICS_PORT}

SERVICES: tuple[Service, ...] = (
    Service(
        "gateway",
        _gateway_command,
        _gateway_args,
        {"http": HTTP_PORT, "grpc": GRPC_PORT},
        probe="http",
        image_flags=("--http-port", str(HTTP_PORT), "--grpc-port", str(GRPC_PORT)),
    ),
    _worker("prefill"),
    _worker("decode"),
    Service("kvstore", _store_command, _store_args, _METRICS, image_flags=_PORT_FLAGS),
    Service("draft", _draft_command, _draft_args, _METRICS, image_flags=_PORT_FLAGS),
    Service(
        "etcd",
        ("etcd",),
        (),
        {"client": ETCD_CLIENT_PORT, "peer": ETCD_PEER_PORT},
        probe="tcp",
        kvmesh_cli=False,
        image_flags=_ETCD_FLAGS,
    ),
    Service(
        "mooncake-master",
        ("mooncake_master",),
        (),
        {"rpc": MASTER_PORT},
        probe="tcp",
        kvmesh_cli=False,
        image_flags=(f"--rpc_port={MASTER_PORT}",),
    ),
)


def service(name: str) -> Service:
    return next(s for s in SERVICES if s.name == name)
