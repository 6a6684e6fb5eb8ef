from kvmesh.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "prefill_address", "cache_salt", "delivery_id", "resume_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    prefill_address: str
    cache_salt: str
    delivery_id: str
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., prefill_address: _Optional[str] = ..., cache_salt: _Optional[str] = ..., delivery_id: _Optional[str] = ..., resume_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "finish_reason", "usage", "error", "first_index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FIRST_INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    error: _common_pb2.Error
    first_index: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., first_index: _Optional[int] = ...) -> None: ...

class DeliverRequest(_message.Message):
    __slots__ = ("delivery_id",)
    DELIVERY_ID_FIELD_NUMBER: _ClassVar[int]
    delivery_id: str
    def __init__(self, delivery_id: _Optional[str] = ...) -> None: ...

class DecodeResponses(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[DecodeResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[DecodeResponse, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class GetLoadsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SubscribeKvEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    cleared: bool
    def __init__(self, stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ..., cleared: _Optional[bool] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("worker_id", "snapshot", "events")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    snapshot: bool
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    def __init__(self, worker_id: _Optional[str] = ..., snapshot: _Optional[bool] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ...) -> None: ...

class GetLoadsResponse(_message.Message):
    __slots__ = ("loads",)
    LOADS_FIELD_NUMBER: _ClassVar[int]
    loads: _containers.RepeatedCompositeFieldContainer[_common_pb2.WorkerLoad]
    def __init__(self, loads: _Optional[_Iterable[_Union[_common_pb2.WorkerLoad, _Mapping]]] = ...) -> None: ...
