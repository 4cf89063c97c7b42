"""The research handle (``load_model``): captures against transformers for every family (hidden
states; attention probabilities, router logits and choices, indexer selections and recurrent states
where the family has them), batched and padded inputs, prompt log-probabilities, bucketed shapes
that do not recompile, the errors of bad capture requests, and the research notebook executed."""

from __future__ import annotations

import contextlib
import os
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import traverse_util

from jaxinfer import load_model
from jaxinfer.engine.aot import CompileGuard
from jaxinfer.errors import InvalidRequestError
from jaxinfer.kernels.moe import reference as moe_reference
from jaxinfer.research import forward as research_forward
from jaxinfer.research import memory
from jaxinfer.research.batch import pack
from jaxinfer.research.request import CaptureRequest
from tests.conftest import random_prompts
from tests.families import GATED_DELTANET, GEMMA3, GLM5, MINIMAX, MLA, MLA_CASES, MOE, MOE_CASES, V32
from tests.families import KIMI_LINEAR as KIMI

# One checkpoint per family, configured as the family's own parity tests configure it (so a whole
# test run builds each once).
FAMILIES = {
    "llama": ("llama", {}),
    "mistral": ("mistral", dict(sliding_window=8)),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", dict(head_dim=32, tie_word_embeddings=True)),
    "gemma3": ("gemma3", GEMMA3["sliding-and-global"]),
    **{family: (family, dict(MOE, **MOE_CASES[family][1])) for family in ("qwen3_moe", "minimax_m2", "gpt_oss")},
    "deepseek_v3": ("deepseek_v3", dict(MLA, **MLA_CASES["q-lora-yarn-interleaved-groups"][1])),
    "sarvam_mla": ("sarvam_mla", dict(MLA, **MLA_CASES["sarvam-mla"][1])),
    "deepseek_v32": ("deepseek_v32", V32),
    "glm_moe_dsa": ("glm_moe_dsa", GLM5),
    **{family: (family, overrides) for family, overrides in GATED_DELTANET.items()},
    "kimi_linear": ("kimi_linear", KIMI),
    "minimax": ("minimax", MINIMAX),
}
PROMPT_LENGTHS = (21, 9)  # one batch: two sequences of different lengths, padded to 32 token rows
# A sequence alone and in a batch (other bucket shapes) goes through the same maths, but XLA may tile
# and sum a matmul or reduction differently per shape and per CPU: float32 results may differ in their
# last bits (one ulp of 5 is 4.8e-7). Mixing sequences up would differ by far more.
PADDED = dict(rtol=1e-5, atol=1e-6)


@contextlib.contextmanager
def eager_attention(hf_model):
    """HF returns attention probabilities only from its eager attention."""
    previous = hf_model.config._attn_implementation
    hf_model.set_attn_implementation("eager")
    try:
        yield
    finally:
        hf_model.set_attn_implementation(previous)


def _hooked(modules, keep):
    """Forward hooks appending ``keep(output)`` of each module to its own list."""
    records = [[] for _ in modules]
    hooks = [m.register_forward_hook(lambda mod, args, out, r=r: r.append(keep(out))) for m, r in zip(modules, records)]
    return records, hooks


def hf_reference(hf_model, ids, attention_layers, indexer_layers):
    """HF's hidden states, attention probabilities (per layer), router outputs (per MoE layer, in
    order), indexer top-k (per layer) and cache of one forward over ``ids``."""
    layers = hf_model.model.layers
    routers = []
    recorder = type(hf_model.model)._can_record_outputs.get("router_logits")
    if recorder is not None:
        routers = [m for m in hf_model.modules() if isinstance(m, recorder.target_class)]
    attn, hooks = _hooked([layers[i].self_attn for i in attention_layers], lambda out: out[1][0].numpy())
    routed, more = _hooked(routers, lambda out: [x.numpy() for x in out])
    selected, most = _hooked([layers[i].self_attn.indexer for i in indexer_layers], lambda out: out[0].numpy())
    try:
        with torch.no_grad(), eager_attention(hf_model):
            out = hf_model(torch.tensor([ids]), output_hidden_states=True, use_cache=True)
    finally:
        for hook in hooks + more + most:
            hook.remove()
    return dict(hidden_states=[h[0].numpy() for h in out.hidden_states], logits=out.logits[0].numpy(),
                attentions=dict(zip(attention_layers, (r[0] for r in attn))), routers=[r[0] for r in routed],
                indexer=dict(zip(indexer_layers, (r[0] for r in selected))), cache=out.past_key_values)


def hf_recurrent_state(cache, layer):
    """(recurrent state, conv state or None) of ``layer`` in HF's cache, batch row 0."""
    if hasattr(cache, "linear_cache"):  # MiniMax keeps its lightning state apart
        return cache.linear_cache[layer][0].numpy(), None
    entry = cache.layers[layer]
    return entry.recurrent_states[0][0].numpy(), entry.conv_states[0][0].numpy()


def routed_experts(model, layer, router_logits) -> list[int]:
    """The experts our routing picks, sorted, for one token's router logits at ``layer``. Where ours
    and HF's differ, each must be what this gives for its own router logits: the same rule on logits
    within 1e-5 of each other, which part only where two experts' scores (nearly) tie."""
    spec = research_forward.decoder_layers(model)[layer].ffn
    bias = next((value for path, value in traverse_util.flatten_dict(model.params).items()
                 if f"layers_{layer}" in path and path[-1] == "e_score_correction_bias"), None)
    _, ids = moe_reference.route(jnp.asarray(router_logits)[None], router=spec.router, top_k=spec.top_k,
                                 norm_topk_prob=spec.norm_topk_prob, norm_eps=spec.norm_eps,
                                 routed_scaling_factor=spec.routed_scaling_factor, n_group=spec.n_group,
                                 topk_group=spec.topk_group, correction_bias=bias)
    return sorted(np.asarray(ids)[0].tolist())


@pytest.fixture(scope="module")
def loaded(hf_checkpoint):
    """family -> (HF model, our model), each loaded once for the module."""
    cache = {}

    def get(family):
        if family not in cache:
            name, overrides = FAMILIES[family]
            path, hf_model = hf_checkpoint(name, **overrides)
            cache[family] = hf_model, load_model(path, dtype="float32")
        return cache[family]

    return get


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, loaded):
    return (request.param, *loaded(request.param))


def test_captures_match_hf(family):
    """One batched forward of two padded sequences capturing everything the family has; each
    sequence's captures equal HF's over that sequence alone."""
    name, hf_model, model = family
    available = model.captures()
    having = lambda capture: list(available.get(capture, ()))  # noqa: E731
    asked = sorted(available)
    hf_layers = hf_model.model.layers
    # Every mixer gives attention probabilities or a recurrent state; every HF indexer is captured.
    assert sorted(having("attentions") + having("recurrent_states")) == list(range(len(hf_layers)))
    assert having("indexer_selections") == [
        i for i, layer in enumerate(hf_layers) if getattr(getattr(layer, "self_attn", None), "indexer", None) is not None]
    prompts = random_prompts(PROMPT_LENGTHS, seed=3)
    results = model.forward(prompts, capture=asked)
    moe_layers = having("router_logits")
    for ids, ours in zip(prompts, results):
        ref = hf_reference(hf_model, ids, having("attentions"), having("indexer_selections"))
        np.testing.assert_allclose(ours.logits, ref["logits"], atol=1e-4, rtol=0)
        assert len(ours.hidden_states) == len(ref["hidden_states"]) == model.config.num_hidden_layers + 1
        for layer, (got, want) in enumerate(zip(ours.hidden_states, ref["hidden_states"])):
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=f"{name} hidden state {layer}")
        for layer, want in ref["attentions"].items():
            np.testing.assert_allclose(ours.attentions[layer], want, atol=1e-5, rtol=0, err_msg=f"{name} layer {layer}")
        assert len(ref["routers"]) == len(moe_layers)
        for layer, (logits, weights, experts) in zip(moe_layers, ref["routers"]):
            np.testing.assert_allclose(ours.router_logits[layer], logits, atol=1e-5, rtol=0)
            for t in range(len(ids)):  # the same experts with the same weights, in any order
                ours_t = sorted(zip(ours.selected_experts[layer][t].tolist(), ours.routing_weights[layer][t].tolist()))
                want_t = sorted(zip(experts[t].tolist(), weights[t].tolist()))
                if [e for e, _ in ours_t] != [e for e, _ in want_t]:  # only at a near tie: see routed_experts
                    assert routed_experts(model, layer, logits[t]) == [e for e, _ in want_t], (name, layer, t)
                    assert routed_experts(model, layer, ours.router_logits[layer][t]) == [e for e, _ in ours_t]
                    continue
                np.testing.assert_allclose([w for _, w in ours_t], [w for _, w in want_t], atol=1e-5, rtol=0)
        for layer, topk in ref["indexer"].items():
            for p in range(len(ids)):  # HF's picks past the token are masked anyway
                picked = set(ours.indexer_selections[layer][p].tolist()) - {-1}
                assert picked == {int(j) for j in topk[p] if j <= p}, (name, layer, p)
        for layer in having("recurrent_states"):
            state, conv = hf_recurrent_state(ref["cache"], layer)
            np.testing.assert_allclose(ours.recurrent_states[layer]["recurrent_state"], state, atol=1e-4, rtol=0)
            if conv is not None:  # HF keeps the last K conv inputs, channels first; we keep the last K - 1
                np.testing.assert_allclose(ours.recurrent_states[layer]["conv_state"], conv[:, 1:].T, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def llama(loaded):
    return loaded("llama")


def test_prompt_logprobs_are_hfs_log_softmax(llama):
    """vLLM's convention: None for the first token, then log p(token | the tokens before it)."""
    hf_model, model = llama
    prompts = random_prompts([12, 5], seed=4)
    got = model.prompt_logprobs(prompts)
    for ids, lps in zip(prompts, got):
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0], dim=-1).numpy()
        assert lps[0] is None and len(lps) == len(ids)
        np.testing.assert_allclose(lps[1:], [ref[t - 1, ids[t]] for t in range(1, len(ids))], atol=1e-4, rtol=0)
    alone = model.prompt_logprobs(prompts[1])  # one sequence alone (16 token rows, not 32): its list
    assert alone[0] is None and len(alone) == len(got[1])
    np.testing.assert_allclose(alone[1:], got[1][1:], **PADDED)


def test_a_new_length_within_a_bucket_reuses_the_compiled_forward(llama):
    """Token rows, sequences and pages are padded to power-of-two buckets: lengths 5..16 alone and
    any two sequences of up to 16 tokens together (in 16 rows) run the programs compiled once, and
    padding changes no result."""
    _, model = llama
    guard = CompileGuard.get()
    prompts = random_prompts([5, 7, 16, 3, 9, 4, 8], seed=7)
    alone = model.forward(prompts[0], capture="hidden_states")
    pair = model.forward(prompts[3:5], capture="hidden_states")
    with guard.counting() as compiles:
        others = [model.forward(ids, capture="hidden_states") for ids in prompts[1:3]]
        other_pair = model.forward(prompts[5:7], capture="hidden_states")
        assert compiles() == 0
    program = next(p for key, p in model._forwards.items() if key[1] == CaptureRequest(hidden_states=True))
    assert program.jitted._cache_size() == 2  # one per bucket: 16 rows x 1 sequence, 16 rows x 2 sequences
    assert [pack(p).token_ids.shape[0] for p in ([[1] * 16], [[1] * 17], [[1] * 9, [1] * 8])] == [16, 32, 32]
    assert pack([[1] * 17, [1] * 3, [1]]).block_tables.shape == (4, 2)  # 4 sequences, 32 positions each
    # A sequence's results do not depend on what it is padded or batched with: alone again, the same
    # program on the same inputs gives the same bits; next to another sequence, the same within PADDED.
    same = np.testing.assert_array_equal
    close = lambda got, want: np.testing.assert_allclose(got, want, **PADDED)  # noqa: E731
    for ids, result, check in [(prompts[0], alone, same), (prompts[1], others[0], same),
                               *((ids, r, close) for ids, r in zip(prompts[3:7], pair + other_pair))]:
        single = model.forward(ids, capture="hidden_states")
        check(result.logits, single.logits)
        for got, want in zip(result.hidden_states, single.hidden_states):
            check(got, want)


@pytest.fixture(scope="module")
def qwen3_next(loaded):
    return loaded("qwen3_next")[1]


@pytest.mark.parametrize("capture, message", [
    ("attention", r"unknown capture 'attention'; known: hidden_states, attentions, router_logits"),
    (42, r"capture must be a name, a list of names or \{name: layers\}, got int"),
    ({"hidden_states": [0]}, r"'hidden_states' takes no layers"),
    ({"attentions": [0]}, r"'attentions' comes from a softmax-attention layer; layer 0 is GatedDeltaNet \+ dense MLP, "
                          r"which has none; layers that have it: \[1\]"),
    ({"recurrent_states": 1}, r"layer 1 is GQA \+ MoE, which has none; layers that have it: \[0\]"),
    ({"router_logits": [2]}, r"layers \[2\] are out of range; the model has 2 layers \(0-1\)"),
    ({"router_logits": [True]}, r"layer indices must be integers, got \[True\]"),
    ({"router_logits": []}, r"the layer list is empty"),
    ("indexer_selections", r"'indexer_selections' comes from a sparse-attention layer with its own indexer, and this "
                           r"qwen3_next model has none \(layers 0: GatedDeltaNet \+ dense MLP, 1: GQA \+ MoE\)"),
])
def test_bad_capture_requests_name_the_problem(qwen3_next, capture, message):
    with pytest.raises(InvalidRequestError, match=message):
        qwen3_next.forward([1, 2, 3], capture=capture)


def test_bad_inputs_name_the_sequence_and_the_limit(llama):
    _, model = llama
    with pytest.raises(InvalidRequestError, match=r"token sequence 1 of the batch has token ids outside the vocabulary "
                                                  r"\[0, 160\): \[160\]"):
        model.forward([[1, 2], [3, 160]])
    with pytest.raises(InvalidRequestError, match="token sequence 1 of the batch is empty"):
        model.prompt_logprobs([[1, 2], []])
    with pytest.raises(InvalidRequestError, match="the token sequence is empty"):
        model.logits([])
    with pytest.raises(InvalidRequestError, match=r"attention probabilities of 2 layer\(s\) over 4096 token rows x "
                                                  r"4096 keys x 4 heads \(padded to buckets\) would take 512 MiB, more "
                                                  r"than the 256 MiB"):
        model.forward(list(range(3, 150)) * 27, capture="attentions")


def test_a_forward_too_large_for_the_memory_is_refused_before_it_runs(llama, monkeypatch):
    """A forward's memory estimate, an upper bound of the right order (checked against XLA's analysis
    of a compiled forward), is compared with the memory available (16 GiB here): 20,000 tokens, whose
    plain-jnp attention gathers every key for every token row, are refused once traced, nothing
    compiled or allocated; 4,000 tokens (4.3 GB by XLA's count) are not."""
    _, model = llama
    monkeypatch.setattr(memory, "available_bytes", lambda device=None: 16 << 30)
    long = random_prompts([20_000], seed=5)[0]
    start = time.perf_counter()
    message = (r"a research forward over 20000 tokens in 1 sequence\(s\) \(padded to 32768 token rows x 32768 keys\) "
               r"would need about \d+\.\d GiB \(an upper bound; \d+\.\d GiB of it one layer's attention arrays over "
               r"token rows x keys\), more than the 16\.0 GiB available on the CPU: give shorter sequences, or fewer "
               r"sequences per call")
    with pytest.raises(InvalidRequestError, match=message):
        model.forward(long)
    with pytest.raises(InvalidRequestError, match=r"over 20000 tokens in 4 sequence\(s\) \(padded to 32768 token "
                                                  r"rows x 8192 keys\) would need about \d+\.\d GiB"):
        model.prompt_logprobs([long[:5000]] * 4)
    assert time.perf_counter() - start < 10

    def estimate(sequences, request=CaptureRequest()):
        batch = pack(sequences)
        program = research_forward._program(model, request, logits=True, logprobs=False)
        args = (model.params, batch.token_ids, batch.num_new, batch.block_tables, batch.state_slots)
        served = program.implementations(*args)
        memory.check_fits(model, request, batch, served, logits=True, logprobs=False)
        return memory.estimate(model, request, batch, served, logits=True, logprobs=False)[0], program, args

    assert estimate([long[:4000]])[0] < 8 << 30  # not refused
    need, program, args = estimate([long[:700], long[:300]], CaptureRequest(hidden_states=True))
    analysis = program.jitted.lower(*args).compile().memory_analysis()
    allocated = analysis.temp_size_in_bytes + analysis.output_size_in_bytes
    assert allocated <= need <= 4 * allocated, (allocated, need)


def test_the_research_notebook_runs(tmp_path, monkeypatch):
    """docs/notebooks/research.ipynb executes top to bottom in a kernel of this interpreter (its
    tiny checkpoints under this session's JAXINFER_HOME, the kernel's files under ``tmp_path``)."""
    import json

    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    spec = tmp_path / "kernels" / "jaxinfer-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "jaxinfer tests", "language": "python"}))
    manager = KernelManager(kernel_name="jaxinfer-test",
                            kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")]))
    path = os.path.join(os.path.dirname(__file__), "..", "docs", "notebooks", "research.ipynb")
    notebook = nbformat.read(path, as_version=4)
    plots = lambda nb: [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]  # noqa: E731
    assert len(plots(notebook)) == 2, "the notebook is kept executed, its plots included"
    NotebookClient(notebook, km=manager, timeout=300, resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert len(plots(notebook)) == 2  # each cell's outputs are replaced as it runs
