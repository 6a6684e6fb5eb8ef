"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Mistral) on paged KV.

Plain tensors instead of nn.Modules keep per-layer Python overhead low on the decode path.
Q/K/V and gate/up projections are fused at load time into one matmul each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvmesh.engine.attention import AttentionBackend, AttentionMetadata, LayerKV
from kvmesh.engine.config import Int4Scheme, ModelConfig
from kvmesh.engine.models.rope import RotaryEmbedding, apply_rotary, inv_frequencies
from kvmesh.engine.quant.int4 import Int4Linear, Int4Weight
from kvmesh.errors import ModelFormatError

Linear = torch.Tensor | Int4Linear  # a dense [out, in] weight, or an INT4 layer


def _mm(x: torch.Tensor, w: Linear, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    out = w(x)
    return out if bias is None else out + bias


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear  # [(Hq + 2 Hkv) D, H]
    qkv_bias: torch.Tensor | None
    o_proj: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # [2 I, H]
    down: Linear


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        max_positions: int,
        int4: Int4Scheme | None = None,
    ) -> None:
        """int4: every decoder-layer linear becomes INT4, taking `Int4Weight`s in `weights`
        (e.g. GGUF Q4_1) as they are and quantizing float ones (round-to-nearest), in the
        scheme's group size; the embedding / LM head too if the scheme says so. Norms (and
        otherwise the embedding / LM head) stay in `dtype`."""
        self.config = config
        self.dtype = dtype
        self.int4 = int4
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        take = _Taker(weights, dtype)
        tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        self.embed = self._table(take, "model.embed_tokens.weight")
        self.layers = [self._layer(take, i) for i in range(config.num_layers)]
        self.norm = take("model.norm.weight")
        self.lm_head = self.embed if tied else self._table(take, "lm_head.weight")
        rope_freqs = weights.get("rope_freqs")
        self.rope = RotaryEmbedding(inv_frequencies(config, rope_freqs), max_positions, dtype)

    def _layer(self, take: _Taker, i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        bias = None
        if self.config.attention_bias:
            bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        linear = self._linear
        return LayerWeights(
            input_norm=take(p + "input_layernorm.weight"),
            qkv=linear(take, [p + f"self_attn.{n}_proj.weight" for n in "qkv"]),
            qkv_bias=bias,
            o_proj=linear(take, [p + "self_attn.o_proj.weight"]),
            post_norm=take(p + "post_attention_layernorm.weight"),
            gate_up=linear(take, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
            down=linear(take, [p + "mlp.down_proj.weight"]),
        )

    def _linear(self, take: _Taker, names: list[str]) -> Linear:
        """Output rows of `names` fused into one dense or INT4 linear layer."""
        if self.int4 is None:
            return torch.cat([take(n) for n in names])
        return Int4Linear(Int4Weight.cat([self._int4(take, n) for n in names]), self.dtype)

    def _int4(self, take: _Taker, name: str) -> Int4Weight:
        weight, group = take.raw(name, pop=True), self.int4.group  # type: ignore[union-attr]
        try:
            if isinstance(weight, Int4Weight):
                return weight.regroup(group) if group else weight
            return Int4Weight.quantize(weight.float(), group or 32)
        except ValueError as exc:
            raise ModelFormatError(f"{name}: {exc}") from None

    def _table(self, take: _Taker, name: str) -> Linear:
        """The token embedding or an untied LM head: dense, or INT4 whose rows the CPU kernel
        layout lets us read back (one copy serves the lookup and the LM head matmul)."""
        if self.int4 is None or not self.int4.embeddings:
            return take(name)
        table = Int4Linear(self._int4(take, name), self.dtype)
        if name == "model.embed_tokens.weight" and not table.can_read_rows:
            raise ModelFormatError(
                "INT4 embeddings need the CPU int4 kernel's blocked layout and a vocabulary "
                f"that is a multiple of its block; {name} has {table.out_features} rows"
            )
        return table

    def token_embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the token embedding for `ids`, in the compute dtype."""
        if isinstance(self.embed, Int4Linear):
            return self.embed.rows(ids)
        return F.embedding(ids, self.embed)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights the model holds (a tied table counted once)."""
        held = [self.norm, *{id(t): t for t in (self.embed, self.lm_head)}.values()]
        for layer in self.layers:
            held += [v for v in vars(layer).values() if v is not None]
        return sum(w.nbytes for w in held)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[LayerKV],
        attention: AttentionBackend,
        capture: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states [T, H] after the final norm's input (call `logits` on chosen rows),
        and, with `capture`, the outputs of those layers concatenated [T, len(capture) * H]
        (the features an EAGLE draft head reads)."""
        cos, sin = self.rope.tables(positions)
        h = self.token_embeddings(input_ids)
        captured: list[torch.Tensor] = []
        for index, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            h = h + self._attention(
                layer, self._norm(h, layer.input_norm), cos, sin, meta, cache, attention
            )
            h = h + self._mlp(layer, self._norm(h, layer.post_norm))
            if index in capture:
                captured.append(h)
        return h, torch.cat(captured, dim=-1) if captured else None

    def _attention(self, w: LayerWeights, x, cos, sin, meta, cache, attention):
        c = self.config
        qkv = _mm(x, w.qkv, w.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(-1, c.num_heads, c.head_dim), cos, sin)
        k = apply_rotary(k.view(-1, c.num_kv_heads, c.head_dim), cos, sin)
        v = v.reshape(-1, c.num_kv_heads, c.head_dim)
        out = attention.forward(q, k, v, cache, meta, self.scale)
        return _mm(out.reshape(-1, self.q_size), w.o_proj)

    @staticmethod
    def _mlp(w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        gate, up = _mm(x, w.gate_up).chunk(2, dim=-1)
        return _mm(F.silu(gate) * up, w.down)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, self.config.rms_norm_eps)
        normed = F.rms_norm(x.float(), weight.shape, None, self.config.rms_norm_eps)
        return weight * normed.to(x.dtype)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, V] for the given rows of `forward`'s output."""
        return _mm(self._norm(hidden, self.norm), self.lm_head).float()


class _Taker:
    """Named tensors from the state dict, cast to the model dtype, with clear errors (an INT4
    tensor wanted dense, e.g. a GGUF's Q4 token embedding kept in the compute dtype, is
    dequantized)."""

    def __init__(self, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.weights = weights
        self.dtype = dtype

    def raw(self, name: str, pop: bool = False) -> torch.Tensor | Int4Weight:
        """The tensor as loaded (popped: its memory goes once the model holds its own form)."""
        if name not in self.weights:
            raise ModelFormatError(f"weights lack tensor {name!r}")
        return self.weights.pop(name) if pop else self.weights[name]

    def __call__(self, name: str) -> torch.Tensor:
        weight = self.raw(name)
        if isinstance(weight, Int4Weight):
            weight = weight.dequantize()
        return weight.to(self.dtype).contiguous()
