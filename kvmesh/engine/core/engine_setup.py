"""What an engine is built from: the model's files resolved and loaded, its tokenizer, and the
model built on them (one function, so engine.py keeps to scheduling and stepping)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from kvmesh.config import EngineConfig
from kvmesh.engine.config import ModelConfig
from kvmesh.engine.loader import ModelSource, load_hf_tokenizer, load_model, resolve_model
from kvmesh.engine.loader.memory import current_rss_bytes, peak_rss_bytes
from kvmesh.engine.models import CausalLM, build_model
from kvmesh.engine.parallel.shard import TensorShard
from kvmesh.engine.parallel.sharded_state import ShardedState
from kvmesh.engine.parallel.shared_pages import require_hugepages
from kvmesh.engine.parallel.stage_state import StageState
from kvmesh.engine.platform import CPU, Platform
from kvmesh.engine.platform import resolve as resolve_platform
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.errors import InvalidRequestError

log = structlog.get_logger(__name__)
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class LoadedEngineModel:
    source: ModelSource
    config: ModelConfig
    tokenizer: Tokenizer
    model: CausalLM
    max_model_len: int  # the model's context, within EngineConfig.max_model_len
    context_note: str  # why the context is shorter than the model's, for error messages


def engine_platform(config: EngineConfig) -> Platform:
    """The platform `--device` names, checked against the other device knobs (before a long
    load: a combination that cannot run is an InvalidRequestError naming the flag)."""
    platform = resolve_platform(config.device.device)
    platform.check(config)
    if config.parallel.world_size > 1 and config.device.moe_backend == "triton":
        raise InvalidRequestError("--moe-backend triton runs on one rank (not yet on ranks)")
    return platform


def load_engine_model(
    config: EngineConfig,
    load_weights: Any,
    shard: TensorShard | None = None,
    platform: Platform = CPU,
) -> LoadedEngineModel:
    """`load_weights` is the weight-format registry (a bench may substitute it); `shard`: this
    rank's part of a tensor-parallel model (whose layers the caller joins to its ranks:
    parallel/group.py all_reduced_layers); `platform`: its kernels' (engine_platform)."""
    if config.cache.kv_hugepages:
        require_hugepages()  # none to give: say so before a long load
    source = resolve_model(config.load.model)
    loaded = load_model(source, config.int4 is not None, config.compute_dtype, load_weights)
    log.info("engine.weights_loaded", cache=loaded.cache, seconds=round(loaded.seconds, 3))
    model_config = loaded.config
    tokenizer = Tokenizer(load_hf_tokenizer(source), model_config.eos_token_ids)
    max_len = min(
        config.load.max_model_len or model_config.max_position_embeddings,
        model_config.max_position_embeddings,
    )
    note = ""
    if model_config.indexer is not None:  # DSA runs as dense MLA: see models/moe.py
        max_len = min(max_len, model_config.indexer.topk)
        note = (
            " (DeepSeek Sparse Attention's top-k indexer is not supported: this engine runs "
            f"the model as dense MLA, exact up to index_topk = {model_config.indexer.topk} "
            "tokens)"
        )
    window = model_config.sliding_window
    if window is not None and window < max_len:  # exact while every token sees all before it
        max_len = window
        note = (
            " (sliding-window attention is not implemented: this engine serves the model up to "
            f"its window, {window} tokens, where it is exact)"
        )
    if config.int4 is not None and config.compute_dtype == "fp32":
        log.warning("engine.int4_fp32_activations", hint="--dtype bf16 is several times faster")
    built = time.perf_counter()
    dtype = TORCH_DTYPES[config.compute_dtype]
    if shard is None:
        model = build_model(model_config, loaded.weights, dtype, max_len, int4=config.int4)
    else:
        weights = loaded.weights
        if shard.stages > 1:  # the stage's layers only, renumbered
            weights = StageState(weights, model_config, shard)
        if shard.world > 1:  # its part of each split tensor
            weights = ShardedState(weights, model_config, shard)
        model = build_model(
            shard.local_config(model_config), weights, dtype, max_len, int4=config.int4
        )
    if shard is None and platform.moe_backend(config.device.moe_backend) == "triton":
        from kvmesh.engine.layers.moe_grouped import group_experts

        group_experts(model)
    model = platform.place(model)
    log.info(
        "engine.model_built",
        seconds=round(time.perf_counter() - built, 3),
        weight_mib=model.weight_bytes >> 20,
        rss_mib=(current_rss_bytes() or 0) >> 20,
        peak_rss_mib=peak_rss_bytes() >> 20,
    )
    return LoadedEngineModel(source, model_config, tokenizer, model, max_len, note)
