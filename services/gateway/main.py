"""The gateway process: REST (OpenAI) + gRPC Gateway, etcd watch, router, load polling."""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass

import structlog
import uvicorn

from kvmesh import event_loop
from kvmesh.engine.loader import read_config, resolve_model
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.mesh import metrics, tls
from kvmesh.mesh.addresses import host_port
from kvmesh.mesh.discovery import Registry, WorkerWatcher
from kvmesh.mesh.grpc_server import start_server
from kvmesh.mesh.kv_events import PrefixIndex
from kvmesh.routing.prefix import KvEventFollower, PrefixLookup
from kvmesh.routing.router import AffinityPolicy, make_router
from kvmesh.routing.sessions import SessionStore
from services.gateway import grpc_api
from services.gateway.auth import ApiKeyInterceptor, ApiKeys
from services.gateway.limits import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_N,
    MaxTokensPolicy,
    RequestLimits,
)
from services.gateway.mesh_backend import (
    DEFAULT_MAX_INFLIGHT,
    DEFAULT_MIGRATION_LIMIT,
    MeshBackend,
)
from services.gateway.openai_api import create_app
from services.gateway.readiness import MeshReadiness, follow
from services.gateway.served import ModelNames, served_model

log = structlog.get_logger(__name__)
GATEWAY_SERVICE = "kvmesh.v1.Gateway"


@dataclass(frozen=True)
class GatewayOptions:
    etcd: str
    cluster: str = "default"
    model: str = "smollm2-135m"
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 0
    session_ttl: int = 600
    affinity_max_load_ratio: float = 2.0
    affinity_slack_tokens: int = 2048
    routing: str = "cache-aware"  # one of router.ROUTINGS
    tool_call_parser: str | None = None  # None: chosen from the model's chat template
    migration_limit: int = DEFAULT_MIGRATION_LIMIT
    max_inflight_requests: int = DEFAULT_MAX_INFLIGHT
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_tokens: int = 0
    max_output_tokens: int = 0
    max_n: int = DEFAULT_MAX_N
    api_key: tuple[str, ...] | list[str] = ()  # --api-key (repeatable)
    api_keys_file: str | None = None
    served_model_name: tuple[str, ...] | list[str] = ()  # --served-model-name (repeatable)
    any_model: bool = False
    max_tokens_policy: MaxTokensPolicy = "clamp"

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(self.max_request_body_bytes, self.max_prompt_tokens,
                             self.max_output_tokens, self.max_n, self.max_tokens_policy)  # fmt: skip

    @property
    def names(self) -> ModelNames:
        return ModelNames(tuple(self.served_model_name), self.any_model)


async def serve_gateway(options: GatewayOptions) -> None:
    structlog.contextvars.bind_contextvars(service="gateway")
    metrics.init_series("gateway")
    keys = ApiKeys.of(options.api_key, options.api_keys_file)
    guards = [ApiKeyInterceptor(keys, GATEWAY_SERVICE)] if keys is not None else []
    source = resolve_model(options.model)
    tokenizer = Tokenizer.from_source(source)
    config = read_config(source)
    async with Registry(options.etcd, options.cluster) as registry:
        watcher = WorkerWatcher(registry)
        await watcher.start()
        index = PrefixIndex()
        affinity = AffinityPolicy(options.affinity_max_load_ratio, options.affinity_slack_tokens)
        router = make_router(watcher.alive, options.routing, PrefixLookup(index), affinity)
        follower = asyncio.create_task(KvEventFollower(index, watcher.alive).run())
        sessions = SessionStore(registry, options.session_ttl)
        backend = MeshBackend(router, source.name, config.max_position_embeddings, sessions,
                              options.migration_limit, options.max_inflight_requests)  # fmt: skip
        counts = lambda: (len(watcher.alive("prefill")), len(watcher.alive("decode")))  # noqa: E731
        readiness = MeshReadiness(watcher.alive)
        served = served_model(backend.model_name, backend.max_model_len, tokenizer,
                              options.limits, options.tool_call_parser, options.names)  # fmt: skip
        grpc_server, grpc_port, health = await start_server(
            [grpc_api.add_to(grpc_api.GatewayServicer(backend, tokenizer, counts, served))],
            options.host,
            options.grpc_port,
            serving=False,  # until `follow` sees the workers a request needs
            client_certs=False,  # a front for clients: TLS (when on) without their certificates
            interceptors=guards,
        )
        http = uvicorn.Server(
            uvicorn.Config(
                create_app(
                    backend,
                    tokenizer,
                    options.limits,
                    readiness,
                    options.tool_call_parser,
                    keys,
                    options.names,
                ),  # fmt: skip
                host=options.host,
                port=options.http_port,
                log_level="warning",
                lifespan="off",
                **_https(),
            )
        )
        http.install_signal_handlers = lambda: None  # we own SIGTERM/SIGINT
        poller = asyncio.create_task(router.poll_loads())
        health_follower = asyncio.create_task(follow(readiness, health))
        serving = asyncio.create_task(http.serve())
        log.info(
            "gateway.listening",
            http=host_port(options.host, options.http_port),
            grpc=host_port(options.host, grpc_port),
        )
        event_loop.freeze_heap()
        try:
            await _wait_for_signal_or(serving)
        finally:
            http.should_exit = True
            health_follower.cancel()
            await health.shutdown()
            poller.cancel()
            follower.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            backend.close()
            await grpc_server.stop(grace=2)
            await watcher.stop()


def _https() -> dict[str, str]:
    """uvicorn's TLS settings when this process has a certificate (--tls-cert ...)."""
    files = tls.current()
    if files is None:
        return {}
    return {"ssl_certfile": str(files.cert), "ssl_keyfile": str(files.key)}


async def _wait_for_signal_or(task: asyncio.Task) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
