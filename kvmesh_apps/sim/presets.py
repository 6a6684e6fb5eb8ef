"""What a simulated worker is (pool and batch limits) and the cost presets.

Roofline presets: one worker = one 8-GPU node serving a Kimi-K2-class model (1.03 T parameters,
32 B active, 384 routed experts of which 8 per token, 61 layers, MLA: 576 cached values per
token and layer) with INT4 routed experts (0.53 bytes a parameter with group scales) and BF16
for the rest (attention, shared experts, embeddings: 11.5 B parameters), an FP8 KV cache
(35,136 bytes a token), 64-token pages (FlashMLA's). Device figures are the published dense
BF16 peaks: H100 SXM 989 TFLOP/s, 3.35 TB/s, 80 GB; H200 989 TFLOP/s, 4.8 TB/s, 141 GB; eight
400 Gb/s NICs per node for KV. A fitted preset is the JSON file `kvmesh sim calibrate` writes
(`--preset FILE`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from kvmesh.errors import InvalidRequestError
from kvmesh_apps.sim.cost import CostModel, Hardware, LinearCost, ModelShape, RooflineCost


@dataclass(frozen=True)
class WorkerSpec:
    """A worker's KV pool and scheduler limits (the engine scheduler's SchedulerLimits fields)."""

    kv_pages: int
    page_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    local_prefill_tokens: int = 0  # decode computes prompts up to this long itself


@dataclass(frozen=True)
class Preset:
    cost: CostModel
    worker: WorkerSpec
    model: str  # the model name the prompts' block hashes are salted with
    kv_dtype: str
    shared_host: bool = False  # every worker on one machine (a fitted preset), else one a node


KIMI_K2 = ModelShape(
    name="kimi-k2",
    total_params=1.03e12,
    active_params=32.6e9,
    expert_params=2.64e9,
    experts=384,
    experts_per_token=8,
    expert_weight_bytes=0.53,
    dense_weight_bytes=2.0,
    kv_bytes_per_token=(512 + 64) * 61,
    attn_flops_per_pair=2 * (576 + 512) * 64 * 61,
)
H100 = Hardware("h100", 8, flops=989e12, hbm_bytes_s=3.35e12, hbm_bytes=80e9, link_bytes_s=400e9)
H200 = Hardware("h200", 8, flops=989e12, hbm_bytes_s=4.8e12, hbm_bytes=141e9, link_bytes_s=400e9)
ROOFLINES = {"h100-kimi-k2": (H100, KIMI_K2), "h200-kimi-k2": (H200, KIMI_K2)}
ROOFLINE_PAGE = 64


def preset_names() -> list[str]:
    return list(ROOFLINES)


def load_preset(
    name: str,
    kv_pages: int | None = None,
    max_num_seqs: int | None = None,
    local_prefill_tokens: int | None = None,
) -> Preset:
    """A preset by name, or a LinearCost JSON file by path (its worker fields inside it); the
    worker fields given override the preset's."""
    preset = _load(name)
    changes = {
        "kv_pages": kv_pages,
        "max_num_seqs": max_num_seqs,
        "local_prefill_tokens": local_prefill_tokens,
    }
    worker = replace(preset.worker, **{k: v for k, v in changes.items() if v is not None})
    return replace(preset, worker=worker)


def _load(name: str) -> Preset:
    if name in ROOFLINES:
        cost = RooflineCost(*ROOFLINES[name])
        spec = WorkerSpec(cost.kv_pages(ROOFLINE_PAGE), ROOFLINE_PAGE, 256, 8192, 131072)
        return Preset(cost, spec, "kimi-k2", "fp8")
    path = Path(name)
    if not path.is_file():
        raise InvalidRequestError(
            f"unknown cost preset {name!r}: one of {', '.join(preset_names())} "
            "or a JSON file from `kvmesh sim calibrate`"
        )
    try:
        raw = json.loads(path.read_text())
        worker, mesh = raw.pop("worker"), raw.pop("mesh")
        cost = LinearCost(**{k: v for k, v in raw.items() if k != "kind"})
        return Preset(cost, WorkerSpec(**worker), mesh["model"], mesh["kv_dtype"], shared_host=True)
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidRequestError(
            f"{path}: not a preset from `kvmesh sim calibrate` ({exc})"
        ) from None
