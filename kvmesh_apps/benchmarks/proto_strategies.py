"""Hypothesis strategies for any protobuf message, built from its descriptor: every field set or
not, numbers across their whole range, strings and bytes of any content, nested and repeated
fields. Address-like string fields only ever name loopback (a fuzzed address must not send a
worker's traffic anywhere else)."""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

_ADDRESS_WORDS = ("address", "session", "endpoint")
_LOCAL = st.sampled_from(
    [
        "",
        "127.0.0.1:1",
        "127.0.0.1:9",
        "localhost:0",
        "127.0.0.1",
        ":",
        "not-an-address",
        "127.0.0.1:99999",
    ]
)
_INTS = {
    FieldDescriptor.TYPE_INT32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: st.integers(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: st.integers(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: st.integers(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: st.integers(0, 2**32 - 1) | st.integers(0, 64),
    FieldDescriptor.TYPE_FIXED32: st.integers(0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: st.integers(0, 2**64 - 1) | st.integers(0, 64),
    FieldDescriptor.TYPE_FIXED64: st.integers(0, 2**64 - 1),
}


def message(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    """Keyword arguments for the message's constructor."""
    fields = {}
    for field in descriptor.fields:
        value = _value(field, depth)
        if value is None:
            continue
        if field.is_repeated:
            value = st.lists(value, max_size=3 if field.message_type else 40)
        fields[field.name] = value
    return st.fixed_dictionaries({}, optional=fields)


def _value(field: FieldDescriptor, depth: int) -> st.SearchStrategy | None:
    if field.message_type is not None:
        if field.message_type.GetOptions().map_entry or depth > 3:
            return None
        cls = GetMessageClass(field.message_type)
        return message(field.message_type, depth + 1).map(lambda fields: cls(**fields))
    if field.type == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values])
    if field.type == FieldDescriptor.TYPE_STRING:
        if any(word in field.name for word in _ADDRESS_WORDS):
            return _LOCAL
        return st.text(max_size=64)
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return st.floats(allow_nan=True, allow_infinity=True, width=32)
    return _INTS[field.type]
