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


class FetchError(KvmeshError):
    code = "fetch_failed"
    user_error = True


class KvIntegrityError(KvmeshError):
    """A KV page a request was reading no longer carried the tag the request expected: the request
    was aborted instead of decoding from someone else's (or half-transferred) KV."""

    code = "kv_integrity"
    expose = True  # a server error whose message is safe and useful to show the client
