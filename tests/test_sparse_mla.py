"""DeepSeek sparse attention (whole-model parity: tests/test_parity.py): DeepSeek-V3.2's and GLM-5's
indexer selections against transformers', the engine over the latent and indexer key caches
(batching, chunked prefill, preemption), the ops: the query-tiled path equals the reference, ties go
to the lower position, a long prompt's prefill stays within the memory of its tiles; and tensor
parallelism by head with the indexer replicated."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxinfer import load_model
from jaxinfer.kernels import registry
from jaxinfer.kernels import sparse_mla as sparse_ops
from jaxinfer.kernels.sparse_mla import attention_pallas, indexer_pallas, reference, tiled
from tests.conftest import assert_serving_is_consistent, random_prompts
from tests.families import GLM5, V32
from tests.test_mla import assert_split_by_head, run_tensor_parallel


@pytest.mark.parametrize("family, overrides", [("deepseek_v32", V32), ("glm_moe_dsa", GLM5)])
def test_the_selections_are_hfs(family, overrides, hf_checkpoint):
    """At every indexer layer, for both prompts: the indexer's inputs captured from HF's forward, our
    selection op over a paged key cache (pages in shuffled order) picks the keys HF picks."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import (apply_rotary_pos_emb,
                                                                         apply_rotary_pos_emb_interleave)

    rotate = apply_rotary_pos_emb_interleave if family == "glm_moe_dsa" else apply_rotary_pos_emb
    path, hf_model = hf_checkpoint(family, **overrides)
    page_size, rng = 4, np.random.RandomState(0)
    for ids in random_prompts([40, 23], seed=6):
        captured = []

        def capture(module, args, kwargs, topk):
            hidden, q_latent = args[0] if args else kwargs["hidden_states"], args[1] if len(args) > 1 else kwargs["q_resid"]
            cos, sin = args[2] if len(args) > 2 else kwargs["position_embeddings"]
            captured.append((module, hidden, q_latent, cos, sin, topk))

        indexers = [layer.self_attn.indexer for layer in hf_model.model.layers if layer.self_attn.indexer is not None]
        hooks = [indexer.register_forward_hook(capture, with_kwargs=True) for indexer in indexers]
        with torch.no_grad():
            hf_model(torch.tensor([ids]))
        for hook in hooks:
            hook.remove()
        assert len(captured) == len(indexers) == (2 if family == "glm_moe_dsa" else len(hf_model.model.layers))
        t = len(ids)
        for indexer, hidden, q_latent, cos, sin, topk in captured:
            with torch.no_grad():  # HF's own projections, rotated as HF rotates them
                rope = indexer.qk_rope_head_dim
                q = indexer.wq_b(q_latent).view(1, t, indexer.n_heads, indexer.head_dim)
                k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)
                q_rot, k_rot = rotate(q[..., :rope], k[..., :rope], cos, sin, unsqueeze_dim=2)
                q = torch.cat([q_rot, q[..., rope:]], dim=-1)[0].numpy()
                k = torch.cat([k_rot, k[..., rope:]], dim=-1)[0, :, 0].numpy()
                weights = (indexer.weights_proj(hidden).float() * indexer.n_heads ** -0.5)[0].numpy()
            pages = -(-t // page_size)
            table = rng.permutation(pages + 3)[:pages].astype(np.int32)  # spare pages stay empty
            slots = table[np.arange(t) // page_size] * page_size + np.arange(t) % page_size
            cache = reference.write_index_keys(jnp.zeros((pages + 3, page_size, k.shape[-1])), jnp.asarray(k),
                                               jnp.asarray(slots, jnp.int32))
            chosen = np.asarray(sparse_ops.indexer_select(
                jnp.asarray(q), jnp.asarray(weights), cache, jnp.arange(t, dtype=jnp.int32),
                jnp.zeros(t, jnp.int32), jnp.asarray(table)[None], scale=indexer.softmax_scale,
                top_k=indexer.index_topk))
            position_of = {int(s): p for p, s in enumerate(slots)}
            for p in range(t):
                ours = {position_of[int(s)] for s in chosen[p] if s >= 0}
                theirs = {int(j) for j in topk[0, p] if j <= p}  # HF's picks past the token are masked anyway
                assert ours == theirs, (p, sorted(ours), sorted(theirs))
                assert len(ours) == min(p + 1, indexer.index_topk)  # selection really prunes past 8 keys


def test_batched_chunked_and_preempted_equal_one_at_a_time(hf_checkpoint):
    path, _ = hf_checkpoint("deepseek_v32", **V32)
    tight = assert_serving_is_consistent(path)
    # A page of 16 tokens over 2 layers, float32: each token's latent + rope row and its indexer key.
    assert tight.engine.layout.bytes_per_page == 16 * 2 * ((16 + 8) + 16) * 4


def _step(seed=0, heads=4, width=16, page_size=4, lengths=(13, 1, 22), pad=3):
    """A ragged step over a shuffled paged cache: every sequence's tokens are all new; padding after."""
    rng = np.random.RandomState(seed)
    pages_per_seq = -(-max(lengths) // page_size)
    num_pages = pages_per_seq * len(lengths) + 2
    tables = rng.permutation(num_pages)[:pages_per_seq * len(lengths)].reshape(len(lengths), pages_per_seq)
    positions = np.concatenate([np.arange(n) for n in lengths] + [np.zeros(pad, int)]).astype(np.int32)
    seq_ids = np.concatenate([np.full(n, s) for s, n in enumerate(lengths)] + [np.full(pad, -1)]).astype(np.int32)
    t = len(positions)
    cache = jnp.asarray(rng.randn(num_pages, page_size, width), jnp.float32)
    q = jnp.asarray(rng.randn(t, heads, width), jnp.float32)
    weights = jnp.asarray(rng.randn(t, heads), jnp.float32)
    return q, weights, cache, jnp.asarray(positions), jnp.asarray(seq_ids), jnp.asarray(tables, jnp.int32)


@pytest.mark.parametrize("top_k", [1, 5, 64])  # 64: more than any sequence holds
def test_tiled_selection_equals_the_reference(top_k, monkeypatch):
    q, weights, cache, positions, seq_ids, tables = _step()
    want = reference.indexer_select(q, weights, cache, positions, seq_ids, tables, scale=0.25, top_k=top_k)
    monkeypatch.setattr(tiled, "TILE_BYTES", 4096)  # several tiles, the last one padded
    assert tiled.query_tile(q.shape[0], 4 * tables.shape[1] * cache.shape[1] * 22) < q.shape[0]
    got = tiled.indexer_select(q, weights, cache, positions, seq_ids, tables, scale=0.25, top_k=top_k)
    # Exact, though the scores may differ in their last bits: at every top-k boundary of _step()'s
    # scores the two sides are at least 4e-4 apart, or exactly tied zeros (ReLU), lower position first.
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    want = np.asarray(want)
    assert (want[np.asarray(seq_ids) < 0] == -1).all()  # padding selects nothing
    counts = (want >= 0).sum(axis=1)[np.asarray(seq_ids) >= 0]
    np.testing.assert_array_equal(counts, np.minimum(np.asarray(positions)[np.asarray(seq_ids) >= 0] + 1, top_k))


def test_tiled_sparse_attention_equals_the_reference(monkeypatch):
    rng = np.random.RandomState(3)
    t, heads, latent, rope, num_pages, page_size, k = 11, 4, 16, 8, 6, 4, 5
    cache = jnp.asarray(rng.randn(num_pages, page_size, latent + rope), jnp.float32)
    q_latent = jnp.asarray(rng.randn(t, heads, latent), jnp.float32)
    q_rope = jnp.asarray(rng.randn(t, heads, rope), jnp.float32)
    slots = rng.randint(0, num_pages * page_size, (t, k)).astype(np.int32)
    slots[2, 3:] = -1
    slots[7] = -1  # a token with nothing selected: zeros
    want = reference.sparse_mla_attention(q_latent, q_rope, cache, jnp.asarray(slots), scale=0.3)
    monkeypatch.setattr(tiled, "TILE_BYTES", 1024)
    got = tiled.sparse_mla_attention(q_latent, q_rope, cache, jnp.asarray(slots), scale=0.3)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(want[7]), 0.0)
    # Against dense attention over exactly the selected rows.
    rows = np.asarray(cache).reshape(-1, latent + rope)[slots[0]]
    scores = (np.einsum("hr,kr->hk", np.asarray(q_latent[0]), rows[:, :latent])
              + np.einsum("hp,kp->hk", np.asarray(q_rope[0]), rows[:, latent:])) * 0.3
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(want[0]), probs @ rows[:, :latent], rtol=1e-5, atol=1e-5)


def test_equal_scores_go_to_the_lower_position():
    q, weights, cache, positions, seq_ids, tables = _step(lengths=(9,), pad=0)
    same_keys = jnp.broadcast_to(cache[:1, :1], cache.shape)  # every key alike: every score ties
    slots = np.asarray(reference.indexer_select(q, weights, same_keys, positions, seq_ids, tables, scale=1.0, top_k=3))
    table, page_size = np.asarray(tables)[0], cache.shape[1]
    slot = lambda j: int(table[j // page_size] * page_size + j % page_size)  # noqa: E731
    expected = [[slot(j) for j in range(min(p + 1, 3))] + [-1] * (3 - min(p + 1, 3)) for p in range(9)]
    assert slots.tolist() == expected


def test_the_ops_default_to_the_tiled_path():
    q, weights, cache, positions, seq_ids, tables = _step()
    with registry.recording() as chosen:
        sparse_ops.indexer_select(q, weights, cache, positions, seq_ids, tables, scale=0.25, top_k=4)
    assert chosen == {"sparse_mla.indexer_select": {"tiled"}}


def test_the_attention_kernel_is_chosen_where_its_programs_fill_the_gpu():
    """At DeepSeek's shape (128 heads: 4 head blocks a token, 32 key blocks of a 2048-slot selection)
    the kernel's splits fill the GPU at every step; a selection of one key block cannot be split, and
    one token's 4 programs stay on the tiled path, where the kernel measured slower."""
    import jax

    gpu = registry.Target(platform="gpu", device_kind="NVIDIA H200", compute_capability="9.0", sm_count=132)
    cache = jax.ShapeDtypeStruct((64, 64, 576), jnp.bfloat16)
    for tokens, top_k, expected in ((1, 2048, "triton"), (16, 2048, "triton"), (32, 2048, "triton"),
                                    (8192, 2048, "triton"), (1, 64, "tiled"), (16, 64, "tiled"), (32, 64, "triton")):
        q_latent = jax.ShapeDtypeStruct((tokens, 128, 512), jnp.bfloat16)
        q_rope = jax.ShapeDtypeStruct((tokens, 128, 64), jnp.bfloat16)
        slots = jax.ShapeDtypeStruct((tokens, top_k), jnp.int32)
        chosen = sparse_ops.sparse_mla_attention_op.choose(gpu, q_latent, q_rope, cache, slots, scale=0.1)
        assert chosen.name == expected, (tokens, top_k)
    assert sparse_ops.sparse_mla_attention_op.choose(registry.Target.interpreted(), q_latent, q_rope, cache, slots,
                                                     scale=0.1).name == "triton"


def test_the_default_splits_fill_one_wave_of_the_sms():
    """The most power-of-two splits whose programs fit the 132 SMs, at most one per key block and what
    one combine program merges (32 partial rows of 512)."""
    from jaxinfer.kernels.sparse_mla import attention_pallas

    splits = lambda tokens, top_k, latent=512: attention_pallas.default_num_splits(  # noqa: E731
        tokens, 128, top_k, latent, 64, 2)
    assert registry.target_sms() == 132
    assert [splits(t, 2048) for t in (1, 2, 8, 16, 32, 33, 8192)] == [32, 16, 4, 2, 1, 1, 1]
    assert splits(1, 256) == 4  # four key blocks of 64
    assert splits(1, 64) == 1
    assert splits(1, 2048, latent=1024) == 16  # 8 head blocks of 16, and 16 partial rows of 1024 per combine
    # The dispatch counts the programs on its target's SMs, not this process's device's.
    import jax

    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in ((1, 128, 512), (1, 128, 64), (64, 64, 576))]
    slots = jax.ShapeDtypeStruct((1, 2048), jnp.int32)
    assert attention_pallas.programs(*args, slots, sms=132) == 128
    assert attention_pallas.programs(*args, slots, sms=16) == 16


def test_a_long_prompt_prefill_stays_within_its_tiles():
    """A 32k-token prefill at DeepSeek-V3.2's indexer shape (64 heads of 128, top 2048) and one 8-way
    tensor-parallel shard of its MLA (16 heads, latent 512 + 64): XLA's memory analysis of each op's
    compiled program. The bound is the step's per-token arrays with their float32 copies (up to 1.5 GiB
    here: the 16-head output alone is 0.5 GiB in bf16, 1 GiB in float32) plus two tiles (``2 *
    TILE_BYTES``); one dense score matrix over the step would be 4 GiB per head."""
    import jax

    S = jax.ShapeDtypeStruct
    t, page_size, top_k = 32768, 64, 2048
    pages = t // page_size
    bound = (3 << 29) + 2 * tiled.TILE_BYTES
    dense_scores_per_head = t * t * 4
    select = jax.jit(functools.partial(sparse_ops.indexer_select, scale=128 ** -0.5, top_k=top_k)).lower(
        S((t, 64, 128), jnp.bfloat16), S((t, 64), jnp.float32), S((pages, page_size, 128), jnp.bfloat16),
        S((t,), jnp.int32), S((t,), jnp.int32), S((1, pages), jnp.int32)).compile()
    attend = jax.jit(functools.partial(sparse_ops.sparse_mla_attention, scale=0.1)).lower(
        S((t, 16, 512), jnp.bfloat16), S((t, 16, 64), jnp.bfloat16), S((pages, page_size, 576), jnp.bfloat16),
        S((t, top_k), jnp.int32)).compile()
    for compiled in (select, attend):
        temp = compiled.memory_analysis().temp_size_in_bytes
        assert temp < bound < dense_scores_per_head, temp


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_sparse_attention_kernel_equals_the_reference(dtype, tol, num_splits):
    """Interpret mode: 20 heads (two head blocks, the second padded), 40 slots (three key blocks of
    16), a token with a short selection and one with none; in one program per token and head block,
    and in three splits merged (four partial slots allocated, the last never written)."""
    rng = np.random.RandomState(4)
    t, heads, latent, rope, num_pages, page_size, k = 5, 20, 32, 16, 6, 8, 40
    cache = jnp.asarray(rng.randn(num_pages, page_size, latent + rope), dtype)
    q_latent = jnp.asarray(rng.randn(t, heads, latent), dtype)
    q_rope = jnp.asarray(rng.randn(t, heads, rope), dtype)
    slots = rng.randint(0, num_pages * page_size, (t, k)).astype(np.int32)
    slots[1, 10:] = -1
    slots[3] = -1
    args = (q_latent, q_rope, cache, jnp.asarray(slots))
    assert attention_pallas.supports(*args, scale=0.2)
    got = attention_pallas.sparse_mla_attention(*args, scale=0.2, interpret=True, block_keys=16,
                                                num_splits=num_splits)
    want = reference.sparse_mla_attention(*args, scale=0.2)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.asarray(got[3], np.float32), 0.0)
    assert not attention_pallas.supports(q_latent[..., :24], q_rope, cache[..., 8:], jnp.asarray(slots))  # R=24
    assert not attention_pallas.supports(*args, num_splits=0)


def test_indexer_kernel_equals_the_reference():
    q, weights, cache, positions, seq_ids, tables = _step(heads=4, width=16)
    want = np.asarray(reference.indexer_scores(q, weights, cache, positions, seq_ids, tables, scale=0.25))
    got = np.asarray(indexer_pallas.indexer_scores(q, weights, cache, positions, seq_ids, tables, scale=0.25,
                                                   interpret=True))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-5, atol=1e-5)
    args = (q, weights, cache, positions, seq_ids, tables)
    assert indexer_pallas.supports(*args, scale=0.25, top_k=5)
    with registry.targeting(registry.Target.interpreted()), registry.recording() as chosen:
        slots = sparse_ops.indexer_select(*args, scale=0.25, top_k=5)
    assert chosen == {"sparse_mla.indexer_select": {"triton"}}
    # Exact: as in test_tiled_selection_equals_the_reference, no two scores at a boundary are near.
    np.testing.assert_array_equal(np.asarray(slots), np.asarray(reference.indexer_select(*args, scale=0.25, top_k=5)))
    assert not indexer_pallas.supports(q[..., :12], weights, cache[..., :12], *args[3:], scale=0.25, top_k=5)


def test_indexer_kernel_in_query_tiles(monkeypatch):
    q, weights, cache, positions, seq_ids, tables = _step(heads=4, width=16)
    args = (q, weights, cache, positions, seq_ids, tables)
    monkeypatch.setattr(tiled, "TILE_BYTES", 2048)  # tiles of 4 tokens: the last one padded
    got = indexer_pallas.indexer_select(*args, scale=0.25, top_k=5, interpret=True)  # exact: no near tie (above)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(reference.indexer_select(*args, scale=0.25, top_k=5)))


def test_the_kernels_serve_the_model_in_interpret_mode(hf_checkpoint):
    """DeepSeek-V3.2 with kernel-sized dims (R 16, P 16, index keys 16) through the Pallas kernels in
    interpret mode: logits as HF's."""
    path, hf_model = hf_checkpoint("deepseek_v32", **dict(V32, qk_rope_head_dim=16))
    ids = random_prompts([21], seed=8)[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    with registry.targeting(registry.Target.interpreted()), registry.recording() as chosen:
        logits = load_model(path, dtype="float32").logits(ids)
    assert chosen["sparse_mla.indexer_select"] == {"triton"}
    assert chosen["sparse_mla.sparse_mla_attention"] == {"triton"}
    np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=0)


def test_a_long_prompt_prefill_program_stays_far_below_dense_scores(tmp_path):
    """The whole forward of a 32k-token prompt, compiled (not run) for a 2-layer model with
    DeepSeek-V3.2's indexer (64 heads of 128, top 2048) and MLA latent (512 + 64) over 16 heads, bf16:
    XLA's temporary memory holds the step's activations (about 5 GiB here: per-token rows of the
    indexer's and MLA's queries, their float32 products) and one tile of scores at a time; one
    layer's dense attention scores over the step would be 64 GiB, the indexer's 256 GiB."""
    import jax

    from jaxinfer.cache.layout import CacheLayout
    from jaxinfer.cache.metadata import build_metadata
    from jaxinfer.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "long", "deepseek_v32", with_tokenizer=False, hidden_size=256,
                                 num_attention_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32,
                                 v_head_dim=32, index_n_heads=64, index_head_dim=128, index_topk=2048, q_lora_rank=64,
                                 intermediate_size=128, max_position_embeddings=32768)
    model = load_model(path, dtype="bfloat16")
    t, page_size = 32768, 64
    layout = CacheLayout(model.model_cls.cache_specs(model.config), page_size, t // page_size, model.dtype,
                         num_slots=1)

    def prefill(params, tokens, caches):
        md = build_metadata(jnp.zeros((1,), jnp.int32), jnp.full((1,), t, jnp.int32),
                            jnp.arange(t // page_size, dtype=jnp.int32)[None], page_size=page_size, num_tokens=t,
                            xp=jnp)
        return model.model.apply({"params": params}, tokens, md, caches)

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), model.params)
    compiled = jax.jit(prefill, donate_argnums=(2,)).lower(
        abstract, jax.ShapeDtypeStruct((t,), jnp.int32), layout.abstract(model.plan)).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    dense_attention_scores = 16 * t * t * 4
    assert temp < 8 * 2 ** 30 < dense_attention_scores, temp


@pytest.mark.parametrize("family, overrides, message", [
    ("deepseek_v32", dict(q_lora_rank=None), "q_lora_rank"),
    ("deepseek_v32", dict(index_head_dim=4), r"index_head_dim \(4\) must be at least qk_rope_head_dim \(8\)"),
    ("deepseek_v32", dict(mlp_layer_types=["dense", "moe"]), "mlp_layer_types"),  # transformers' own check
    ("glm_moe_dsa", dict(indexer_types=["shared", "full"]), "the first layer must be 'full'"),
    ("glm_moe_dsa", dict(indexer_types=["full"]), "indexer_types must list 'full' or 'shared' for each of the 2"),
])
def test_bad_sparse_attention_configs_are_specific_errors(family, overrides, message):
    from jaxinfer.config import ModelConfig
    from jaxinfer.errors import ConfigError
    from jaxinfer.registry import ModelRegistry
    from jaxinfer.tiny import tiny_config

    with pytest.raises(ConfigError, match=message):
        config = ModelConfig.from_dict({**tiny_config(family), **overrides})  # (None kept: an explicit null)
        ModelRegistry.resolve(config.architecture).validate_config(config)


@pytest.mark.parametrize("family, tp, overrides, interpret", [
    # Full and shared layers through the Pallas kernels (kernel-sized dims) in interpret mode.
    ("glm_moe_dsa", 2, dict(GLM5, first_k_dense_replace=4, qk_rope_head_dim=16), True),
])
def test_tensor_parallel_splits_heads_and_keeps_the_indexer_whole(family, tp, overrides, interpret, tmp_path):
    """Each device attends its heads over the selection of the whole indexer, which every device
    computes alike: logits, greedy tokens and logprobs as on one device."""
    found = run_tensor_parallel(tmp_path, family, tp, overrides, interpret=interpret)
    assert_split_by_head(found["pieces"], tp, ("q_b_proj", "kv_b_proj"),
                         ("q_a_proj", "kv_a_proj_with_mqa", "indexer/wq_b", "indexer/wk", "indexer/weights_proj"))
    if interpret:
        assert found["kernels"]["sparse_mla.indexer_select"] == ["triton"], found["kernels"]
        assert found["kernels"]["sparse_mla.sparse_mla_attention"] == ["triton"], found["kernels"]
