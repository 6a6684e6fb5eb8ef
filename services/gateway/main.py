"""The gateway process: REST (OpenAI) + gRPC Gateway, etcd watch, router, load polling."""

from __future__ import annotations

import asyncio

import structlog
import uvicorn

from kvmesh import event_loop
from kvmesh.config.gateway import ApiConfig, GatewayConfig
from kvmesh.engine.loader import read_config, resolve_model
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.mesh import metrics, tls
from kvmesh.mesh.addresses import host_port
from kvmesh.mesh.discovery import Registry, WorkerWatcher
from kvmesh.mesh.grpc_server import start_server
from kvmesh.mesh.kv_events import PrefixIndex
from kvmesh.mesh.service_runtime import stop_on_signals
from kvmesh.routing.prefix import KvEventFollower, PrefixLookup
from kvmesh.routing.router import AffinityPolicy, make_router
from kvmesh.routing.sessions import SessionStore
from services.gateway import grpc_api
from services.gateway.auth import ApiKeyInterceptor, ApiKeys
from services.gateway.mesh_backend import MeshBackend
from services.gateway.openai_api import create_app
from services.gateway.readiness import MeshReadiness, follow
from services.gateway.served import ModelNames, served_model

log = structlog.get_logger(__name__)
GATEWAY_SERVICE = "kvmesh.v1.Gateway"


def model_names(api: ApiConfig) -> ModelNames:
    return ModelNames(api.served_model_name, api.any_model)


async def serve_gateway(config: GatewayConfig) -> None:
    structlog.contextvars.bind_contextvars(service="gateway")
    metrics.init_series("gateway")
    service, api, streams = config.service, config.api, config.streams
    keys = ApiKeys.of(api.api_key, api.api_keys_file or None)
    guards = [ApiKeyInterceptor(keys, GATEWAY_SERVICE)] if keys is not None else []
    source = resolve_model(api.model)
    tokenizer = Tokenizer.from_source(source)
    model_config = read_config(source)
    parser, names = api.tool_call_parser or None, model_names(api)
    async with Registry(service.etcd, service.cluster) as registry:
        watcher = WorkerWatcher(registry)
        await watcher.start()
        index = PrefixIndex()
        routing = config.routing
        affinity = AffinityPolicy(routing.affinity_max_load_ratio, routing.affinity_slack_tokens)
        router = make_router(watcher.alive, routing.routing, PrefixLookup(index), affinity)
        follower = asyncio.create_task(KvEventFollower(index, watcher.alive).run())
        sessions = SessionStore(registry, routing.session_ttl)
        backend = MeshBackend(
            router,
            source.name,
            model_config.max_position_embeddings,
            sessions,
            streams.migration_limit,
            streams.max_inflight_requests,
        )
        counts = lambda: (len(watcher.alive("prefill")), len(watcher.alive("decode")))  # noqa: E731
        readiness = MeshReadiness(watcher.alive)
        served = served_model(
            backend.model_name, backend.max_model_len, tokenizer, config.limits, parser, names
        )
        grpc_server, grpc_port, health = await start_server(
            [grpc_api.add_to(grpc_api.GatewayServicer(backend, tokenizer, counts, served))],
            service.host,
            service.grpc_port,
            serving=False,  # until `follow` sees the workers a request needs
            client_certs=False,  # a front for clients: TLS (when on) without their certificates
            interceptors=guards,
        )
        http = uvicorn.Server(
            uvicorn.Config(
                create_app(
                    backend,
                    tokenizer,
                    config.limits,
                    readiness,
                    parser,
                    keys,
                    names,
                ),
                host=service.host,
                port=service.http_port,
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
            http=host_port(service.host, service.http_port),
            grpc=host_port(service.host, grpc_port),
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
    with stop_on_signals(stop):
        waiter = asyncio.create_task(stop.wait())
        await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
