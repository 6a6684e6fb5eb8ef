"""How long a step takes: a cost model over the shape of the step the real Scheduler planned.

Two kinds: `LinearCost`, fitted to a live mesh on this machine (calibrate.py), and
`RooflineCost`, the larger of a step's compute and memory time on a GPU node serving a
mixture-of-experts model (presets.py: H100 / H200 with a Kimi-K2-class model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvmesh.engine.core.scheduled import SchedulerOutput


@dataclass(frozen=True)
class StepShape:
    """What a step computes: decode rows (one new token each) and prefill chunks."""

    tokens: int  # tokens computed (every row)
    decode_rows: int  # rows of one token: a decode each
    decode_context: int  # sum over decode rows of the KV tokens each attends to
    prefill_context: int  # sum over prefill chunks of the KV tokens each chunk reads
    prefill_pairs: float  # sum over prefill chunks of (query, key) pairs its attention computes

    @property
    def prefill_tokens(self) -> int:
        return self.tokens - self.decode_rows

    @classmethod
    def of(cls, output: SchedulerOutput) -> StepShape:
        tokens = rows = context = chunk_context = 0
        pairs = 0.0
        for chunk in output.chunks:
            tokens += chunk.num_tokens
            end = chunk.start + chunk.num_tokens
            if chunk.num_tokens == 1:
                rows += 1
                context += end
            else:
                chunk_context += end
                pairs += chunk.num_tokens * (chunk.start + (chunk.num_tokens + 1) / 2)
        return cls(tokens, rows, context, chunk_context, pairs)


class CostModel(Protocol):
    name: str
    rpc_s: float  # one hop between services (gateway -> decode -> prefill and back)
    finish_s: float  # the last token's extra time to the gateway

    def step_s(self, shape: StepShape) -> float: ...

    def shared_slowdown(self, role: str) -> float:
        """How much longer a step of `role` takes while a worker on the same host computes
        (0: workers on hosts of their own)."""
        ...

    def transfer_s(self, pages: int, page_size: int) -> float:
        """Moving `pages` KV pages between two workers."""
        ...


@dataclass(frozen=True)
class LinearCost:
    """step = base + per_token * prompt tokens + per_row * decode rows + per_context * decode
    context + per_pair * prefill attention pairs; KV transfer per page; a fixed time per
    service hop."""

    name: str
    base_s: float
    per_token_s: float
    per_row_s: float
    per_context_s: float
    per_pair_s: float
    transfer_page_s: float
    rpc_s: float
    # Workers sharing one machine's CPUs: a step takes (1 + slowdown) times as long while
    # another worker of the host is in a step (decode's steps under prefill, and back).
    decode_slowdown: float = 0.0
    prefill_slowdown: float = 0.0
    finish_s: float = 0.0  # the last token's extra way to the gateway (beyond rpc_s)
    decode_scale: float = 1.0  # pure decode steps in a workload vs in the probes (tune.py)
    source: str = ""  # how the figures were obtained (command, date, machine)

    def shared_slowdown(self, role: str) -> float:
        return self.decode_slowdown if role == "decode" else self.prefill_slowdown

    def step_s(self, shape: StepShape) -> float:
        scale = self.decode_scale if shape.prefill_tokens == 0 else 1.0
        return scale * (
            self.base_s
            + self.per_token_s * shape.prefill_tokens
            + self.per_row_s * shape.decode_rows
            + self.per_context_s * shape.decode_context
            + self.per_pair_s * shape.prefill_pairs
        )

    def transfer_s(self, pages: int, page_size: int) -> float:
        return self.transfer_page_s * pages


@dataclass(frozen=True)
class Hardware:
    """One worker's devices: `gpus` of one kind (per-GPU figures), and its network for KV."""

    name: str
    gpus: int
    flops: float  # dense FLOP/s per GPU at the compute precision
    hbm_bytes_s: float  # per GPU
    hbm_bytes: float  # per GPU
    link_bytes_s: float  # KV between workers (RDMA NICs of the node, together)
    mfu: float = 0.5  # fraction of peak FLOP/s a step reaches
    mbu: float = 0.7  # fraction of peak memory bandwidth
    step_overhead_s: float = 0.010  # per step: launches, 2 all-to-alls a layer, sampling
    rpc_s: float = 0.0005


@dataclass(frozen=True)
class ModelShape:
    """A mixture-of-experts model as a roofline sees it."""

    name: str
    total_params: float
    active_params: float  # per token
    expert_params: float  # one routed expert over all its layers
    experts: int  # routed experts per MoE layer
    experts_per_token: int
    expert_weight_bytes: float  # per routed-expert parameter (INT4 with group scales: ~0.53)
    dense_weight_bytes: float  # per other parameter (attention, shared experts: BF16 = 2)
    kv_bytes_per_token: float  # all layers
    attn_flops_per_pair: float  # all layers, all heads: QK and PV of one (query, key) pair

    @property
    def always_read_params(self) -> float:
        """Parameters every step reads (attention, shared experts, embeddings, dense layers)."""
        return self.active_params - self.experts_per_token * self.expert_params

    @property
    def weight_bytes(self) -> float:
        routed = self.total_params - self.always_read_params
        return self.always_read_params * self.dense_weight_bytes + routed * self.expert_weight_bytes


@dataclass(frozen=True)
class RooflineCost:
    hardware: Hardware
    model: ModelShape

    @property
    def name(self) -> str:
        return f"{self.hardware.name}x{self.hardware.gpus}-{self.model.name}"

    finish_s = 0.0

    @property
    def rpc_s(self) -> float:
        return self.hardware.rpc_s

    def bounds(self, shape: StepShape) -> tuple[float, float]:
        """(compute time, memory time) of a step: the FLOPs of the active parameters and of
        attention; the bytes of the weights read (the routed experts the step's tokens touch:
        E * (1 - (1 - k/E)^tokens)) and of the KV read."""
        hw, m = self.hardware, self.model
        compute = 2 * m.active_params * shape.tokens + m.attn_flops_per_pair * (
            shape.prefill_pairs + shape.decode_context
        )
        touched = m.experts * (1 - (1 - m.experts_per_token / m.experts) ** shape.tokens)
        weights = (
            m.always_read_params * m.dense_weight_bytes
            + touched * m.expert_params * m.expert_weight_bytes
        )
        kv = (shape.decode_context + shape.prefill_context) * m.kv_bytes_per_token
        return (
            compute / (hw.gpus * hw.flops * hw.mfu),
            (weights + kv) / (hw.gpus * hw.hbm_bytes_s * hw.mbu),
        )

    def step_s(self, shape: StepShape) -> float:
        return max(self.bounds(shape)) + self.hardware.step_overhead_s

    def shared_slowdown(self, role: str) -> float:
        return 0.0  # one worker a node

    def transfer_s(self, pages: int, page_size: int) -> float:
        return pages * page_size * self.model.kv_bytes_per_token / self.hardware.link_bytes_s

    def kv_pages(self, page_size: int, activation_reserve: float = 0.1) -> int:
        """Pages of the worker's HBM left after the weights and a share for activations."""
        hw, m = self.hardware, self.model
        free = hw.gpus * hw.hbm_bytes * (1 - activation_reserve) - m.weight_bytes
        if free <= 0:
            raise ValueError(f"{m.name} does not fit {hw.gpus} x {hw.name}")
        return int(free // (page_size * m.kv_bytes_per_token))
