"""Mixture-of-experts: model parity against transformers, the MXFP4 loader, routers, the expert op and the
one-token block."""

from __future__ import annotations

import dataclasses
import os
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from jaxinfer import load_model
from jaxinfer.kernels import moe as moe_ops
from jaxinfer.kernels import registry
from jaxinfer.kernels.context import KernelContext
from jaxinfer.kernels.moe import block_mgpu, gated_activation, moe_mlp
from jaxinfer.models.gpt_oss import FP4_VALUES, dequantize_mxfp4
from jaxinfer.models.layers.moe import MoESpec, SparseMoE, route
from jaxinfer.models.layers.norm import NormWeight, RMSNorm
from tests.conftest import assert_greedy_matches_hf, make_hf_checkpoint, random_prompts

MOE = dict(head_dim=16, intermediate_size=48)
CASES = {
    # Sparse layer 0, dense layer 1 (mlp_only_layers); renormalised and raw top-k weights.
    "qwen3_moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen3_moe-unnormalised": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                                 norm_topk_prob=False)),
    # Partial RoPE from the legacy rotary_dim, whole-vector q/k norm, sigmoid + correction-bias routing.
    "minimax_m2": ("minimax_m2", dict(num_local_experts=8, num_experts_per_tok=2, rotary_dim=8, bos_token_id=1,
                                      eos_token_id=2)),
    # Sinks, sliding window (8) shorter than the prompt on even layers, YaRN, biased experts.
    "gpt_oss": ("gpt_oss", dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=8)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_greedy_tokens_match_hf(case, hf_checkpoint):
    family, overrides = CASES[case]
    path, hf_model = hf_checkpoint(family, **MOE, **overrides)
    ids = random_prompts([40], seed=1)[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(load_model(path, dtype="float32").logits(ids), ref, atol=1e-4, rtol=0)

    assert_greedy_matches_hf(path, hf_model, random_prompts([9, 26], seed=2), max_num_seqs=2)


def _quantize_mxfp4(rng, experts, rows, cols):
    """Random MXFP4 tensors (blocks [E, rows, cols/32, 16], scales [E, rows, cols/32])."""
    blocks = rng.randint(0, 256, size=(experts, rows, cols // 32, 16)).astype(np.uint8)
    scales = rng.randint(120, 126, size=(experts, rows, cols // 32)).astype(np.uint8)
    return blocks, scales


def test_dequantize_mxfp4_nibble_order_and_scale():
    blocks = np.array([[[0x21]]], np.uint8)  # low nibble 1 (0.5), high nibble 2 (1.0)
    scales = np.array([[128]], np.uint8)  # 2 ** 1
    np.testing.assert_array_equal(dequantize_mxfp4(blocks, scales), [[[1.0, 2.0]]][0])
    assert FP4_VALUES[0b1111] == -6.0


def test_gpt_oss_mxfp4_checkpoint(tmp_path):
    """Write GPT-OSS experts as MXFP4 blocks/scales; the model must equal HF run on the dequantised weights."""
    family, overrides = CASES["gpt_oss"]
    # MXFP4 groups 32 values: hidden and expert width must be multiples of 32.
    path, hf_model = make_hf_checkpoint(tmp_path / "dense", family, **{**MOE, "intermediate_size": 64}, **overrides)
    cfg = hf_model.config
    experts, hidden, inter = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    rng = np.random.RandomState(0)
    out_dir = tmp_path / "mxfp4"
    shutil.copytree(path, out_dir)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    with torch.no_grad():
        for i, layer in enumerate(hf_model.model.layers):
            prefix = f"model.layers.{i}.mlp.experts"
            gu_blocks, gu_scales = _quantize_mxfp4(rng, experts, 2 * inter, hidden)
            d_blocks, d_scales = _quantize_mxfp4(rng, experts, hidden, inter)
            # HF's own layout for the dense weights: the dequantised [E, out, in] transposed to x @ W.
            layer.mlp.experts.gate_up_proj.copy_(torch.from_numpy(dequantize_mxfp4(gu_blocks, gu_scales)).transpose(1, 2))
            layer.mlp.experts.down_proj.copy_(torch.from_numpy(dequantize_mxfp4(d_blocks, d_scales)).transpose(1, 2))
            del tensors[f"{prefix}.gate_up_proj"], tensors[f"{prefix}.down_proj"]
            tensors.update({f"{prefix}.gate_up_proj_blocks": gu_blocks, f"{prefix}.gate_up_proj_scales": gu_scales,
                            f"{prefix}.down_proj_blocks": d_blocks, f"{prefix}.down_proj_scales": d_scales})
    save_file(tensors, str(out_dir / "model.safetensors"))
    ids = random_prompts([30], seed=4)[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    ours = load_model(out_dir, dtype="float32").logits(ids)
    np.testing.assert_allclose(ours, ref, atol=1e-4 * max(1.0, np.abs(ref).max()), rtol=0)


def test_grouped_sigmoid_router_matches_numpy():
    """DeepSeek-style routing: groups scored by their top-2, best groups kept, bias only for choice."""
    rng = np.random.RandomState(0)
    logits = rng.randn(5, 16).astype(np.float32)
    bias = (0.3 * rng.randn(16)).astype(np.float32)
    spec = MoESpec(num_experts=16, top_k=3, intermediate_size=8, router="sigmoid_bias", n_group=4, topk_group=2,
                   norm_topk_prob=True, norm_eps=1e-20, routed_scaling_factor=2.5)
    weights, ids = route(jnp.asarray(logits), spec, jnp.asarray(bias))
    scores = 1 / (1 + np.exp(-logits))
    for t in range(5):
        choice = scores[t] + bias
        group_score = np.sort(choice.reshape(4, 4), axis=1)[:, -2:].sum(1)
        groups = np.argsort(-group_score)[:2]
        masked = np.where(np.isin(np.arange(16) // 4, groups), choice, 0.0)
        want = np.argsort(-masked)[:3]
        assert sorted(np.asarray(ids[t]).tolist()) == sorted(want.tolist())
        w = scores[t][np.asarray(ids[t])]
        np.testing.assert_allclose(np.asarray(weights[t]), w / (w.sum() + 1e-20) * 2.5, rtol=1e-6)


@pytest.mark.parametrize("activation", ["silu", "gpt_oss"])
def test_moe_mlp_matches_a_loop_over_tokens(activation):
    rng = np.random.RandomState(1)
    t, h, i, e, k = 7, 16, 8, 5, 2
    x = rng.randn(t, h).astype(np.float32)
    gate, up = rng.randn(e, i, h).astype(np.float32), rng.randn(e, i, h).astype(np.float32)
    down = rng.randn(e, h, i).astype(np.float32)
    biases = [rng.randn(e, i).astype(np.float32), rng.randn(e, i).astype(np.float32), rng.randn(e, h).astype(np.float32)]
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
    weights = rng.rand(t, k).astype(np.float32)
    out = moe_mlp(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(weights), gate, up, down, gate_bias=biases[0],
                  up_bias=biases[1], down_bias=biases[2], activation=activation)
    want = np.zeros_like(x)
    for token in range(t):
        for slot in range(k):
            ex = ids[token, slot]
            hidden = gated_activation(jnp.asarray(gate[ex] @ x[token] + biases[0][ex]),
                                      jnp.asarray(up[ex] @ x[token] + biases[1][ex]), activation)
            want[token] += weights[token, slot] * (down[ex] @ np.asarray(hidden) + biases[2][ex])
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)


def test_moe_checkpoint_errors_name_the_tensor_and_key(tmp_path):
    import json

    from jaxinfer import CheckpointError, ConfigError
    from jaxinfer.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", with_tokenizer=False)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        load_model(path)

    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    del raw["num_experts"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    # Left out, num_experts is HF's default (128), which the checkpoint's 8 experts contradict.
    with pytest.raises(ConfigError, match=r"num_experts is 128, but the checkpoint's tensors hold experts 0..7"):
        load_model(path)


class _MoEBlock(nn.Module):
    """A decoder layer's MoE half: the norm module and the block, or the block taking both."""

    spec: MoESpec
    whole: bool

    @nn.compact
    def __call__(self, attn_out, residual):
        moe = SparseMoE(self.spec, name="mlp")
        if self.whole:
            weight = NormWeight(attn_out.shape[-1], name="post_attention_layernorm")()
            return moe(attn_out, block=(residual, weight, 1e-6, KernelContext(jnp.int32(7))))
        h, residual = RMSNorm(1e-6, name="post_attention_layernorm")(attn_out, residual)
        return moe(h), residual


@pytest.mark.parametrize("num_tokens", [1, 5])
def test_moe_block_is_the_norm_and_the_block(num_tokens):
    spec = MoESpec(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True)
    rng = np.random.RandomState(0)
    attn_out, residual = (jnp.asarray(rng.randn(num_tokens, 64), jnp.float32) for _ in range(2))
    params = _MoEBlock(spec, whole=False).init(jax.random.PRNGKey(0), attn_out, residual)
    whole_params = _MoEBlock(spec, whole=True).init(jax.random.PRNGKey(0), attn_out, residual)
    assert jax.tree.map(jnp.shape, whole_params) == jax.tree.map(jnp.shape, params)  # one checkpoint layout
    for target in (registry.current_target(), registry.Target.interpreted()):  # the reference; the block's ops
        with registry.targeting(target):
            out, h = _MoEBlock(spec, whole=False).apply(params, attn_out, residual)
            block_out, block_residual = _MoEBlock(spec, whole=True).apply(params, attn_out, residual)
        np.testing.assert_array_equal(np.asarray(block_out), np.asarray(out))
        np.testing.assert_array_equal(np.asarray(block_residual), np.asarray(h))


def test_which_moe_blocks_are_one_op():
    spec = MoESpec(num_experts=8, top_k=2, intermediate_size=32)
    assert spec.is_plain_block
    for other in (dict(router="sigmoid_bias"), dict(router="topk_softmax"), dict(expert_bias=True),
                  dict(router_bias=True), dict(activation="gpt_oss"), dict(shared_intermediate_size=16),
                  dict(routed_scaling_factor=2.5), dict(router_float32=True)):
        assert not dataclasses.replace(spec, **other).is_plain_block, other


HOPPER = registry.Target(platform="gpu", device_kind="NVIDIA H200", compute_capability="9.0", sm_count=132)


def test_moe_block_kernel_takes_only_its_shapes():
    bf = lambda *shape: jnp.zeros(shape, jnp.bfloat16)  # noqa: E731
    x, gate, down, router = bf(1, 2048), bf(128, 768, 2048), bf(128, 2048, 768), bf(128, 2048)
    semantics = dict(top_k=8, router="softmax_topk", norm_topk_prob=True, activation="silu", has_biases=False)
    assert block_mgpu.fits(x, gate, gate, down, router, **semantics)
    for other in (dict(top_k=4), dict(norm_topk_prob=False), dict(router="sigmoid_bias"), dict(has_biases=True),
                  dict(activation="gpt_oss")):
        assert not block_mgpu.fits(x, gate, gate, down, router, **{**semantics, **other}), other
    assert not block_mgpu.fits(bf(2, 2048), gate, gate, down, router, **semantics)
    assert not block_mgpu.fits(x.astype(jnp.float32), gate, gate, down, router, **semantics)
    assert not block_mgpu.fits(x, bf(64, 768, 2048), gate, down, router, **semantics)
    # Where it runs: a Hopper GPU of 132 SMs, one device, a kernel context for its flags.
    assert block_mgpu.device_fits(HOPPER)
    for other in (dict(sm_count=114), dict(mesh_size=2), dict(compute_capability="8.0"), dict(platform="cpu")):
        assert not block_mgpu.device_fits(dataclasses.replace(HOPPER, **other)), other
    assert not block_mgpu.device_fits(registry.Target.interpreted())  # Mosaic GPU has no interpreter
    norm, context = bf(2048), KernelContext(jnp.int32(3))
    block = moe_ops.moe_block_op
    args = (x, x, norm, router, gate, gate, down)
    assert block.choose(HOPPER, *args, eps=1e-6, top_k=8, context=context).name == "block_mgpu"
    assert block.choose(HOPPER, *args, eps=1e-6, top_k=8).name == "ops"  # no context: no flags
    assert block.choose(HOPPER, *args, eps=1e-6, top_k=4, context=context).name == "ops"
    assert block.choose(registry.current_target(), *args, eps=1e-6, top_k=8, context=context).name == "reference"
    flag = block_mgpu.flag_words(1)
    with pytest.raises(ValueError, match="does not take attn_out float32"):
        block_mgpu.moe_block(x.astype(jnp.float32), x, norm, router, gate, gate, down, flag, eps=1e-6)
    with pytest.raises(ValueError, match="residual"):
        block_mgpu.moe_block(x, bf(2, 2048), norm, router, gate, gate, down, flag, eps=1e-6)
    with pytest.raises(ValueError, match="needs a flag"):
        block_mgpu.moe_block(x, x, norm, router, gate, gate, down, None, eps=1e-6)
    with pytest.raises(ValueError, match=r"32 int32 words \(block_mgpu.flag_words\(flag\)\), not int32\(\)"):
        block_mgpu.moe_block(x, x, norm, router, gate, gate, down, jnp.int32(1), eps=1e-6)


def test_moe_block_kernel_status_words_report_every_failure():
    flag = block_mgpu.flag_words(jnp.int32(41))
    own = np.int32(np.uint32(41 | 1 << 31).view(np.int32))
    status = np.zeros((block_mgpu.NUM_SMS, 2), np.int32)
    status[:, 1] = own

    def failed(words):
        outputs = block_mgpu.BlockOutputs(None, None, None, None, jnp.asarray(words))
        return np.asarray(block_mgpu.timed_out(outputs, flag))

    assert not failed(status).any()
    gave_up = status.copy()
    gave_up[5, 0] = 1  # a wait of CTA 5 reached its spin limit
    assert failed(gave_up).tolist() == [i == 5 for i in range(block_mgpu.NUM_SMS)]
    never_ran = status.copy()
    never_ran[7, 1] = own - 1  # CTA 7's word is an earlier call's: it never ran
    assert failed(never_ran)[7] and failed(never_ran).sum() == 1


def test_moe_block_flag_words():
    words = block_mgpu.flag_words(jnp.int32(41))
    assert words.shape == (block_mgpu.FLAG_WORDS,) and words.dtype == jnp.int32
    assert int(words[0]) == 41 and not np.asarray(words[1:]).any()
