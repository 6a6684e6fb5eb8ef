"""The model interface every architecture implements, and the decoder they share.

An architecture module exposes a class built as `cls(config, weights, dtype, max_positions,
int4)` that satisfies `CausalLM`; it is registered by HF `architectures` name in registry.py.
Most are a `DecoderModel` whose subclass picks each layer's attention (GQA / MLA) and MLP
(dense / MoE) from the shared layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import structlog
import torch
import torch.nn.functional as F

from kvmesh.config import Int4Scheme
from kvmesh.engine.config import ModelConfig, spec_for_model
from kvmesh.engine.kv.layout import KVCacheSpec
from kvmesh.engine.layers.linear import LinearMethod, dense_matmul, method_for
from kvmesh.engine.layers.mlp import GatedMLP
from kvmesh.engine.layers.norm import add_rms_norm, rms_norm
from kvmesh.engine.layers.weights import Weights
from kvmesh.engine.models.rope import RotaryEmbedding
from kvmesh.engine.quant.int4 import Int4Linear
from kvmesh.errors import ModelFormatError

log = structlog.get_logger(__name__)
_IGNORED = ("rotary_emb.inv_freq",)  # buffers some checkpoints carry and no model reads


class CausalLM(Protocol):
    """A decoder-only model over paged KV."""

    config: ModelConfig
    weight_names: tuple[str, ...]  # the checkpoint tensors it read

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: Any,
        kv_caches: list,
        attention: Any,
        capture: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states [T, H] before the final norm, and with `capture` those layers'
        outputs concatenated (what an EAGLE head reads)."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] of chosen rows of `forward`'s output, in the LM head's dtype."""
        ...

    def token_embeddings(self, ids: torch.Tensor) -> torch.Tensor: ...

    def kv_spec(self, page_size: int, kv_dtype: str) -> KVCacheSpec:
        """The pages it caches into (GQA or MLA latent pages, per layer)."""
        ...

    @property
    def weight_bytes(self) -> int: ...


def _packed_scheme(config: ModelConfig) -> Any:
    if not config.quantization_config:
        return None
    import json

    from kvmesh.engine.quant.compressed_tensors import CompressedTensorsScheme

    return CompressedTensorsScheme.from_config(json.loads(config.quantization_config))


class DecoderLayer:
    def __init__(self, input_norm, attention, post_norm, mlp) -> None:
        self.input_norm, self.attention, self.post_norm, self.mlp = (
            input_norm,
            attention,
            post_norm,
            mlp,
        )

    @property
    def nbytes(self) -> int:
        norms = self.input_norm.nbytes + self.post_norm.nbytes
        return norms + self.attention.nbytes + self.mlp.nbytes


class DecoderModel:
    """Embedding, pre-norm decoder layers, final norm, LM head. Subclasses implement
    `attention(i, prefix)` and `mlp(i, prefix)`; `self.method` is the linear method of the
    decoder layers, `self.weights` the checkpoint."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, Any],
        dtype: torch.dtype,
        max_positions: int,
        int4: Int4Scheme | None = None,
    ) -> None:
        self.config, self.dtype, self.int4 = config, dtype, int4
        packed = _packed_scheme(config)
        self.weights = Weights(weights, dtype, packed)
        self.method: LinearMethod = method_for(int4, dtype, native=packed is not None)
        self.rope = RotaryEmbedding.of(config, max_positions, dtype, self._rope_freqs())
        tied = config.tie_word_embeddings or "lm_head.weight" not in self.weights
        # a pipeline stage's checkpoint view lacks the tables and norm of other stages: None
        self.embed = self._optional_table("model.embed_tokens.weight")
        self.layers = [self._layer(i) for i in range(config.num_layers)]
        self.norm = (self.weights.optional if self.weights.partial else self.weights.dense)(
            "model.norm.weight"
        )
        self.lm_head = self.embed if tied else self._table("lm_head.weight")
        self.weight_names = tuple(self.weights.taken)
        self._report_unread()
        del self.weights
        self.ends: ModelEnds = LocalEnds(self)

    def attention(self, index: int, prefix: str) -> Any:
        raise NotImplementedError

    def mlp(self, index: int, prefix: str) -> Any:
        return GatedMLP.load(self.weights, f"{prefix}mlp.", self.method)

    def _layer(self, i: int) -> DecoderLayer:
        p = f"model.layers.{i}."
        return DecoderLayer(
            self.weights.dense(p + "input_layernorm.weight"),
            self.attention(i, p + "self_attn."),
            self.weights.dense(p + "post_attention_layernorm.weight"),
            self.mlp(i, p),
        )

    def _rope_freqs(self) -> torch.Tensor | None:
        if "rope_freqs" not in self.weights:
            return None
        return self.weights.raw("rope_freqs")  # GGUF llama3 factors, read as they are

    def _optional_table(self, name: str) -> Any:
        """A table a pipeline stage may lack (None there); elsewhere a missing one is an error."""
        return None if self.weights.partial and name not in self.weights else self._table(name)

    def _table(self, name: str) -> Any:
        """The token embedding or an untied LM head: dense, or INT4 whose rows the CPU kernel
        layout lets us read back (one copy serves the lookup and the LM head matmul)."""
        if self.int4 is None or not self.int4.embeddings:
            return self.weights.dense(name)
        table = self.method.create([self.weights.raw(name)], None)
        if name == "model.embed_tokens.weight" and not table.can_read_rows:
            raise ModelFormatError(
                "INT4 embeddings need the CPU int4 kernel's blocked layout and a vocabulary "
                f"that is a multiple of its block; {name} has {table.out_features} rows"
            )
        return table

    def _report_unread(self) -> None:
        unread = [n for n in self.weights.left_over() if not n.endswith(_IGNORED)]
        if unread:
            log.warning("model.unread_tensors", count=len(unread), first=unread[:5])

    def kv_spec(self, page_size: int, kv_dtype: str) -> KVCacheSpec:
        return spec_for_model(self.config, page_size, kv_dtype)

    def join(self, ends: ModelEnds) -> None:
        """Where its first rows come from and its last go (parallel/: other ranks, stages)."""
        self.ends = ends

    def token_embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the token embedding for `ids`, in the compute dtype."""
        return self.ends.embed(ids)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights the model holds (a tied table counted once)."""
        tables = {id(t): t for t in (self.embed, self.lm_head) if t is not None}.values()
        return (
            (self.norm.nbytes if self.norm is not None else 0)
            + sum(t.nbytes for t in tables)
            + sum(layer.nbytes for layer in self.layers)
        )

    @torch.inference_mode()
    def forward(self, input_ids, positions, meta, kv_caches, attention, capture=()):
        cos, sin = self.rope.tables(positions)
        h = self.ends.embed(input_ids)
        eps = self.config.rms_norm_eps
        captured: list[torch.Tensor] = []
        for index, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x = rms_norm(h, layer.input_norm, eps)
            x, h = add_rms_norm(
                h, layer.attention(x, cos, sin, meta, cache, attention), layer.post_norm, eps
            )
            h = h + layer.mlp(x)
            if index in capture:
                captured.append(h)
        self.ends.hand_on(h)
        return h, torch.cat(captured, dim=-1) if captured else None

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ends.logits(hidden)


class ModelEnds(Protocol):
    """A model's two ends: its input rows from token ids, its last rows handed on, the logits
    from them. Local by default; parallel/ splits them over ranks or links pipeline stages."""

    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...

    def hand_on(self, hidden: torch.Tensor) -> None: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class LocalEnds:
    """The whole embedding table and LM head in this process."""

    def __init__(self, model: DecoderModel) -> None:
        self.model = model

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.model.embed, Int4Linear):
            return self.model.embed.rows(ids)
        return F.embedding(ids, self.model.embed)

    def hand_on(self, hidden: torch.Tensor) -> None:
        pass

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = rms_norm(hidden, self.model.norm, self.model.config.rms_norm_eps)
        if isinstance(self.model.lm_head, torch.Tensor):
            return dense_matmul(normed, self.model.lm_head)
        return self.model.lm_head(normed)
