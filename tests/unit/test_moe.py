"""The MoE layer's routers against transformers' own (group-limited sigmoid routing with a
correction bias; softmax top-k), and grouped experts against a per-token loop."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.config import MoeConfig
from kvmesh.engine.layers.linear import DenseLinear
from kvmesh.engine.layers.mlp import GatedMLP
from kvmesh.engine.layers.moe import MoE, Router


def _sorted(ids: torch.Tensor, weights: torch.Tensor):
    order = ids.argsort(-1)
    return ids.gather(-1, order), weights.gather(-1, order)


@pytest.mark.parametrize(("groups", "topk_group"), [(1, 1), (4, 2), (8, 3)])
def test_sigmoid_group_limited_router_equals_deepseek_v3s(groups, topk_group):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf_config = DeepseekV3Config(
        hidden_size=32,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=groups,
        topk_group=topk_group,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    gen = torch.Generator().manual_seed(groups)
    hf = DeepseekV3TopkRouter(hf_config)
    hf.weight.data = torch.randn(16, 32, generator=gen)
    hf.e_score_correction_bias.data = torch.randn(16, generator=gen) * 0.5
    config = MoeConfig(
        16,
        4,
        8,
        (0,),
        scoring="sigmoid",
        routed_scaling_factor=2.5,
        num_groups=groups,
        topk_group=topk_group,
        correction_bias=True,
    )
    ours = Router(config, hf.weight.data, hf.e_score_correction_bias.data)
    x = torch.randn(64, 32, generator=gen)
    _, hf_weights, hf_ids = hf(x)
    ids, weights = ours(x)
    hf_ids, hf_weights = _sorted(hf_ids, hf_weights)
    ids, weights = _sorted(ids, weights)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=0)
    chosen_groups = [set((row // (16 // groups)).tolist()) for row in ids]
    assert all(len(g) <= topk_group for g in chosen_groups)


def test_bias_steers_the_choice_but_not_the_weights():
    config = MoeConfig(8, 2, 8, (0,), scoring="sigmoid", norm_topk_prob=False, correction_bias=True)
    weight = torch.zeros(8, 4)
    bias = torch.tensor([0, 0, 0, 0, 0, 0, 5.0, 5.0])
    ids, weights = Router(config, weight, bias)(torch.ones(3, 4))
    assert sorted(ids[0].tolist()) == [6, 7]
    torch.testing.assert_close(weights, torch.full((3, 2), 0.5))  # sigmoid(0), not biased


def test_grouped_experts_equal_a_per_token_loop():
    gen = torch.Generator().manual_seed(3)
    experts = [
        GatedMLP(
            DenseLinear(torch.randn(16, 8, generator=gen)),
            DenseLinear(torch.randn(8, 8, generator=gen)),
        )
        for _ in range(6)
    ]
    config = MoeConfig(6, 2, 8, (0,), norm_topk_prob=True)
    router = Router(config, torch.randn(6, 8, generator=gen), None)
    moe = MoE(router, experts, shared=experts[0])
    x = torch.randn(20, 8, generator=gen)
    ids, weights = router(x)
    expected = torch.stack(
        [
            sum(w * experts[e](row[None])[0] for e, w in zip(i.tolist(), ws, strict=True))
            for row, i, ws in zip(x, ids, weights, strict=True)
        ]
    ) + experts[0](x)
    torch.testing.assert_close(moe(x), expected, atol=1e-5, rtol=1e-5)
