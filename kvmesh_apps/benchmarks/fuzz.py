"""Fuzzing a live mesh: the gateway's REST API from its own OpenAPI document (schemathesis
generates the requests, thousands with `kvmesh bench fuzz`) and every gRPC service's methods with
protobuf messages hypothesis builds from their descriptors. What counts: no 5xx, no hang, every
response shaped as documented, no gRPC call ending UNKNOWN (an unhandled exception) -- and the
services still serve afterwards. Needs the test extras (schemathesis, hypothesis)."""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass

from kvmesh_apps.benchmarks.fuzz_report import REST_TIMEOUT_S, FuzzReport
from kvmesh_apps.benchmarks.report import BenchRun, write_report

GRPC_TIMEOUT_S = 2.0  # unary calls
GRPC_STREAM_TIMEOUT_S = 0.3  # streams (some never end on their own: Deliver, SubscribeKvEvents)


def fuzz_rest(
    base_url: str, examples: int, headers: dict[str, str] | None = None, seed: int = 0
) -> FuzzReport:
    """`examples` generated requests per operation of the gateway's /openapi.json."""
    import schemathesis

    report = FuzzReport()
    started = time.monotonic()
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    for result in schema.get_all_operations():
        _fuzz_operation(result.ok(), base_url, headers, examples, seed, report)
    report.seconds = time.monotonic() - started
    return report


def _fuzz_operation(
    operation,
    base_url: str,
    headers: dict[str, str] | None,
    examples: int,
    seed: int,
    report: FuzzReport,
) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as fixed_seed
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    @fixed_seed(seed)
    @settings(
        max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(case=operation.as_strategy())
    def run(case) -> None:
        report.requests += 1
        try:
            response = case.call(base_url=base_url, headers=headers, timeout=REST_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a hang or a dropped connection is the finding
            report.fail(f"{operation.label}: no answer: {exc!r}")
            return
        report.outcomes[response.status_code] += 1
        try:  # a schema-valid request may still be refused (an unknown model, n > context)
            case.validate_response(response, excluded_checks=[positive_data_acceptance])
        except Exception as exc:  # noqa: BLE001 - schemathesis' check failures, collected
            report.fail(
                f"{operation.label} -> {response.status_code}: {str(exc).splitlines()[0][:300]}"
            )

    run()


def fuzz_grpc(
    targets: list[tuple[str, ServiceDescriptor]],
    examples: int,
    credentials: grpc.ChannelCredentials | None = None,
) -> FuzzReport:
    """`examples` generated messages per method of each (address, service)."""
    report = FuzzReport()
    started = time.monotonic()
    for address, service in targets:
        with (
            grpc.insecure_channel(address)
            if credentials is None
            else grpc.secure_channel(address, credentials)
        ) as channel:
            for method in service.methods:
                _fuzz_method(channel, service, method, examples, report)
    report.seconds = time.monotonic() - started
    return report


def _fuzz_method(
    channel: grpc.Channel, service: ServiceDescriptor, method, examples: int, report: FuzzReport
) -> None:
    from hypothesis import HealthCheck, given, settings

    from kvmesh_apps.benchmarks.proto_strategies import message

    request_cls = GetMessageClass(method.input_type)
    response_cls = GetMessageClass(method.output_type)
    path = f"/{service.full_name}/{method.name}"
    make = channel.unary_stream if method.server_streaming else channel.unary_unary
    call = make(
        path,
        request_serializer=request_cls.SerializeToString,
        response_deserializer=response_cls.FromString,
    )

    @settings(
        max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(fields=message(method.input_type))
    def run(fields) -> None:
        report.requests += 1
        code = _invoke(call, request_cls(**fields), method.server_streaming)
        report.outcomes[code.name] += 1
        if code == grpc.StatusCode.UNKNOWN:
            report.fail(f"{path}: {code.name} for {fields!r}"[:400])

    run()


def _invoke(call, request, streaming: bool) -> grpc.StatusCode:
    timeout = GRPC_STREAM_TIMEOUT_S if streaming else GRPC_TIMEOUT_S
    try:
        if streaming:
            for _ in call(request, timeout=timeout):
                pass
        else:
            call(request, timeout=timeout)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument(
        "--rest-examples",
        type=int,
        default=400,
        help="generated requests per REST operation (8 operations)",
    )
    parser.add_argument(
        "--grpc-examples",
        type=int,
        default=150,
        help="generated messages per gRPC method (gateway, decode, prefill, KV store)",
    )
    parser.add_argument("--output", default=None, help="also write the JSON results here")


def run_fuzz_bench(args: argparse.Namespace) -> int:
    """A mesh (1 prefill, 1 decode, KV store; outputs capped at 4 tokens so thousands of requests
    fit in minutes), fuzzed over REST then gRPC, then asked one plain question."""
    from kvmesh.mesh.launcher import Mesh, UpOptions, list_workers
    from kvmesh.mesh.up_config import gateway_config, worker_configs
    from kvmesh.proto.v1 import decode_pb2, gateway_pb2, kvstore_pb2, prefill_pb2
    from kvmesh_apps.benchmarks.fuzz_edges import fuzz_edges

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    run = BenchRun()
    mesh = Mesh(
        UpOptions(
            workers=worker_configs("--model", args.model),
            prefill=1,
            decode=1,
            kvstore="builtin",
            gateway=gateway_config("--max-output-tokens", "4"),
        )
    )
    try:
        mesh.start()
        rest = fuzz_rest(mesh.url, args.rest_examples)
        print(f"REST: {_summary(rest)}", flush=True)
        edges = fuzz_edges(mesh.url, args.model)
        print(f"REST edges: {_summary(edges)}", flush=True)
        workers = {w.role: w for w in asyncio.run(list_workers(mesh.etcd.endpoint, "default"))}
        targets = [
            (f"127.0.0.1:{mesh.grpc_port}", gateway_pb2.DESCRIPTOR.services_by_name["Gateway"]),
            (workers["decode"].grpc_address, decode_pb2.DESCRIPTOR.services_by_name["Decode"]),
            (workers["prefill"].grpc_address, prefill_pb2.DESCRIPTOR.services_by_name["Prefill"]),
            (workers["kvstore"].grpc_address, kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"]),
        ]
        rpc = fuzz_grpc(targets, args.grpc_examples)
        print(f"gRPC: {_summary(rpc)}", flush=True)
        alive = all(proc.poll() is None for proc in mesh.procs.values())
    finally:
        mesh.stop()
    report = {
        **run.header(),
        "rest": _as_dict(rest),
        "rest_edges": _as_dict(edges),
        "grpc": _as_dict(rpc),
        "services_alive_after": alive,
    } | run.footer()
    write_report(report, args.output)
    return 0 if alive and not (rest.failures or edges.failures or rpc.failures) else 1


def _summary(report: FuzzReport) -> str:
    return (
        f"{report.requests} requests in {report.seconds:.0f} s, outcomes "
        f"{dict(sorted(report.outcomes.items(), key=str))}, {len(report.failures)} failures"
    )


def _as_dict(report: FuzzReport) -> dict:
    return {
        "requests": report.requests,
        "seconds": round(report.seconds, 1),
        "outcomes": {str(k): v for k, v in report.outcomes.items()},
        "failures": report.failures,
    }
