"""Mixture-of-experts MLP: a router, routed experts run grouped, optional shared experts.

Routers (`MoeConfig.scoring`):
- softmax (Qwen3-MoE): top-k of softmax(logits), optionally renormalized;
- sigmoid (DeepSeek-V3, Kimi K2, GLM): scores = sigmoid(logits) in fp32; the choice adds
  `e_score_correction_bias` and keeps only the best `topk_group` of `num_groups` expert groups
  (a group's score: the sum of its two best); the weights are the chosen *unbiased* scores,
  renormalized, times `routed_scaling_factor`.

Experts run grouped: the (token, choice) pairs are sorted by expert, each expert multiplies its
contiguous slice of tokens in one matmul (a loop over the experts hit, never over tokens), and
the weighted outputs are summed into an fp32 buffer in a fixed order (deterministic).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmesh.engine.config import MoeConfig
from kvmesh.engine.layers.linear import LinearMethod
from kvmesh.engine.layers.mlp import GatedMLP
from kvmesh.engine.layers.weights import Weights


class Router:
    def __init__(self, config: MoeConfig, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.config, self.weight, self.bias = config, weight, bias

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], weights [T, k] float32) per token."""
        if self.config.scoring == "softmax":
            return self._softmax(x)
        return self._sigmoid(x)

    def _softmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.linear(x, self.weight.to(x.dtype)).softmax(-1, dtype=torch.float32)
        weights, ids = probs.topk(self.config.top_k, dim=-1)
        if self.config.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return ids, weights.to(x.dtype).float()

    def _sigmoid(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        scores = F.linear(x.float(), self.weight).sigmoid()
        choice = scores if self.bias is None else scores + self.bias
        if c.num_groups > 1:
            grouped = choice.view(-1, c.num_groups, c.num_experts // c.num_groups)
            best = grouped.topk(2, dim=-1).values.sum(-1).topk(c.topk_group, dim=-1).indices
            keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], 1), -torch.inf)
        ids = choice.topk(c.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * c.routed_scaling_factor


class MoE:
    def __init__(
        self, router: Router, experts: list[GatedMLP | None], shared: GatedMLP | None
    ) -> None:
        self.router, self.experts, self.shared = router, experts, shared
        self.grouped = None  # see `group`

    @classmethod
    def load(cls, config: MoeConfig, weights: Weights, prefix: str, method: LinearMethod) -> MoE:
        """From `prefix`gate.weight (+ e_score_correction_bias), experts.E.*_proj (or the fused
        experts.gate_up_proj / experts.down_proj of transformers' own format), shared_experts."""
        bias = None
        if config.correction_bias:
            bias = weights.fp32(f"{prefix}gate.e_score_correction_bias")
        router = Router(config, weights.fp32(f"{prefix}gate.weight"), bias)
        experts = _experts(config, weights, f"{prefix}experts.", method)
        shared = None
        if config.num_shared_experts:
            shared = GatedMLP.load(weights, f"{prefix}shared_experts.", method)
        return cls(router, experts, shared)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.router(x)
        if self.grouped is not None:
            out = self.grouped(x, ids, weights)
        else:
            out = self._expert_loop(x, ids, weights)
        out = out.to(x.dtype)
        return out if self.shared is None else out + self.shared(x)

    def group(self, make) -> None:
        """Run the routed experts through `make(experts)` (one grouped GEMM per projection,
        layers/moe_grouped.py) instead of the loop; their weights then live there only."""
        self.grouped = make(self.experts)
        self.experts = [None] * len(self.experts)

    def _expert_loop(self, x, ids, weights) -> torch.Tensor:
        """Pairs sorted by expert, each expert's rows in one call; fp32 sums in a fixed order."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tokens = order // ids.shape[1]
        begin = 0
        for expert, count in enumerate(counts):
            mlp = self.experts[expert]  # None: another rank's (expert parallelism)
            if count and mlp is not None:
                rows = tokens[begin : begin + count]
                y = mlp(x[rows]).float() * weights.flatten()[order[begin : begin + count], None]
                out.index_add_(0, rows, y)
            begin += count
        return out

    @property
    def nbytes(self) -> int:
        held = self.router.weight.nbytes + sum(e.nbytes for e in self.experts if e is not None)
        held += self.grouped.nbytes if self.grouped is not None else 0
        return held + (self.shared.nbytes if self.shared is not None else 0)


def _experts(
    config: MoeConfig, weights: Weights, prefix: str, method: LinearMethod
) -> list[GatedMLP | None]:
    """Every routed expert's MLP; None for those another rank holds (expert parallelism)."""
    held = config.held_experts
    if f"{prefix}gate_up_proj" in weights:  # transformers' fused [E, 2I, H] / [E, H, I]
        gate_up, down = weights.raw(f"{prefix}gate_up_proj"), weights.raw(f"{prefix}down_proj")
        return [
            GatedMLP(method.create([gate_up[e]], None), method.create([down[e]], None))
            if e in held
            else None
            for e in range(config.num_experts)
        ]
    return [
        GatedMLP.load(weights, f"{prefix}{e}.", method) if e in held else None
        for e in range(config.num_experts)
    ]
