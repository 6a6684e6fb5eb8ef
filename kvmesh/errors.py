"""The typed error family. Mapped to exit codes / gRPC status / OpenAI error JSON in one place each."""

from __future__ import annotations


class KvmeshError(Exception):
    """Base of every error kvmesh raises on purpose. `code` is a stable machine-readable name."""

    code = "internal_error"
    user_error = False  # True: caused by the caller's input; shown without a traceback
    expose = False  # server errors: True when the message may be shown to API clients


class InvalidRequestError(KvmeshError):
    code = "invalid_request_error"
    user_error = True


class ContextLengthError(InvalidRequestError):
    code = "context_length_exceeded"


class ModelNotFoundError(KvmeshError):
    code = "model_not_found"
    user_error = True


class ModelFormatError(KvmeshError):
    """The model file exists but is corrupt or uses something we do not support."""

    code = "unsupported_model"
    user_error = True


class CapacityError(KvmeshError):
    """The KV pool cannot hold even one request of this size."""

    code = "insufficient_capacity"
    user_error = True


class AuthenticationError(KvmeshError):
    """No API key, or one the gateway does not know (HTTP 401, gRPC UNAUTHENTICATED)."""

    code = "invalid_api_key"
    expose = True
    user_error = True


class OverloadedError(KvmeshError):
    """Over capacity right now (a queue bound reached): retry later (HTTP 429, gRPC
    RESOURCE_EXHAUSTED). Unlike CapacityError the request itself is fine."""

    code = "overloaded"
    expose = True
    retry_after_s = 1


class PrefillOverloadedError(OverloadedError):
    """The prefill worker a decode worker asked was at its limit (the gateway picks another)."""

    code = "prefill_overloaded"


class DeadlineExceededError(KvmeshError):
    """The request's deadline (x-request-timeout, a gRPC deadline) passed before it finished."""

    code = "deadline_exceeded"
    expose = True


class FetchError(KvmeshError):
    code = "fetch_failed"
    user_error = True


class KvIntegrityError(KvmeshError):
    """A KV page a request was reading no longer carried the tag the request expected: the request
    was aborted instead of decoding from someone else's (or half-transferred) KV."""

    code = "kv_integrity"
    expose = True  # a server error whose message is safe and useful to show the client


class WorkerUnavailableError(KvmeshError):
    """A worker could not be reached or failed mid-request (a gRPC UNAVAILABLE on the client)."""

    code = "worker_unavailable"


class PayloadTooLargeError(InvalidRequestError):
    """The request body is larger than the server accepts."""

    code = "payload_too_large"


class RequestAbortedError(KvmeshError):
    """The request was aborted on the worker (an Abort call, a drain) before it finished: not
    the caller's fault, and another worker may run it (gRPC CANCELLED)."""

    code = "request_aborted"


class EngineFailure(KvmeshError):
    code = "engine_failure"


class PrefillUnavailable(WorkerUnavailableError):
    """A decode worker's prefill worker failed or vanished; the gateway may retry the request
    with another prefill worker (the decode worker itself is fine)."""

    code = "prefill_unavailable"


class TransferError(KvmeshError):
    """A KV transfer engine call failed (init, registration or a page transfer)."""

    code = "kv_transfer_failed"


class EtcdError(KvmeshError):
    code = "etcd_unavailable"


class DiscoveryError(KvmeshError):
    code = "discovery_unavailable"


class EtcdAuthError(DiscoveryError):
    """etcd refused this process's login or its certificate's user: a setting to fix."""

    code = "etcd_auth_failed"
    user_error = True


class WorkerInfoError(DiscoveryError):
    code = "invalid_worker_info"


_RESERVE_HUGEPAGES = (
    "reserve them (sysctl vm.nr_hugepages; a pod's hugepages-2Mi resource) or drop --kv-hugepages"
)


class HugePagesError(KvmeshError):
    """--kv-hugepages: too few 2 MiB hugepages free for the KV page pool (an operator's
    setting: the worker stops at start with this message)."""

    code = "hugepages_unavailable"
    user_error = True

    @classmethod
    def short_of(cls, needed: int, cause: OSError) -> HugePagesError:
        return cls(
            f"the KV page pool needs {needed} free 2 MiB hugepages ({cause.strerror}): "
            + _RESERVE_HUGEPAGES
        )

    @classmethod
    def none_free(cls) -> HugePagesError:
        return cls(
            "--kv-hugepages: this machine has no free 2 MiB hugepages: " + _RESERVE_HUGEPAGES
        )


class PortError(KvmeshError):
    code = "no_free_port"


class MooncakeMasterError(KvmeshError):
    code = "mooncake_master_unavailable"


class MooncakeTierError(KvmeshError):
    code = "mooncake_store_unavailable"


class LayoutMismatchError(InvalidRequestError):
    """The caller's pages have another layout (model, page size, KV dtype) or size."""

    code = "kv_layout_mismatch"


class ReservationNotFoundError(InvalidRequestError):
    """Commit of a reservation that never existed, was committed already, or expired."""

    code = "reservation_not_found"


class LaunchError(KvmeshError):
    code = "launch_failed"
    user_error = True


class NoMeshError(KvmeshError):
    code = "mesh_not_found"
    user_error = True


class ServeBenchError(KvmeshError):
    code = "bench_failed"
