"""OpenTelemetry traces across the mesh: gateway -> decode -> prefill -> transfer, one trace per
request, the W3C trace context carried in gRPC metadata (`traceparent`). Off unless an exporter
is chosen: `OTEL_TRACES_EXPORTER=otlp` (OTLP over gRPC to `OTEL_EXPORTER_OTLP_ENDPOINT`; needs the
`otel` extra), `console`, or `KVMESH_OTEL_FILE=<path>` (spans as JSON, one per line, appended:
what the tests read). Without one every span below is the API's no-op."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context

_TRACER = "kvmesh"


def setup(service: str) -> bool:
    """Install a tracer provider for this process when an exporter is asked for; True then."""
    exporter = _exporter()
    if exporter is None:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": f"kvmesh-{service}"}))
    simple = os.environ.get("KVMESH_OTEL_FILE")  # a file: each span written as it ends
    provider.add_span_processor(
        SimpleSpanProcessor(exporter) if simple else BatchSpanProcessor(exporter)
    )
    trace.set_tracer_provider(provider)
    return True


def _exporter():
    path = os.environ.get("KVMESH_OTEL_FILE")
    if path:
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        out = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
        return ConsoleSpanExporter(out=out, formatter=lambda span: _one_line(span.to_json()))
    kind = os.environ.get("OTEL_TRACES_EXPORTER", "none").lower()
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if kind == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise RuntimeError(
                "OTEL_TRACES_EXPORTER=otlp needs the OTLP exporter: pip install 'kvmesh[otel]'"
            ) from exc
        return OTLPSpanExporter()
    return None


def _one_line(text: str) -> str:
    return json.dumps(json.loads(text), separators=(",", ":")) + "\n"


def tracer() -> trace.Tracer:
    return trace.get_tracer(_TRACER)


@contextlib.contextmanager
def span(name: str, parent: Context | None = None, **attributes: Any) -> Iterator[trace.Span]:
    """A span of this process, current inside the block (a child of `parent`, else of the
    current span). In an async generator, whose steps may run in other contexts, use
    `start_span` and pass the span on instead."""
    with tracer().start_as_current_span(name, context=parent, attributes=attributes) as current:
        yield current


def start_span(
    name: str, parent: trace.Span | Context | None = None, **attributes: Any
) -> trace.Span:
    """A span not made current: the caller ends it (`span.end()`) and passes it on."""
    if isinstance(parent, trace.Span):
        parent = trace.set_span_in_context(parent)
    return tracer().start_span(name, context=parent, attributes=attributes)


def outgoing_metadata(parent: trace.Span | None = None) -> list[tuple[str, str]]:
    """The trace context (of `parent`, else the current one) as gRPC metadata for a call this
    process makes."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=None if parent is None else trace.set_span_in_context(parent))
    return list(carrier.items())


def incoming_context(metadata: Sequence[tuple[str, str]] | Mapping[str, str] | None) -> Context:
    """The caller's trace context from a call's metadata (an empty one if it sent none)."""
    return propagate.extract(dict(metadata or ()))
