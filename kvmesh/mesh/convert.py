"""Proto <-> domain conversions shared by every service (one place, no logic)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmesh.engine.core.outputs import TokenLogprob
from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.core.sequence import FinishReason
from kvmesh.engine.kv.pool_layout import PageSide, PoolLayout, PoolShard
from kvmesh.proto.v1 import common_pb2 as pb
from kvmesh.proto.v1 import draft_pb2, prefill_pb2

if TYPE_CHECKING:  # the gateway imports this module and needs no torch
    import torch

_FINISH_TO_PB = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}
_FINISH_FROM_PB = {v: k for k, v in _FINISH_TO_PB.items()}


def sampling_to_pb(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.grammar is not None:
        msg.grammar = p.grammar
    msg.logit_bias.update(dict(p.logit_bias))
    return msg


def sampling_from_pb(msg: pb.SamplingParams, stop: tuple[str, ...] = ()) -> SamplingParams:
    """Defaults for unset optional fields; raises InvalidRequestError on bad values."""
    return SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else 16,
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k,
        min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        stop=stop,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        grammar=msg.grammar if msg.HasField("grammar") else None,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
    )


def logprob_to_pb(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        rank=lp.rank,
        top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def logprob_from_pb(msg: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(
        msg.token_id, msg.logprob, msg.rank, tuple((t.token_id, t.logprob) for t in msg.top)
    )


def finish_to_pb(reason: FinishReason | None) -> int:
    return (
        _FINISH_TO_PB.get(reason, pb.FINISH_REASON_UNSPECIFIED)
        if reason
        else pb.FINISH_REASON_UNSPECIFIED
    )


def finish_from_pb(value: int) -> FinishReason | None:
    return _FINISH_FROM_PB.get(value)


def feature_rows_to_pb(
    rows: torch.Tensor, start: int, next_tokens: list[int], fused: bool
) -> draft_pb2.FeatureRows:
    """Float rows [n, width] as float16 bytes."""
    import torch

    data = rows.detach().to(torch.float16).contiguous().numpy().tobytes()
    return draft_pb2.FeatureRows(
        start_position=start,
        data=data,
        rows=rows.shape[0],
        width=rows.shape[1],
        fused=fused,
        next_tokens=next_tokens,
    )


def feature_rows_from_pb(msg: draft_pb2.FeatureRows) -> torch.Tensor:
    """[rows, width] float32."""
    import torch

    flat = torch.frombuffer(bytearray(msg.data), dtype=torch.float16)
    return flat.view(msg.rows, msg.width).float()


def shards_to_pb(layout: PoolLayout) -> list[prefill_pb2.KvShard]:
    """A sharded pool's shards as KvDestination.shards (byte spans of the whole page)."""
    return [
        prefill_pb2.KvShard(
            address=s.address,
            starts=[r.start for r in s.spans],
            stops=[r.stop for r in s.spans],
            te_session=s.session,
        )
        for s in layout.shards
    ]


def destination_side(dest: prefill_pb2.KvDestination, pages: list[int]) -> PageSide:
    """`pages` of a decode worker's pool as one side of a copy: whole pages at pool_address, or
    its shards (a tensor-parallel worker)."""
    if not dest.shards:
        return PageSide.whole(
            [dest.pool_address + p * dest.page_bytes for p in pages], dest.page_bytes
        )
    spans = tuple(shard_spans_of(s) for s in dest.shards)
    sizes = [sum(len(r) for r in s) for s in spans]
    return PageSide(
        spans,
        tuple(
            tuple(s.address + p * n for p in pages) for s, n in zip(dest.shards, sizes, strict=True)
        ),
    )


def shard_sessions(dest: prefill_pb2.KvDestination) -> list[str]:
    """The transfer session that reaches each shard of the destination (one for whole pages)."""
    if not dest.shards:
        return [dest.te_session]
    return [s.te_session or dest.te_session for s in dest.shards]


def shard_spans_of(shard: prefill_pb2.KvShard) -> tuple[range, ...]:
    if len(shard.starts) != len(shard.stops) or not shard.starts:
        raise ValueError("a shard needs as many span starts as stops, at least one")
    return tuple(range(a, b) for a, b in zip(shard.starts, shard.stops, strict=True))


MAX_SHARDS = 64  # ranks of one worker (16 today)
MAX_SPANS = 1024  # spans of one shard: 2 per KV head and stage at most


def check_shards(dest: prefill_pb2.KvDestination) -> None:
    """ValueError unless the destination's shards hold every byte of its pages, each in
    ordered, disjoint spans inside the page (bounded: the copy plan grows with them)."""
    if len(dest.shards) > MAX_SHARDS:
        raise ValueError(f"{len(dest.shards)} shards (at most {MAX_SHARDS})")
    shards = [PoolShard(s.address, shard_spans_of(s)) for s in dest.shards]
    for shard in shards:
        spans = shard.spans
        if len(spans) > MAX_SPANS or any(len(r) < 1 for r in spans):
            raise ValueError(f"a shard of {len(spans)} spans (1..{MAX_SPANS}, none empty)")
        if any(a.stop > b.start for a, b in zip(spans, spans[1:], strict=False)):
            raise ValueError("a shard's spans must be ordered and disjoint")
    PoolLayout(tuple(shards), dest.page_bytes)
