"""Where an engine runs and with which kernels: the device (engine/platform/ picks the platform
from it) and the choices each platform resolves (`auto`) or refuses."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.config.knobs import check, knob

DECODE_STEPS = ("fused", "eager", "compiled", "graphs")  # runner/: fused_decode, compiled, graphs
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton", "flashinfer")  # attention/__init__.py
MOE_BACKENDS = ("auto", "torch", "triton")  # layers/moe.py, layers/moe_grouped.py
KV_TRANSFERS = ("auto", "direct", "staged")  # pool/kv_pages.py
DEVICES = ("cpu", "cuda", "auto")  # engine/platform/


@dataclass(frozen=True)
class DeviceConfig:
    device: str = knob(
        "cpu", "where the engine runs (auto: CUDA where torch sees a GPU)", choices=DEVICES
    )
    attention_backend: str = knob(
        "auto",
        "attention kernels (auto: on CPU the paged CPU kernels where they build, else torch; "
        "on CUDA triton; triton also runs on CPU tensors under TRITON_INTERPRET=1, slowly; "
        "flashinfer: CUDA with flashinfer-python, bf16/fp32 pages, GQA and MLA)",
        choices=ATTENTION_BACKENDS,
    )
    moe_backend: str = knob(
        "auto",
        "routed experts: torch runs each expert's rows in turn; triton one grouped GEMM per "
        "projection (dense experts; auto: triton on CUDA, torch on CPU)",
        choices=MOE_BACKENDS,
    )
    kv_transfer: str = knob(
        "auto",
        "how other workers and the KV store reach the KV pages: direct (the pool registered "
        "with the transfer engine) or staged (through a host mirror, pages copied at each "
        "transfer: a GPU pool with the non-CUDA transfer engine); auto: direct on CPU, staged "
        "on CUDA",
        choices=KV_TRANSFERS,
    )
    decode_step: str = knob(
        "fused",
        "fused: on CPU, decode-only steps of dense GQA models as one C++ op "
        "(the eager bits; other models run eager); compiled: torch.compile "
        "them (opt-in; see docs/benchmarks.md); graphs: CUDA graphs of decode-only steps "
        "(CUDA's default for fused)",
        choices=DECODE_STEPS,
    )

    def __post_init__(self) -> None:
        check(self)
