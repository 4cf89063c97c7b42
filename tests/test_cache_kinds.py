"""The cache kinds beyond K/V pages, through the whole engine: a paged side cache and per-sequence
state slots, used by a small fake mixer, plus the sizes the specs give without allocating.

The fake mixer keeps the running sum of its inputs twice: in a state slot (carried from step to
step) and as per-token rows of a side cache (summed back through the block table). Its output uses
both, so the engine's incremental serving (chunked prefill, decode loops, preemption, slots reused
by new sequences) matches a full forward only if both caches carry exactly the right values.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, ModelRegistry, SamplingParams
from jaxinfer.cache import CacheLayout, PagedKV, PagedLatent, PagedSide, SlotAllocator, StateSlots
from jaxinfer.models.decoder import DecoderForCausalLM, DecoderSpec, DenseMLP, LayerSpec
from jaxinfer.models.layers.linear import Linear
from jaxinfer.sharding import ShardingPlan, make_mesh
from jaxinfer.tiny import write_tiny_checkpoint
from tests.conftest import assert_same_greedy_tokens, random_prompts


class RunningSum(nn.Module):
    hidden: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, cache, md, rotary):
        x = x.normed()
        x32 = x.astype(jnp.float32)
        seq = jnp.maximum(md.token_seq_ids, 0)
        valid = md.valid[:, None]
        # State: each sequence's sum before this step (zero when it starts fresh), plus the inclusive
        # sum of its tokens in this step.
        before = jnp.where(md.fresh[:, None], 0.0, cache["sum"][jnp.maximum(md.state_slots, 0)])
        inclusive = jnp.cumsum(jnp.where(valid, x32, 0.0), axis=0)
        start = jnp.concatenate([jnp.zeros((1, x.shape[-1])), inclusive])[md.query_start[:-1]]
        from_state = before[seq] + inclusive - start[seq]
        last = jnp.maximum(md.query_start[1:] - 1, 0)  # each sequence's last token row in this step
        has_tokens = (md.query_start[1:] > md.query_start[:-1]) & md.valid[last] & (md.state_slots >= 0)
        new_sum = from_state[last]
        slots = jnp.where(has_tokens, md.state_slots, cache["sum"].shape[0])  # out of range: dropped
        state = cache["sum"].at[slots].set(new_sum, mode="drop")
        # Side cache: this step's inputs as per-token rows, then every row of the sequence up to the token.
        num_pages, page_size, width = cache["seen"].shape
        flat = cache["seen"].reshape(num_pages * page_size, width)
        rows = jnp.where(md.slot_mapping < 0, num_pages * page_size, md.slot_mapping)
        flat = flat.at[rows].set(x.astype(flat.dtype), mode="drop")
        seen = flat.reshape(num_pages, page_size, width)
        per_seq = seen[md.block_tables].reshape(md.num_seqs, -1, width)[seq]  # [T, P * page_size, width]
        visible = jnp.arange(per_seq.shape[1])[None, :] <= md.positions[:, None]
        from_side = jnp.sum(jnp.where(visible[..., None], per_seq.astype(jnp.float32), 0.0), axis=1)
        out = Linear(self.hidden, False, self.param_dtype, name="state_proj")(from_state.astype(x.dtype))
        out = out + Linear(self.hidden, False, self.param_dtype, name="side_proj")(from_side.astype(x.dtype))
        return jnp.where(valid, out, 0.0), {"sum": state, "seen": seen}


@dataclasses.dataclass(frozen=True)
class RunningSumMixer:
    name: str = "self_attn"

    def validate(self, config):
        pass  # no config fields of its own

    def cache_specs(self, config):
        return (StateSlots((("sum", (config.hidden_size,), "float32", (None,)),)), PagedSide("seen", config.hidden_size))

    def rotary(self, config):
        return None

    def module(self, config, param_dtype):
        return RunningSum(config.hidden_size, param_dtype, name=self.name)


class RunningSumForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config):
        return DecoderSpec(tuple(LayerSpec(RunningSumMixer(), DenseMLP()) for _ in range(config.num_hidden_layers)))


@pytest.fixture(scope="module")
def running_sum_checkpoint(tmp_path_factory):
    ModelRegistry.register("RunningSumForCausalLM", RunningSumForCausalLM)
    return write_tiny_checkpoint(tmp_path_factory.mktemp("running-sum"), "llama", with_tokenizer=False,
                                 architectures=["RunningSumForCausalLM"], max_position_embeddings=64)


def _greedy_reference(llm, prompt, n):
    """Greedy tokens from repeated full forwards (no cache carried between them)."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(np.argmax(llm.model.logits(tokens)[-1])))
    return tokens[len(prompt):]


def test_state_slots_and_side_cache_carry_the_sequence(running_sum_checkpoint):
    llm = LLM(running_sum_checkpoint, max_model_len=48, max_num_seqs=3, max_num_batched_tokens=16, page_size=4,
              warmup=False, show_progress=False)
    assert llm.engine.layout.num_slots == 3
    prompts = random_prompts([3, 20, 9, 5, 14], vocab_size=259, seed=5)
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    # Five requests over three slots: slots are reused by later sequences, prompts are chunked.
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert_same_greedy_tokens([o.token_ids for o in outs], [_greedy_reference(llm, p, 9) for p in prompts], prompts,
                              lambda ids: llm.model.logits(ids)[-1])
    assert llm.engine.scheduler.slots.num_free == 3


def test_preemption_frees_and_restarts_state(running_sum_checkpoint):
    """Three sequences that cannot all fit in 14 pages: the newest is preempted (pages and slot
    freed) and recomputed from a fresh state, with the same tokens."""
    llm = LLM(running_sum_checkpoint, max_model_len=48, max_num_seqs=3, max_num_batched_tokens=16, page_size=4,
              num_pages=14, warmup=False, show_progress=False)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    requests = [engine.make_request(p, params) for p in random_prompts([12, 12, 12], vocab_size=259, seed=6)]
    for r in requests:
        engine.add(r)
    engine.run(requests)
    assert any(r.num_preemptions for r in requests)
    assert_same_greedy_tokens([r.output_token_ids for r in requests],
                              [_greedy_reference(llm, r.prompt_token_ids, 20) for r in requests],
                              [r.prompt_token_ids for r in requests], lambda ids: llm.model.logits(ids)[-1])
    assert engine.scheduler.slots.num_free == 3 and engine.scheduler.allocator.num_free == 14


def test_slot_allocator():
    slots = SlotAllocator(2)
    a, b = slots.allocate(), slots.allocate()
    assert {a, b} == {0, 1} and slots.num_free == 0
    with pytest.raises(RuntimeError, match="state slots are in use"):
        slots.allocate()
    slots.free(a)
    assert slots.allocate() == a


def test_sizes_come_from_the_specs_alone():
    """DeepSeek-V3's latent cache: (512 + 64) x 2 bytes per token per layer in bf16, over 61 layers."""
    latent = PagedLatent(latent_dim=512, rope_dim=64)
    assert latent.bytes_per_token(jnp.bfloat16) == (512 + 64) * 2
    specs = ((latent,),) * 61
    assert CacheLayout.bytes_per_token_for(specs, jnp.bfloat16) == 61 * 1152
    layout = CacheLayout(specs, page_size=64, num_pages=10, dtype=jnp.bfloat16)
    assert layout.bytes_per_page == 61 * 1152 * 64 and layout.total_bytes == 10 * layout.bytes_per_page
    kv = PagedKV(num_kv_heads=8, head_dim=128)
    assert kv.bytes_per_token(jnp.bfloat16) == 2 * 8 * 128 * 2
    state = StateSlots((("recurrent", (16, 128, 128), "float32", (None, None, None)), ("conv", (8192, 3), "bfloat16", (None, None))))
    assert state.bytes_per_token(jnp.bfloat16) == 0
    assert state.bytes_per_sequence(jnp.bfloat16) == 16 * 128 * 128 * 4 + 8192 * 3 * 2
    side = PagedSide("index_keys", 128)
    mixed = CacheLayout(((latent, side), (kv,), (state,)), page_size=64, num_pages=4, dtype=jnp.bfloat16, num_slots=2)
    assert mixed.bytes_by_kind() == {"PagedLatent": (1152, 0), "PagedSide": (256, 0), "PagedKV": (4096, 0),
                                     "StateSlots": (0, state.bytes_per_sequence(jnp.bfloat16))}
    assert mixed.total_bytes == 4 * 64 * (1152 + 256 + 4096) + 2 * state.bytes_per_sequence(jnp.bfloat16)
    shapes = jax.tree.map(lambda s: s.shape, mixed.abstract(ShardingPlan(make_mesh())))
    assert shapes[0] == {"latent": (4, 64, 576), "index_keys": (4, 64, 128)}
    assert shapes[2] == {"recurrent": (2, 16, 128, 128), "conv": (2, 8192, 3)}
    with pytest.raises(ValueError, match="name an array twice"):
        CacheLayout(((kv, kv),), page_size=4, num_pages=1, dtype=jnp.float32)


def test_metadata_builder_on_host_and_device_agree():
    """Two sequences (one continuing with 3 new tokens, one fresh with 2) in a step of 8 token rows
    and 3 sequence rows: the padding rows belong to no sequence, numpy and jax.numpy agree."""
    from jaxinfer.cache.metadata import build_metadata

    args = (np.array([5, 0, 0]), np.array([3, 2, 0]), np.array([[4, 7, 0], [2, 0, 0], [0, 0, 0]]))
    host = build_metadata(*args, page_size=4, num_tokens=8, state_slots=np.array([1, 0, -1]))
    device = build_metadata(*map(jnp.asarray, args), page_size=4, num_tokens=8, state_slots=jnp.array([1, 0, -1]),
                            xp=jnp)
    for field in ("positions", "slot_mapping", "token_seq_ids", "seq_lens", "logits_indices", "valid", "query_start",
                  "fresh", "state_slots"):
        np.testing.assert_array_equal(getattr(host, field), np.asarray(getattr(device, field)), err_msg=field)
    np.testing.assert_array_equal(host.positions, [5, 6, 7, 0, 1, 0, 0, 0])
    np.testing.assert_array_equal(host.slot_mapping, [29, 30, 31, 8, 9, -1, -1, -1])  # page 7 * 4 + 1, ...
    np.testing.assert_array_equal(host.token_seq_ids, [0, 0, 0, 1, 1, -1, -1, -1])
    np.testing.assert_array_equal(host.seq_lens, [8, 2, 0])
    np.testing.assert_array_equal(host.query_start, [0, 3, 5, 5])
    np.testing.assert_array_equal(host.logits_indices, [2, 4, 4])
    np.testing.assert_array_equal(host.fresh, [False, True, False])
    decode = build_metadata(np.array([8, 2]), np.array([1, 0]), np.array([[4, 7, 3], [2, 0, 0]]), page_size=4,
                            num_tokens=2, decode=True)
    np.testing.assert_array_equal(decode.slot_mapping, [12, -1])  # position 8: page 3, offset 0; row 1 finished
    np.testing.assert_array_equal(decode.seq_lens, [9, 0])
    np.testing.assert_array_equal(decode.token_seq_ids, [0, -1])
