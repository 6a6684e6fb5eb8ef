"""An EAGLE-3-style draft head: target features from a low, a middle and a high layer, fused to
one hidden vector, plus the next token's embedding, through one decoder layer, to logits over a
reduced draft vocabulary mapped back to the target's token ids.

Position t of a sequence carries the input (fused target features at t, embedding of token t+1)
and predicts token t+2. Drafting k tokens after a committed position T-1: the output hidden
state at T-1 gives draft 1; position T takes (that output, draft 1) and gives draft 2; and so on.
The head attends over its own KV, limited to the last `window` positions: a bounded per-request
state, and all that a prefill worker has to hand over (see `DraftWindow`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from kvmesh.engine.models.rope import apply_rotary
from kvmesh.errors import ModelFormatError


@dataclass(frozen=True)
class EagleConfig:
    target: str  # the target model's name (a head only drafts for its own target)
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    capture_layers: tuple[int, ...]  # target layers whose outputs are fused
    draft_vocab_size: int
    window: int = 32
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    @classmethod
    def for_target(cls, name: str, cfg, draft_vocab_size: int = 4096, window: int = 32):
        layers = cfg.num_layers
        return cls(
            name,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            (2, layers // 2, layers - 3),
            draft_vocab_size,
            window,
            cfg.rope_theta,
            cfg.rms_norm_eps,
        )


class EagleHead(nn.Module):
    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        c = self.config = config
        h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.fc = nn.Linear(len(c.capture_layers) * h, h, bias=False)
        self.embed_norm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.qkv = nn.Linear(2 * h, q + 2 * kv, bias=False)
        self.o_proj = nn.Linear(q, h, bias=False)
        self.post_norm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.gate_up = nn.Linear(h, 2 * c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, h, bias=False)
        self.final_norm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(h, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    # -- the layer -----------------------------------------------------------------------------
    def project(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """q [N, Hq, D], k and v [N, Hkv, D] (roped) of inputs at `positions`."""
        c = self.config
        x = torch.cat([self.embed_norm(embeds), self.hidden_norm(hidden)], dim=-1)
        q, k, v = self.qkv(x).split(
            [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim],
            dim=-1,
        )
        cos, sin = self._rope(positions)
        q = apply_rotary(q.view(*q.shape[:-1], c.num_heads, c.head_dim), cos, sin)
        k = apply_rotary(k.view(*k.shape[:-1], c.num_kv_heads, c.head_dim), cos, sin)
        return q, k, v.view(*v.shape[:-1], c.num_kv_heads, c.head_dim)

    def finish(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Residual + o_proj + MLP: the layer's output hidden state [..., H]."""
        h = hidden + self.o_proj(attended.flatten(-2))
        gate, up = self.gate_up(self.post_norm(h)).chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary."""
        return self.lm_head(self.final_norm(out))

    def attend(self, q, keys, values, mask) -> torch.Tensor:
        """q [..., Lq, Hq, D] over keys/values [..., Lk, Hkv, D]; mask [..., Lq, Lk] bool."""
        groups = self.config.num_heads // self.config.num_kv_heads
        keys = keys.repeat_interleave(groups, dim=-2)
        values = values.repeat_interleave(groups, dim=-2)
        scores = torch.einsum("...qhd,...khd->...hqk", q, keys) * self.config.head_dim**-0.5
        scores = scores.masked_fill(~mask.unsqueeze(-3), float("-inf"))
        return torch.einsum("...hqk,...khd->...qhd", scores.softmax(dim=-1), values)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().unsqueeze(-2), emb.sin().unsqueeze(-2)

    # -- files ---------------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        state = {
            k: v.to(torch.bfloat16) if v.is_floating_point() else v
            for k, v in self.state_dict().items()
        }
        meta = {"eagle_config": json.dumps(asdict(self.config))}
        save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata=meta)

    @classmethod
    def load(cls, path: Path | str) -> EagleHead:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        if "eagle_config" not in meta:
            raise ModelFormatError(f"{path} is not a kvmesh EAGLE head (no eagle_config)")
        raw = json.loads(meta["eagle_config"])
        config = EagleConfig(**{**raw, "capture_layers": tuple(raw["capture_layers"])})
        head = cls(config)
        state = {
            k: v.float() if v.is_floating_point() else v for k, v in load_file(str(path)).items()
        }
        head.load_state_dict(state)
        return head.eval()


HEADS_DIR = Path(__file__).resolve().parents[2] / "assets" / "eagle"


def default_head_path(model_name: str) -> Path:
    """The head shipped for `model_name` (kvmesh/assets/eagle/<name>.safetensors)."""
    return HEADS_DIR / f"{model_name}.safetensors"


def load_head(path: str | Path | None, model_name: str) -> EagleHead:
    """The head at `path` (default: the shipped one), checked to be trained for `model_name`."""
    path = Path(path) if path else default_head_path(model_name)
    if not path.is_file():
        raise ModelFormatError(
            f"no EAGLE head for {model_name!r} at {path}; train one with `kvmesh train-eagle`"
        )
    head = EagleHead.load(path)
    if head.config.target != model_name:
        raise ModelFormatError(
            f"EAGLE head {path} drafts for {head.config.target!r}, not {model_name!r}"
        )
    return head


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Causal sliding window: query at p sees keys at positions in (p - window, p]."""
    diff = q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)
    return (diff >= 0) & (diff < window)
