"""Tensor-parallel shards of a decoder (pure data, no processes).

Attention. GQA: rank r of N holds a contiguous range of the KV heads and the query heads that
attend to them (a GQA group never spans two ranks; 3 KV heads on 2 ranks split 1 + 2); with
fewer KV heads than ranks the query heads are split evenly and each rank keeps the KV heads its
queries need (a KV head replicated over N / KV ranks). MLA: the query heads are split
(q_b_proj / q_proj and kv_b_proj by heads, o_proj by their columns); the latent (q_a_proj,
kv_a_proj_with_mqa, their norms) and so the KV cache are replicated on every rank.

MLP: a contiguous range of the intermediate features (gate / up rows, down columns); MoE
experts either split the same way inside each expert (tensor parallel) or, with expert
parallelism, held whole by one rank each (rank r: experts [E r / N, E (r + 1) / N)); shared
experts always split by features. The router is replicated, so every rank routes alike.

Column-parallel weights keep their rows; row-parallel ones (o, down) the matching columns,
their biases on rank 0 only, so the sum over ranks (an all-reduce after each attention and MLP)
is the whole layer. Norms are replicated; embedding and LM head split by token id.

Pipeline stages: with P stages, stage s holds the contiguous layers [L s / P, L (s + 1) / P)
(split over its own tensor-parallel ranks as above), the first stage the token embedding, the
last the final norm and the LM head (a tied table on both). Global rank = stage * N + rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvmesh.config import EngineConfig
from kvmesh.engine.config import ModelConfig
from kvmesh.errors import InvalidRequestError


def share(total: int, rank: int, world: int) -> range:
    """Rank `rank`'s contiguous part of `total` units over `world` ranks."""
    return range(total * rank // world, total * (rank + 1) // world)


@dataclass(frozen=True)
class TensorShard:
    rank: int  # within the stage's tensor-parallel group
    world: int  # that group's size
    expert_parallel: bool = False  # MoE experts whole, partitioned over the ranks
    stage: int = 0  # pipeline stage
    stages: int = 1

    @classmethod
    def of(cls, config: EngineConfig, rank: int) -> TensorShard:
        """Global rank `rank`'s shard."""
        tp = config.parallel.tensor_parallel_size
        return cls(
            rank % tp,
            tp,
            config.parallel.enable_expert_parallel,
            rank // tp,
            config.parallel.pipeline_parallel_size,
        )

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def layers(self, config: ModelConfig) -> range:
        """The decoder layers of this rank's stage (all of them without pipelining)."""
        return share(config.num_layers, self.stage, self.stages)

    def check(self, config: ModelConfig) -> None:
        """Whether this model splits over `world` ranks and `stages` stages."""
        if config.num_layers < self.stages:
            raise InvalidRequestError(
                f"pipeline parallel size {self.stages} exceeds the "
                f"model's {config.num_layers} layers"
            )
        if config.num_heads < self.world:
            raise InvalidRequestError(
                f"tensor parallel size {self.world} exceeds the model's {config.num_heads} "
                "attention heads"
            )
        kv = config.num_kv_heads
        if (
            config.mla is None
            and kv < self.world
            and (self.world % kv or config.num_heads % self.world)
        ):
            raise InvalidRequestError(
                f"tensor parallel size {self.world} exceeds the model's {kv} KV heads and is "
                f"not a multiple of them (each KV head replicated on whole ranks)"
            )
        if self.expert_parallel and (config.moe is None or config.moe.num_experts < self.world):
            raise InvalidRequestError(
                "expert parallelism needs an MoE model with at least as many experts as ranks"
            )

    def q_heads(self, config: ModelConfig) -> range:
        if config.mla is not None or config.num_kv_heads < self.world:
            return share(config.num_heads, self.rank, self.world)
        group = config.num_heads // config.num_kv_heads
        kv = self.kv_heads(config)
        return range(kv.start * group, kv.stop * group)

    def kv_heads(self, config: ModelConfig) -> range:
        """The KV heads this rank's queries attend to (MLA: the one latent "head")."""
        if config.mla is not None:
            return range(1)
        if config.num_kv_heads >= self.world:
            return share(config.num_kv_heads, self.rank, self.world)
        group = config.num_heads // config.num_kv_heads
        q = self.q_heads(config)
        return range(q.start // group, (q.stop - 1) // group + 1)

    def features(self, config: ModelConfig) -> range:
        return share(config.intermediate_size, self.rank, self.world)

    def experts(self, config: ModelConfig) -> range:
        """The routed experts this rank holds (all of them, split inside, without EP)."""
        total = config.moe.num_experts if config.moe is not None else 0
        return share(total, self.rank, self.world) if self.expert_parallel else range(total)

    def vocab(self, config: ModelConfig) -> range:
        return share(config.vocab_size, self.rank, self.world)

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The config this rank's layers are built with (its heads, features, experts)."""
        self.check(config)
        q, kv = self.q_heads(config), self.kv_heads(config)
        moe, layers = config.moe, self.layers(config)
        if moe is not None and self.expert_parallel:
            moe = replace(moe, expert_shard=(self.rank, self.world))
        if moe is not None and self.stages > 1:  # the stage's layers, numbered from 0
            moe = replace(moe, layers=tuple(i - layers.start for i in moe.layers if i in layers))
        return replace(
            config,
            num_heads=len(q),
            num_kv_heads=len(q) if config.mla else len(kv),
            intermediate_size=len(self.features(config)),
            moe=moe,
            num_layers=len(layers),
        )

    def ranges(self, config: ModelConfig) -> dict[str, range]:
        """Rows / columns of each weight kind this rank keeps, in checkpoint units."""
        q, kv = self.q_heads(config), self.kv_heads(config)
        out = {"mlp": self.features(config), "vocab": self.vocab(config)}
        if config.mla is None:
            hd = config.head_dim
            out.update(q=_scaled(q, hd), kv=_scaled(kv, hd), o=_scaled(q, hd))
        else:
            m = config.mla
            out.update(
                q=_scaled(q, m.qk_head_dim),
                o=_scaled(q, m.v_head_dim),
                kv_b=_scaled(q, m.qk_nope_head_dim + m.v_head_dim),
            )
        if config.moe is not None:
            moe = config.moe
            shared = moe.shared_intermediate_size or moe.num_shared_experts * moe.intermediate_size
            out.update(
                expert=share(moe.intermediate_size, self.rank, self.world),
                shared=share(shared, self.rank, self.world),
            )
        return out


def _scaled(heads: range, size: int) -> range:
    return range(heads.start * size, heads.stop * size)
