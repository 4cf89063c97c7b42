"""Tensor parallelism on a CPU mesh of 8 fake devices (a subprocess: the flag must precede jax's start),
and its programs exported and served."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from jaxinfer import LLM, SamplingParams, load_model
    from jaxinfer.sharding import make_mesh
    from jaxinfer.tiny import write_tiny_checkpoint

    assert len(jax.devices()) == 8
    path = write_tiny_checkpoint(sys.argv[1], "qwen3", with_tokenizer=False, max_position_embeddings=64)
    ids = [5, 17, 99, 3, 42, 7, 250, 1, 60]
    single_model = load_model(path)
    single = single_model.logits(ids)
    mesh = make_mesh(tensor_parallel=2)
    sharded_model = load_model(path, mesh=mesh)
    q_proj = sharded_model.params["model"]["layers_0"]["self_attn"]["q_proj"]["weight"]
    assert len(q_proj.sharding.device_set) == 2 and not q_proj.sharding.is_fully_replicated
    np.testing.assert_allclose(sharded_model.logits(ids), single, atol=1e-5)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    options = dict(max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16, warmup=False, show_progress=False)
    one = LLM(path, **options).generate(prompt_token_ids=[ids, ids[:4]], sampling_params=params)
    sharded_llm = LLM(path, mesh=mesh, **options)
    two = sharded_llm.generate(prompt_token_ids=[ids, ids[:4]], sampling_params=params)
    for prompt, a, b in zip([ids, ids[:4]], one, two):  # sharded sums round otherwise: equal up to a near tie
        assert len(a.token_ids) == len(b.token_ids) == 8
        step = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if step is not None:
            logits = single_model.logits(prompt + a.token_ids[:step])[-1]
            assert logits.max() - min(logits[a.token_ids[step]], logits[b.token_ids[step]]) <= 1e-4, (a, b)

    # The sharded programs export as data (their shardings in the description) and serve the same tokens.
    sharded_llm.export(sys.argv[1] + "-export")
    served = LLM(path, executables=sys.argv[1] + "-export", mesh=mesh, show_progress=False)
    assert [o.token_ids for o in served.generate(prompt_token_ids=[ids, ids[:4]], sampling_params=params)] == \
        [o.token_ids for o in two]

    # Experts split whole over the same axis (expert parallelism).
    moe_path = write_tiny_checkpoint(sys.argv[1] + "-moe", "qwen3_moe", with_tokenizer=False,
                                     max_position_embeddings=64)
    moe = load_model(moe_path, mesh=mesh)
    experts = moe.params["model"]["layers_0"]["mlp"]["experts"]["gate_proj"]
    assert experts.sharding.spec[0] == "model" and len(experts.sharding.device_set) == 2
    np.testing.assert_allclose(moe.logits(ids), load_model(moe_path).logits(ids), atol=1e-5)
    print("ok")
""")


def test_tensor_and_expert_parallel_match_single_device(tmp_path):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ckpt")], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
