"""`kvmesh make-tiny-model`: a reproducible tiny RANDOM checkpoint written by transformers' own
model classes and `save_pretrained`, so it carries the real Hugging Face tensor names (5.24
saves MoE experts per expert, `mlp.experts.E.{gate,up,down}_proj.weight`, as the hub does).

Weights: every tensor of the state dict is drawn from its own numpy PCG64 stream seeded by
(seed, CRC32 of its name), so the same seed gives byte-identical safetensors and a tensor's
values do not depend on which others exist. Matrices ~ N(0, 1/fan_in) (activations stay O(1):
attention and routing are far from uniform, so mistakes show in the logits); RMSNorm weights
1 + 0.1 N(0, 1); biases 0.1 N(0, 1); routers' e_score_correction_bias 0.1 N(0, 1) (zeros after
transformers' init) so it changes which experts are chosen.

Memory: the model is built without initialisation (torch.empty) and filled one tensor at a
time, so building takes about the checkpoint's size plus its largest tensor; writing
(`save_pretrained`) copies only fused expert tensors, split per expert."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from kvmesh_apps.tools.tiny_configs import TinySpec, hf_config_kwargs
from kvmesh_apps.tools.tiny_tokenizer import build_tokenizer, save_tokenizer, token_ids

log = structlog.get_logger(__name__)
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
NORM_NOISE = 0.1  # RMSNorm weights 1 + NORM_NOISE * N(0, 1)
BIAS_STD = 0.1


@dataclass(frozen=True)
class TinyModel:
    """What was written where."""

    path: Path
    arch: str
    architecture: str  # the transformers class, e.g. DeepseekV3ForCausalLM
    parameters: int
    files: tuple[str, ...]
    safetensors_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "arch": self.arch,
            "architecture": self.architecture,
            "parameters": self.parameters,
            "files": list(self.files),
            "safetensors_bytes": self.safetensors_bytes,
        }


def make_tiny_model(spec: TinySpec, output: Path) -> TinyModel:
    """Write spec's checkpoint (config, generation config, safetensors, tokenizer) to output."""
    tokenizer = build_tokenizer()
    model = build_model(spec, tokenizer)
    output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(output))
    save_tokenizer(tokenizer, output)
    if spec.quantize == "int4-experts":
        from kvmesh_apps.tools.tiny_int4 import quantize_experts

        quantize_experts(output)
    files = tuple(sorted(p.name for p in output.iterdir() if p.is_file()))
    size = sum(p.stat().st_size for p in output.glob("*.safetensors"))
    result = TinyModel(output, spec.arch, type(model).__name__, model.num_parameters(), files, size)
    log.info("tiny_model.written", **result.as_dict())
    return result


def build_model(spec: TinySpec, tokenizer: Any | None = None) -> Any:
    """The seeded random transformers model of spec (in eval mode), not written anywhere."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    model_type, kwargs = hf_config_kwargs(spec, token_ids(tokenizer or build_tokenizer()))
    config = AutoConfig.for_model(model_type, **kwargs)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=TORCH_DTYPES[spec.dtype])
    randomize(model, spec.seed)
    return model.eval()


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Fill every tensor of model's state dict (parameters and persistent buffers) in place."""
    for name, tensor in model.state_dict(keep_vars=True).items():
        values = tensor_values(name, tuple(tensor.shape), seed)
        tensor.data.copy_(torch.from_numpy(values))


def tensor_values(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """float32 values of one tensor, from its own stream: (seed, CRC32 of name)."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    noise = rng.standard_normal(shape, dtype=np.float32)
    if len(shape) >= 2:  # a matrix, or stacked expert matrices [E, out, in]
        return noise * np.float32(shape[-1] ** -0.5)
    if name.endswith("bias"):  # linear / LayerNorm biases, e_score_correction_bias
        return noise * np.float32(BIAS_STD)
    return noise * np.float32(NORM_NOISE) + np.float32(1.0)
