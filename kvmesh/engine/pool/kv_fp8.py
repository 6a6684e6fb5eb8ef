"""FP8 (e4m3fn) KV codec on torch: per (token, head) power-of-two scales (see kv/layout.py).

Decoding does not use torch's fp8 -> float cast, which is far slower than the down-cast on CPU:
an e4m3fn byte moved into the sign, exponent and top mantissa bits of an fp16 is exactly the same
number times 2**-8 (subnormals included), and fp16 -> fp32 is a fast hardware conversion. The
2**8 is folded into the (power-of-two) scale, so the result is exactly q * 2**e.
"""

from __future__ import annotations

import torch

from kvmesh.engine.kv.layout import EXP_MAX, EXP_MIN, FP8_MAX

_CLEAR_BIT_14 = -16385  # ~0x4000 as int16: drops the sign copy that int8 -> int16 extension adds


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (q int8 [..., D] holding e4m3fn bits, e int8 [...] with x ~= q * 2**e)."""
    amax = x.abs().amax(-1).float()
    _, exponent = torch.frexp(amax / FP8_MAX)  # amax / 448 = m * 2**k, m in [0.5, 1): 2**k >= it
    exponent = exponent.clamp(EXP_MIN, EXP_MAX)
    scaled = x.float() * torch.exp2(-exponent.float()).unsqueeze(-1)
    return scaled.to(torch.float8_e4m3fn).view(torch.int8), exponent.to(torch.int8)


def dequantize(q: torch.Tensor, e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Exact inverse of the cast: q [..., D] int8 (e4m3fn bits), e [...] int8 -> dtype."""
    half = torch.bitwise_and(q.to(torch.int16) << 7, _CLEAR_BIT_14).view(torch.float16)
    out = half * torch.exp2(e.float() + 8.0).unsqueeze(-1)  # fp16 * fp32 -> fp32, one pass
    return out if dtype == torch.float32 else out.to(dtype)
