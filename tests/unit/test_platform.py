"""The platform seam: `--device` resolved once (cuda without CUDA: an error naming the flag),
kernels chosen by the tensor's platform, Triton on the CPU only under the interpreter, a model
moved whole onto a device (checked on the meta device: nothing left on the host), and the
staged transfer mode's host mirror (pages copied out and in by runs of page ids)."""

from __future__ import annotations

import pytest
import torch

from kvmesh import LLM
from kvmesh.engine.kernels import cpu_ops
from kvmesh.engine.kv.layout import KVCacheSpec
from kvmesh.engine.platform import CPU, kernels_for, resolve
from kvmesh.engine.platform.placement import held_devices, place
from kvmesh.engine.pool.kv_cache import PagedKVCache
from kvmesh.engine.pool.kv_pages import StagedKvPages, _runs
from kvmesh.errors import InvalidRequestError
from kvmesh_apps.tools.tiny_configs import TinySpec
from kvmesh_apps.tools.tiny_models import make_tiny_model

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")


@NO_CUDA
def test_device_resolves_once_and_cuda_without_cuda_names_the_flag():
    assert resolve("cpu") is CPU and resolve("auto") is CPU
    with pytest.raises(InvalidRequestError, match="--device cuda: torch sees no CUDA device"):
        resolve("cuda")


def test_kernels_follow_the_tensors_platform():
    assert kernels_for(torch.zeros(2)) is cpu_ops()
    assert kernels_for(torch.zeros(2, device="meta")) is None  # no platform owns meta


def test_triton_on_the_cpu_only_under_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for flag, pick in (
        ("--attention-backend", CPU.attention_backend),
        ("--moe-backend", CPU.moe_backend),
    ):
        with pytest.raises(InvalidRequestError, match=f"{flag} triton .* TRITON_INTERPRET=1"):
            pick("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert CPU.attention_backend("triton") == CPU.moe_backend("triton") == "triton"
    assert CPU.moe_backend("auto") == "torch" and CPU.kv_transfer("auto") == "direct"


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_a_placed_model_holds_no_host_tensor(tmp_path, arch):
    path = make_tiny_model(TinySpec(arch), tmp_path / arch).path
    model = LLM(str(path), dtype="fp32", num_pages=8).engine.runner.model
    assert held_devices(model) == {"cpu"}
    place(model, torch.device("meta"), None)
    assert held_devices(model) == {"meta"}  # rotary tables, norms, routers, experts, heads


def test_a_model_with_cpu_int4_linears_needs_a_converter(tmp_path):
    path = make_tiny_model(TinySpec("llama"), tmp_path / "m").path
    model = LLM(str(path), weights="int4", num_pages=8).engine.runner.model
    with pytest.raises(ValueError, match="no INT4 linear for meta"):
        place(model, torch.device("meta"), None)


def test_staged_pages_go_through_the_mirror_by_runs_of_page_ids():
    assert _runs([3, 4, 5, 9, 1, 2]) == [(3, 6), (9, 10), (1, 3)]
    cache = PagedKVCache(KVCacheSpec.gqa(2, 2, 8, 4, "bf16"), 12, torch.bfloat16)
    pages = StagedKvPages.single(cache)
    assert pages.region.data_ptr() != cache.pool.data_ptr()  # transfers see the mirror
    assert pages.layout.shards[0].address == pages.region.data_ptr()
    cache.pool[:] = torch.randint(0, 255, cache.pool.shape, dtype=torch.uint8)
    pages.stage_out([2, 3, 7])
    assert torch.equal(pages.region[[2, 3, 7]], cache.pool[[2, 3, 7]])
    assert not pages.region[[0, 1, 4, 5, 6]].any()
    assert torch.equal(pages.gather([7, 2]), cache.pool[[7, 2]])
    pages.region[5] = 17  # a transfer landed in page 5
    pages.stage_in([5])
    assert (cache.pool[5] == 17).all()


def test_a_gpu_pool_takes_its_budget_within_the_free_memory(monkeypatch):
    from kvmesh.engine.platform.cuda import CudaPlatform

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (30 * gib, 80 * gib))
    cuda = CudaPlatform(0)  # (no GPU needed to ask it)
    assert cuda.kv_budget(4 * gib) == 4 * gib
    assert cuda.kv_budget(64 * gib) == 30 * gib - 8 * gib - gib  # a tenth of the card, 1 GiB
    assert CPU.kv_budget(64 * gib) == 64 * gib

    allocated = [5 * gib]  # the weights; a pass's peak: measured above them
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: allocated[0])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: allocated[0])

    def warm_up():  # the largest step's activations: 3 GiB at their peak
        allocated[0] += 3 * gib

    assert cuda.kv_budget(64 * gib, warm_up) == 30 * gib - 3 * gib - 8 * gib
    assert CPU.kv_budget(64 * gib, warm_up) == 64 * gib and allocated[0] == 8 * gib  # not run


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_the_warm_up_pass_runs_a_full_steps_rows_into_the_scratch_page(tmp_path, arch):
    """The pass whose peak a GPU's budget leaves room for, here on CPU tensors: the model's
    forward over the largest step's rows, every row's KV in one scratch page."""
    from kvmesh.engine.attention import get_backend
    from kvmesh.engine.runner.warm_up import padding_pass

    path = make_tiny_model(TinySpec(arch), tmp_path / "m").path
    model = LLM(str(path), dtype="fp32", num_pages=8).engine.runner.model
    spec = model.kv_spec(16, "fp32")
    seen = []
    forward = model.forward
    model.forward = lambda ids, *rest: seen.append(forward(ids, *rest)[0].shape)
    backend = get_backend("torch", spec.layers[0].kind)
    padding_pass(model, spec, backend, 48, torch.float32, CPU)()
    assert seen == [(48, model.config.hidden_size)]


def test_a_tensor_held_twice_is_moved_once():
    class Held:  # (a kvmesh class: placement walks only the engine's own objects)
        __module__ = "kvmesh.engine.test_double"

        def __init__(self, t):
            self.embed, self.lm_head, self.rows = t, t, [t]

    model = place(Held(torch.zeros(3)), torch.device("meta"), None)
    assert model.embed is model.lm_head is model.rows[0] and model.embed.is_meta


def test_a_gpu_engine_refuses_pages_smaller_than_its_kernels_tiles():
    from kvmesh.config import EngineConfig
    from kvmesh.engine.platform.cuda import CudaPlatform

    with pytest.raises(InvalidRequestError, match="--page-size 8: --device cuda needs at least 16"):
        CudaPlatform(0).check(EngineConfig.of(model="m", page_size=8))
    CudaPlatform(0).check(EngineConfig.of(model="m", page_size=16))
    CPU.check(EngineConfig.of(model="m", page_size=8))  # the CPU's kernels take any
    fp8_flashinfer = EngineConfig.of(
        model="m", page_size=16, kv_dtype="fp8_e4m3", attention_backend="flashinfer"
    )
    with pytest.raises(InvalidRequestError, match="flashinfer reads bf16/fp32 pages"):
        CudaPlatform(0).check(fp8_flashinfer)


def test_direct_transfers_of_gpu_pools_need_mooncakes_cuda_build_and_one_rank():
    from kvmesh.config import EngineConfig
    from kvmesh.engine.platform.cuda import CudaPlatform

    gpu = CudaPlatform(0)
    gpu.check(EngineConfig.of(model="m", tensor_parallel_size=2))  # staged: the default
    with pytest.raises(InvalidRequestError, match="direct with parallel ranks on GPUs"):
        gpu.check(EngineConfig.of(model="m", tensor_parallel_size=2, kv_transfer="direct"))
    with pytest.raises(InvalidRequestError, match="needs Mooncake's CUDA build"):
        gpu.check(EngineConfig.of(model="m", kv_transfer="direct"))  # the -non-cuda one here
