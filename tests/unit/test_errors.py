"""The error family lives in kvmesh/errors.py and maps to statuses in one place."""

from __future__ import annotations

import importlib
import pkgutil

import grpc

import kvmesh
import services
from kvmesh.errors import (
    KvmeshError,
    PrefillUnavailable,
    RequestAbortedError,
    WorkerUnavailableError,
)
from kvmesh.mesh.error_mapping import error_from_code, error_from_grpc, grpc_status, http_status

# generated / needs triton / the ops' shapes, imported by kernels/__init__ once the library loads
SKIP = (
    "kvmesh.proto",
    "kvmesh.engine.kernels.gpu",
    "kvmesh.engine.attention.triton_paged",
    "kvmesh.engine.kernels.fake",
)


def _all_subclasses(cls: type) -> list[type]:
    found, pending = [], [cls]
    while pending:
        sub = pending.pop()
        found.append(sub)
        pending.extend(sub.__subclasses__())
    return found


def test_every_error_class_is_defined_in_errors_py():
    for package in (kvmesh, services):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if not info.name.startswith(SKIP) and not info.name.endswith("__main__"):
                importlib.import_module(info.name)
    outside = [
        c.__qualname__ for c in _all_subclasses(KvmeshError) if c.__module__ != "kvmesh.errors"
    ]
    assert outside == []
    codes = [c.code for c in _all_subclasses(KvmeshError)]
    assert len(codes) == len(set(codes)), sorted(codes)


def test_a_failed_prefill_is_a_retryable_server_error_not_a_client_error():
    exc = PrefillUnavailable("prefill worker 127.0.0.1:1: connection refused")
    assert isinstance(exc, WorkerUnavailableError)
    assert http_status(exc) == 503
    assert grpc_status(exc) == grpc.StatusCode.UNAVAILABLE
    assert isinstance(error_from_code(exc.code, str(exc)), PrefillUnavailable)
    back = error_from_grpc(grpc.StatusCode.UNAVAILABLE, f"{exc.code}: {exc}")
    assert isinstance(back, PrefillUnavailable) and str(back) == str(exc)


def test_an_aborted_prefill_is_a_cancelled_request_not_a_client_error():
    exc = RequestAbortedError("prefill of r1 was aborted")
    assert http_status(exc) == 503 and grpc_status(exc) == grpc.StatusCode.CANCELLED
    back = error_from_grpc(grpc.StatusCode.CANCELLED, f"{exc.code}: {exc}")
    assert isinstance(back, RequestAbortedError)
