"""Mixture-of-experts (whole-model parity: tests/test_parity.py): the MXFP4 loader against transformers,
routers, the expert op (its dropped ids), and the block under tensor and expert parallelism."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from jaxinfer import load_model
from jaxinfer.kernels import registry
from jaxinfer.kernels.moe import gated_activation, moe_mlp
from jaxinfer.quantization import FP4_VALUES, dequantize_mxfp4
from jaxinfer.models.layers.moe import MoESpec, route
from tests.conftest import make_hf_checkpoint, random_prompts
from tests.families import MOE
from tests.families import MOE_CASES as CASES


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


@pytest.mark.parametrize("target", ["reference", "interpreted"])
def test_moe_mlp_drops_ids_outside_its_experts(target):
    """Ids outside [0, E) (another device's experts) add exactly nothing: the output is the sum over the
    kept pairs alone, at a decode-sized step and at one token; with every id dropped it is zero."""
    rng = np.random.RandomState(2)
    t, h, i, e, k = 9, 16, 8, 4, 3
    x = jnp.asarray(rng.randn(t, h), jnp.float32)
    gate, up = (jnp.asarray(rng.randn(e, i, h), jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.randn(e, h, i), jnp.float32)
    biases = dict(gate_bias=jnp.asarray(rng.randn(e, i), jnp.float32), up_bias=jnp.asarray(rng.randn(e, i), jnp.float32),
                  down_bias=jnp.asarray(rng.randn(e, h), jnp.float32))
    global_ids = np.stack([rng.choice(2 * e, k, replace=False) for _ in range(t)]).astype(np.int32)
    weights = jnp.asarray(rng.rand(t, k), jnp.float32)
    local = np.where(global_ids < e, global_ids, -1)  # this device: experts [0, e); the others' become -1
    local[0, 0] = e + 3  # any id outside [0, E) is dropped
    chosen = registry.current_target() if target == "reference" else registry.Target.interpreted()
    with registry.targeting(chosen):
        out = moe_mlp(x, jnp.asarray(local), weights, gate, up, down, activation="gpt_oss", distinct_experts=True,
                      **biases)
        one = moe_mlp(x[:1], jnp.asarray(local[:1]), weights[:1], gate, up, down, activation="gpt_oss",
                      distinct_experts=True, **biases)
    want = np.zeros((t, h), np.float32)
    for token in range(t):
        for slot in range(k):
            ex = local[token, slot]
            if 0 <= ex < e:
                hidden = gated_activation(gate[ex] @ x[token] + biases["gate_bias"][ex],
                                          up[ex] @ x[token] + biases["up_bias"][ex], "gpt_oss")
                want[token] += float(weights[token, slot]) * np.asarray(down[ex] @ hidden + biases["down_bias"][ex])
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(one), want[:1], rtol=1e-5, atol=1e-5)
    every_id_dropped = moe_mlp(x, jnp.full((t, k), -1, jnp.int32), weights, gate, up, down, **biases)
    assert not np.asarray(every_id_dropped).any()


# The block alone on 4 CPU devices (a subprocess: the device count must precede jax's start): its
# output under tensor parallelism and expert parallelism, with the reference ops and with the Pallas
# kernels in interpret mode, against one device; one token, a decode-sized step and a prefill (the
# three groupings of the kernel). Biases and the correction bias are random (non-zero); the router
# is scaled so that tokens really choose.
SHARDED_BLOCK = textwrap.dedent("""
    import json, sys
    import flax.linen as nn
    import jax, jax.numpy as jnp, numpy as np
    from flax import traverse_util
    from jax.sharding import PartitionSpec as P
    from jaxinfer.kernels import registry
    from jaxinfer.models.layers.moe import MoESpec, SparseMoE
    from jaxinfer.sharding.forward import param_specs, sharded
    from jaxinfer.sharding.plan import make_mesh, resolve

    jax.config.update("jax_default_matmul_precision", "highest")
    SPECS = {
        "gpt_oss": MoESpec(num_experts=8, top_k=2, intermediate_size=32, router="topk_softmax", router_name="router",
                           router_bias=True, expert_bias=True, activation="gpt_oss"),
        "shared_sigmoid": MoESpec(num_experts=8, top_k=3, intermediate_size=16, router="sigmoid_bias",
                                  routed_scaling_factor=2.5, n_group=2, topk_group=1, norm_eps=1e-20,
                                  shared_intermediate_size=24, shared_expert_gated=True),
    }
    out = {}
    for name, spec in SPECS.items():
        module = SparseMoE(spec)
        rng = np.random.RandomState(0)
        x_all = jnp.asarray(rng.randn(80, 32), jnp.float32)
        boxed = traverse_util.flatten_dict(module.init(jax.random.PRNGKey(0), x_all[:2])["params"])
        params = {p: np.asarray(nn.unbox(v)) for p, v in boxed.items()}
        axes = {p: tuple(v.names) if isinstance(v, nn.Partitioned) else (None,) * params[p].ndim
                for p, v in boxed.items()}
        for p in params:
            if p[-1] in ("bias", "e_score_correction_bias") or p[-1].endswith("_bias"):
                params[p] = 0.3 * rng.randn(*params[p].shape).astype(np.float32)
            elif p[0] in ("gate", "router"):
                params[p] = 30 * params[p]
            else:  # experts that matter: outputs of order one
                params[p] = 10 * params[p]
        tree = traverse_util.unflatten_dict(params)
        shapes = {p: jax.ShapeDtypeStruct(v.shape, v.dtype) for p, v in params.items()}
        apply = lambda p, x: module.apply({"params": p}, x)
        targets = {"reference": registry.current_target(), "interpreted": registry.Target.interpreted()}
        want = {}
        for target, chosen in targets.items():
            for tokens in (1, 9, 80):
                with registry.targeting(chosen):  # traced afresh: the target picks the ops
                    want[target, tokens] = np.asarray(jax.jit(lambda p, x: apply(p, x))(tree, x_all[:tokens]))
        for tp, ep in ((2, False), (4, True)):  # experts split by width, and whole (test_sharding: the rest)
            plan = resolve(make_mesh(tp), axes, shapes, expert_parallel=ep)
            for (target, tokens), one in want.items():
                with registry.targeting(targets[target]):
                    forward = jax.jit(sharded(plan, apply, (param_specs(plan, axes), P()), P()))
                    got = np.asarray(forward(tree, x_all[:tokens]))
                key = f"{name}-tp{tp}{'-ep' if ep else ''}-{target}-{tokens}"
                out[key] = [float(np.abs(got - one).max()), float(np.abs(one).max())]
    print(json.dumps(out))
""")


def test_the_block_under_tensor_and_expert_parallelism_matches_one_device():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    result = subprocess.run([sys.executable, "-c", SHARDED_BLOCK], env=env, capture_output=True, text=True,
                            timeout=1800)
    assert result.returncode == 0, result.stderr[-4000:]
    diffs = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(diffs) == 2 * 2 * 2 * 3
    for key, (diff, scale) in diffs.items():
        assert scale > 0.1 and diff <= 1e-5 * scale, (key, diff, scale)
