from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FeatureRows(_message.Message):
    __slots__ = ("start_position", "data", "rows", "width", "fused", "next_tokens")
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    FUSED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    start_position: int
    data: bytes
    rows: int
    width: int
    fused: bool
    next_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, start_position: _Optional[int] = ..., data: _Optional[bytes] = ..., rows: _Optional[int] = ..., width: _Optional[int] = ..., fused: _Optional[bool] = ..., next_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftInput(_message.Message):
    __slots__ = ("request_id", "committed", "num_draft_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    committed: FeatureRows
    num_draft_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., committed: _Optional[_Union[FeatureRows, _Mapping]] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("inputs",)
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[DraftInput]
    def __init__(self, inputs: _Optional[_Iterable[_Union[DraftInput, _Mapping]]] = ...) -> None: ...

class DraftOutput(_message.Message):
    __slots__ = ("request_id", "draft_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., draft_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[DraftOutput]
    def __init__(self, outputs: _Optional[_Iterable[_Union[DraftOutput, _Mapping]]] = ...) -> None: ...

class ReleaseDraftRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseDraftResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class GetDraftInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetDraftInfoResponse(_message.Message):
    __slots__ = ("target", "capture_layers", "window", "hidden_size", "draft_vocab_size")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    target: str
    capture_layers: _containers.RepeatedScalarFieldContainer[int]
    window: int
    hidden_size: int
    draft_vocab_size: int
    def __init__(self, target: _Optional[str] = ..., capture_layers: _Optional[_Iterable[int]] = ..., window: _Optional[int] = ..., hidden_size: _Optional[int] = ..., draft_vocab_size: _Optional[int] = ...) -> None: ...
