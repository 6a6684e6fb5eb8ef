from kvmesh.proto.v1 import common_pb2 as _common_pb2
from kvmesh.proto.v1 import decode_pb2 as _decode_pb2
from kvmesh.proto.v1 import draft_pb2 as _draft_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvDestination(_message.Message):
    __slots__ = ("te_session", "pool_address", "page_bytes", "page_ids", "skip_pages", "page_size", "kv_dtype", "tags_address", "page_tags", "shards")
    TE_SESSION_FIELD_NUMBER: _ClassVar[int]
    POOL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TAGS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PAGE_TAGS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    te_session: str
    pool_address: int
    page_bytes: int
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_pages: int
    page_size: int
    kv_dtype: str
    tags_address: int
    page_tags: _containers.RepeatedScalarFieldContainer[int]
    shards: _containers.RepeatedCompositeFieldContainer[KvShard]
    def __init__(self, te_session: _Optional[str] = ..., pool_address: _Optional[int] = ..., page_bytes: _Optional[int] = ..., page_ids: _Optional[_Iterable[int]] = ..., skip_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., tags_address: _Optional[int] = ..., page_tags: _Optional[_Iterable[int]] = ..., shards: _Optional[_Iterable[_Union[KvShard, _Mapping]]] = ...) -> None: ...

class KvShard(_message.Message):
    __slots__ = ("address", "starts", "stops", "te_session")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STARTS_FIELD_NUMBER: _ClassVar[int]
    STOPS_FIELD_NUMBER: _ClassVar[int]
    TE_SESSION_FIELD_NUMBER: _ClassVar[int]
    address: int
    starts: _containers.RepeatedScalarFieldContainer[int]
    stops: _containers.RepeatedScalarFieldContainer[int]
    te_session: str
    def __init__(self, address: _Optional[int] = ..., starts: _Optional[_Iterable[int]] = ..., stops: _Optional[_Iterable[int]] = ..., te_session: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "destination", "cache_salt", "resume_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    destination: KvDestination
    cache_salt: str
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., destination: _Optional[_Union[KvDestination, _Mapping]] = ..., cache_salt: _Optional[str] = ..., resume_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "first_logprob", "cached_tokens", "bytes_transferred", "pages_transferred", "draft_window")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_TRANSFERRED_FIELD_NUMBER: _ClassVar[int]
    PAGES_TRANSFERRED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    first_logprob: _common_pb2.TokenLogprob
    cached_tokens: int
    bytes_transferred: int
    pages_transferred: int
    draft_window: _draft_pb2.FeatureRows
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., bytes_transferred: _Optional[int] = ..., pages_transferred: _Optional[int] = ..., draft_window: _Optional[_Union[_draft_pb2.FeatureRows, _Mapping]] = ...) -> None: ...
