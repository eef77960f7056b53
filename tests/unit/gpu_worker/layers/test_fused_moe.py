"""FusedMoE and its methods: routing and blocks against transformers' own modules, the
stable grouping, and a token's output the same bits alone and in any batch for every method
that promises it (CPU float, GGUF, int8)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from gpu_worker.cpu import gguf as cpu_gguf
from gpu_worker.cpu import int8 as cpu_int8
from gpu_worker.cpu import linear as cpu_linear
from gpu_worker.layers.fused_moe import ExpertWeights, FloatMoEMethod, FusedMoE
from gpu_worker.layers.linear_methods.weights import GGUFShard, GGUFWeight, Int8Weight
from gpu_worker.layers.moe_methods.cpu_float import CpuFloatMoEMethod
from gpu_worker.layers.moe_methods.gguf import GGUFMoEMethod
from gpu_worker.layers.moe_methods.int8 import Int8MoEMethod
from gpu_worker.layers.moe_routing import Routing, group_by_expert, select_experts
from gpu_worker.models.moe import MoeConfig, SparseMoeBlock
from tests.tiny_moe_models import MOE_ARCHS, moe_config

torch.set_num_threads(2)
HIDDEN, WIDTH, EXPERTS = 64, 32, 8


def _hf_block(arch: str, seed: int = 0) -> tuple[Any, Any]:
    """A transformers sparse MoE block of a tiny `arch` config (its sparse layer's), with
    random weights, and the config."""
    import transformers

    if arch == "gpt_oss":
        config: Any = transformers.GptOssConfig(
            hidden_size=HIDDEN, intermediate_size=WIDTH, num_local_experts=EXPERTS,
            num_experts_per_tok=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=100, num_hidden_layers=1,
        )  # fmt: skip
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

        block: Any = GptOssMLP(config)
    else:
        config = moe_config(arch)
        layer_cls = transformers.AutoModelForCausalLM.from_config(config).model.layers
        sparse = next(i for i in range(config.num_hidden_layers) if _sparse(config, i))
        block = layer_cls[sparse].mlp
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    return block.eval(), config


def _sparse(config: Any, i: int) -> bool:
    moe = MoeConfig.from_hf(config.to_dict())
    return moe is not None and moe.is_sparse(i)


def _our_block(hf: Any, config: Any, method: str = "torch") -> SparseMoeBlock:
    """Our SparseMoeBlock holding `hf`'s weights (transformers keeps experts 3-D)."""
    moe = MoeConfig.from_hf(config.to_dict())
    assert moe is not None
    block = SparseMoeBlock(moe, config.hidden_size)
    experts = hf.experts
    if config.model_type == "gpt_oss":  # x @ W [E, in, out]: transposed, biases beside
        w13, w2 = experts.gate_up_proj.transpose(1, 2), experts.down_proj.transpose(1, 2)
        biases = (experts.gate_up_proj_bias.detach(), experts.down_proj_bias.detach())
        router = hf.router
    else:
        w13, w2, biases, router = experts.gate_up_proj, experts.down_proj, (None, None), hf.gate
    weights = ExpertWeights(
        [w.detach().contiguous() for w in w13], [w.detach().contiguous() for w in w2], *biases
    )
    block.experts.method = CpuFloatMoEMethod() if method == "cpu" else FloatMoEMethod()
    block.experts.method.load_weights(block.experts, weights)
    with torch.no_grad():
        block.gate.weight.copy_(router.weight)
        if block.gate.bias is not None:
            block.gate.bias.copy_(router.bias)
        if block.shared_expert is not None and block.shared_expert_gate is not None:
            shared = hf.shared_expert
            gate_up = torch.cat([shared.gate_proj.weight, shared.up_proj.weight])
            block.shared_expert.gate_up_proj.weight.copy_(gate_up)
            block.shared_expert.down_proj.weight.copy_(shared.down_proj.weight)
            block.shared_expert_gate.weight.copy_(hf.shared_expert_gate.weight)
    return block.eval()


@pytest.mark.parametrize("arch", [*MOE_ARCHS, "gpt_oss"])
def test_routing_matches_the_family_router(arch: str) -> None:
    hf, config = _hf_block(arch)
    moe = MoeConfig.from_hf(config.to_dict())
    assert moe is not None
    x = torch.randn(23, HIDDEN)
    router = hf.router if arch == "gpt_oss" else hf.gate
    with torch.no_grad():
        logits, want_weights, want_ids = router(x)
    weights, ids = select_experts(logits, moe.routing)
    assert torch.equal(ids, want_ids)
    assert torch.equal(weights, want_weights.to(weights.dtype))
    assert weights.dtype == want_weights.dtype


@pytest.mark.parametrize("method", ["torch", "cpu"])
@pytest.mark.parametrize("arch", [*MOE_ARCHS, "gpt_oss"])
def test_block_matches_transformers(arch: str, method: str) -> None:
    """Our block on transformers' weights gives transformers' output, to float rounding
    (transformers groups an expert's rows by slot, then token; gpt-oss's as x @ W + b)."""
    hf, config = _hf_block(arch)
    ours = _our_block(hf, config, method)
    x = torch.randn(1, 29, HIDDEN)
    with torch.no_grad():
        want = hf(x)
        want = want[0] if isinstance(want, tuple) else want
        got = ours(x[0])
    torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-5)


def test_group_by_expert_is_a_stable_counting_sort() -> None:
    ids = torch.tensor([[3, 1], [1, 0], [3, 2], [0, 1]])
    order, counts = group_by_expert(ids, 5)
    assert counts == [2, 3, 1, 2, 0]
    # pairs (token * k + slot) by expert, ties in token order
    assert order.tolist() == [3, 6, 1, 2, 7, 5, 0, 4]


def test_decoder_sparse_layouts() -> None:
    base = dict(
        model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8
    )
    moe = MoeConfig.from_hf(dict(base, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert moe is not None
    assert [moe.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]
    assert MoeConfig.from_hf(dict(base, model_type="qwen3")) is None


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("hidden_act", "gelu", "hidden_act"),
        ("clip_qkv", 8.0, "clip_qkv"),
        ("use_sliding_window", True, "use_sliding_window"),
        ("num_experts_per_tok", 9, "num_experts_per_tok"),
    ],
)
def test_unserved_fields_are_refused_by_name(field: str, value: Any, match: str) -> None:
    cfg = dict(model_type="olmoe", num_experts=8, num_experts_per_tok=2, intermediate_size=8)
    with pytest.raises(ValueError, match=match):
        MoeConfig.from_hf({**cfg, field: value})
    mixtral = dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="sliding_window"):
        MoeConfig.from_hf(dict(mixtral, intermediate_size=8, sliding_window=4096))


# --- a token's result alone and in any batch -----------------------------------------------


def _float_experts(dtype: torch.dtype, seed: int = 0) -> ExpertWeights:
    gen = torch.Generator().manual_seed(seed)
    w13 = [(0.2 * torch.randn(2 * WIDTH, HIDDEN, generator=gen)).to(dtype) for _ in range(EXPERTS)]
    w2 = [(0.2 * torch.randn(HIDDEN, WIDTH, generator=gen)).to(dtype) for _ in range(EXPERTS)]
    return ExpertWeights(list(w13), list(w2))


def _gguf(w: torch.Tensor, qtype: int) -> GGUFWeight:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    data = quantize(w.float().numpy(), GGMLQuantizationType(qtype))
    return GGUFWeight((GGUFShard(qtype, torch.from_numpy(np.ascontiguousarray(data))),), w.shape[1])


def _layer(kind: str) -> FusedMoE:
    from gguf import GGMLQuantizationType

    routing = Routing(top_k=3, renormalize=True)
    dtype = torch.bfloat16 if kind == "cpu_bf16" else torch.float32
    layer = FusedMoE(EXPERTS, HIDDEN, WIDTH, routing).to(dtype)
    experts = _float_experts(dtype)
    if kind.startswith("cpu"):
        layer.method = CpuFloatMoEMethod()
    elif kind in ("Q8_0", "Q4_1", "Q5_0"):
        qtype = int(GGMLQuantizationType[kind])
        experts = ExpertWeights(
            [_gguf(w, qtype) for w in experts.gate_up], [_gguf(w, qtype) for w in experts.down]
        )
        layer.method = GGUFMoEMethod("cpu", dtype)
    elif kind.startswith("int8"):
        experts = ExpertWeights(
            [Int8Weight(*cpu_int8.quantize_weight(w)) for w in experts.gate_up],  # type: ignore[arg-type]
            [Int8Weight(*cpu_int8.quantize_weight(w)) for w in experts.down],  # type: ignore[arg-type]
        )
        layer.method = Int8MoEMethod("cpu" if kind == "int8" else "torch")
    layer.method.load_weights(layer, experts)
    layer.method.process_weights_after_loading(layer)
    return layer


KINDS = ["cpu_f32", "cpu_bf16", "Q8_0", "Q4_1", "Q5_0", "int8", "int8_torch"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_token_is_the_same_bits_alone_and_in_any_batch(kind: str) -> None:
    if kind.startswith("cpu") and cpu_linear.load() is None:
        pytest.skip("linear.c cannot be built here")
    if kind.startswith("Q") and cpu_gguf.load() is None:
        pytest.skip("gguf.c cannot be built here")
    layer = _layer(kind)
    dtype = torch.bfloat16 if kind == "cpu_bf16" else torch.float32
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(41, HIDDEN, generator=gen).to(dtype)
    logits = torch.randn(41, EXPERTS, generator=gen).to(dtype)
    with torch.no_grad():
        batch = layer(x, logits)
        for i in (0, 7, 40):
            assert torch.equal(layer(x[i : i + 1], logits[i : i + 1])[0], batch[i]), i
        perm = torch.randperm(41, generator=gen)[:17]
        assert torch.equal(layer(x[perm], logits[perm]), batch[perm])
    assert sum(layer.tokens_per_expert) == (41 + 3 + 17) * 3


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "cpu_f32"])
def test_experts_with_many_rows_are_the_same_bits_alone(kind: str) -> None:
    """A prefill-sized batch gives experts 32 rows and more: moe.c sends GGUF experts to
    gguf.c's GEMM (on AMX tiles where the CPU has them), and from 256 (token, expert) pairs
    runs its own loops (gathering, activation, weighted sums) on every thread; a token alone
    (the few-row kernel, one thread) gets the same bits."""
    if cpu_gguf.load() is None or cpu_linear.load() is None:
        pytest.skip("the C kernels cannot be built here")
    layer = _layer(kind)
    gen = torch.Generator().manual_seed(6)
    x, logits = torch.randn(160, HIDDEN, generator=gen), torch.randn(160, EXPERTS, generator=gen)
    with torch.no_grad():
        batch = layer(x, logits)
        assert max(layer.tokens_per_expert) >= 32
        for i in (0, 81, 159):
            assert torch.equal(layer(x[i : i + 1], logits[i : i + 1])[0], batch[i]), i


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "int8"])
def test_quantized_experts_match_their_dequantized_reference(kind: str) -> None:
    """GGUF and int8 experts against float experts of the dequantized weights (the layer's
    arithmetic apart from the activations' rounding)."""
    if cpu_gguf.load() is None or cpu_int8.load() is None:
        pytest.skip("the C kernels cannot be built here")
    layer = _layer(kind)
    reference = FusedMoE(EXPERTS, HIDDEN, WIDTH, layer.routing)
    if kind == "int8":
        w13 = layer.w13_weight.float() * layer.get_parameter("w13_scale")[:, :, None]
        w2 = layer.w2_weight.float() * layer.get_parameter("w2_scale")[:, :, None]
    else:
        qtype = layer.method.qtypes["w13"][0]  # type: ignore[attr-defined]
        w13 = torch.stack(
            [cpu_gguf.dequantize(w, qtype, 2 * WIDTH, HIDDEN) for w in layer.w13_weight]
        )
        w2 = torch.stack([cpu_gguf.dequantize(w, qtype, HIDDEN, WIDTH) for w in layer.w2_weight])
    reference.method.load_weights(reference, ExpertWeights(list(w13), list(w2)))
    gen = torch.Generator().manual_seed(2)
    x, logits = torch.randn(9, HIDDEN, generator=gen), torch.randn(9, EXPERTS, generator=gen)
    with torch.no_grad():
        got, want = layer(x, logits), reference(x, logits)
    # the activations' rounding to int8 per 32 (GGUF) or per row (int8) apart, the same sums
    assert float((got - want).norm() / want.norm()) < 0.02


def test_gguf_experts_read_only_the_selected_experts_bytes() -> None:
    """Expert e's projections read rows [e] of the stacked bytes and nothing else: poisoning
    every other expert changes nothing for a token routed to e alone."""
    if cpu_gguf.load() is None:
        pytest.skip("gguf.c cannot be built here")
    layer = _layer("Q8_0")
    x = torch.randn(1, HIDDEN)
    logits = torch.full((1, EXPERTS), -10.0)
    logits[0, [2, 5, 6]] = 5.0
    with torch.no_grad():
        want = layer(x, logits)
        for name in ("w13_weight", "w2_weight"):
            w = layer.get_parameter(name)
            for e in set(range(EXPERTS)) - {2, 5, 6}:
                w[e].fill_(0x7F)
        assert torch.equal(layer(x, logits), want)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_the_c_moe_kernel_equals_the_per_expert_loop(kind: str) -> None:
    """moe.c's one call (routing, grouping, gguf.c's kernels, activation, weighted sum)
    against the Python loop over the same kernels: the same result to float rounding (its
    silu and sum are its own), the same counts, and it is what the layer runs."""
    from gpu_worker.cpu import moe as cpu_moe
    from gpu_worker.cpu.one_call_descriptors import Keep
    from gpu_worker.layers.fused_moe import grouped_experts

    if cpu_moe.load() is None:
        pytest.skip("moe.c cannot be built here")
    layer = _layer(kind)
    method = layer.method
    assert isinstance(method, GGUFMoEMethod)
    desc = method.one_call_experts(layer, Keep())
    assert desc is not None
    gen = torch.Generator().manual_seed(4)
    x, logits = torch.randn(23, HIDDEN, generator=gen), torch.randn(23, EXPERTS, generator=gen)
    weights, ids = method.select_experts(layer, logits)
    done = cpu_moe.experts(desc, x, ids, weights)
    assert done is not None
    fused, counts = done
    with torch.no_grad():
        assert torch.equal(layer(x, logits), fused)
        looped = grouped_experts(method, layer, x, weights, ids)
    torch.testing.assert_close(fused, looped, rtol=1e-5, atol=1e-5)
    assert counts == torch.bincount(ids.flatten(), minlength=EXPERTS).tolist()
    bad = ids.clone()
    bad[0, 0] = EXPERTS  # an expert id out of range: refused, the caller loops
    assert cpu_moe.experts(desc, x, bad, weights) is None


def test_the_c_routing_equals_torchs_routing() -> None:
    """moe.c's routing (every CPU method's, and the one-call step's) against select_experts:
    the same experts, the same weights to float rounding, for every scoring."""
    from gpu_worker.cpu import moe as cpu_moe

    if cpu_moe.load() is None:
        pytest.skip("moe.c cannot be built here")
    logits = torch.randn(31, EXPERTS, generator=torch.Generator().manual_seed(5))
    for routing in (
        Routing(2, renormalize=True),
        Routing(3, renormalize=False),
        Routing(4, renormalize=False, scoring="topk_softmax"),
    ):
        done = cpu_moe.route(logits, routing.top_k, routing.scoring, routing.renormalize)
        assert done is not None
        want_weights, want_ids = select_experts(logits, routing)
        assert torch.equal(done[1], want_ids)
        torch.testing.assert_close(done[0], want_weights, rtol=1e-6, atol=1e-7)
