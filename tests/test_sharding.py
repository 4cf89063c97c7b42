"""Tensor, data and expert parallelism for every tiny family, on a CPU mesh of 8 fake devices.

Two subprocesses (the device-count flag must precede jax's start) run the checks and write their
findings as JSON; the tests below read them. Per family: logits at TP = 4 and TP = 2 x DP = 2 (MoE
experts split by width in the first, whole over the four devices in the second) against one device;
the engine's greedy tokens at TP = 2 x DP = 2 (experts over all four devices for MoE families), with
sequences on both ranks, against one device's logits of the same sequences; every declared split is real (each
device holds 1/ways of each split parameter and cache array). Once per mixer kind: the Pallas
kernels, in interpret mode, inside the per-device forward. Then strict mode on a sharded engine, an
export made on 4 devices served on 4 and refused on 2, the counts refused before loading, and two
processes (4 devices each: TP = 8 across them, or a TP = 4 rank in each with the experts over both)
serving one device's greedy tokens.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from jaxinfer.tiny import TINY_FAMILIES
from tests.families import FAMILIES as PARITY_FAMILIES

# Counts the tiny configs need to split 4 ways (heads of the linear-attention mixers), and MLA rope
# dims the MLA kernels take (powers of two from 16).
OVERRIDES = {
    "deepseek_v3": dict(qk_rope_head_dim=16),
    "deepseek_v32": dict(qk_rope_head_dim=16),
    "qwen3_next": dict(linear_num_key_heads=4, linear_num_value_heads=8),
    "qwen3_5": dict(linear_num_key_heads=4, linear_num_value_heads=8),
    "qwen3_5_moe": dict(linear_num_key_heads=4, linear_num_value_heads=8),
    "kimi_linear": dict(linear_attn_config=dict(kda_layers=[1, 2, 3], full_attn_layers=[4], num_heads=4, head_dim=16,
                                                short_conv_kernel_size=4)),
}
# Families whose caches are all MLA latents (and indexer keys): split by page over data-parallel
# ranks only, as declared.
REPLICATED_CACHES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "hy_v4")
MOE_FAMILIES = ("qwen3_moe", "minimax_m2", "gpt_oss", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "qwen3_5_moe",
                "minimax", "kimi_linear", "bailing_hybrid", "hy_v4")
# One family per mixer kind, for the kernels in interpret mode.
MIXER_KINDS = {"gqa": "qwen3", "mla": "deepseek_v3", "sparse_mla": "deepseek_v32", "gated_deltanet": "qwen3_next",
               "kda": "kimi_linear", "lightning": "minimax", "moe": "qwen3_moe"}
# The Pallas kernel each mixer kind's ops must be served by (interpret mode) in a prefill forward and a
# decode loop.
KERNEL_OPS = {"gqa": {"attention.rotary_cache_write": "rotary", "attention.ragged_paged_attention": "triton",
                      "attention.rotary_paged_decode_attention": "triton"},
              "mla": {"mla.mla_paged_decode_attention": "triton"},
              "sparse_mla": {"sparse_mla.indexer_select": "triton", "sparse_mla.sparse_mla_attention": "triton"},
              "gated_deltanet": {"gated_delta.gated_delta_rule": "triton", "gated_delta.recurrent_update": "triton"},
              "kda": {"kda.kda": "triton", "kda.recurrent_update": "triton"},
              "lightning": {"lightning.lightning_attention": "triton", "lightning.recurrent_update": "triton"},
              "moe": {"moe.moe_mlp": "grouped", "moe.route": "router"}}
# The families of the parity module that the tiny checkpoint writer builds (all but the aliases).
FAMILIES = [family for family in PARITY_FAMILIES if family in TINY_FAMILIES]

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from flax import traverse_util
    from jaxinfer import LLM, SamplingParams, load_model
    from jaxinfer.errors import ConfigError, ExportMismatchError
    from jaxinfer.kernels import registry
    from jaxinfer.tiny import write_tiny_checkpoint

    root, families, overrides, moe, kinds, rest = sys.argv[1], *map(json.loads, sys.argv[2:7])
    assert len(jax.devices()) == 8
    ids = [5, 17, 99, 3, 42, 7, 250, 1, 60, 11, 4]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine_options = dict(max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16, warmup=False,
                          show_progress=False)
    out = {"logits": {}, "splits": {}, "greedy": {}, "kernels": {}}

    def checkpoint(family):
        return write_tiny_checkpoint(f"{root}/{family}", family, with_tokenizer=False, max_position_embeddings=64,
                                     vocab_size=264, **overrides.get(family, {}))

    def unsplit(arrays, axes_of, plan):
        # Arrays whose device piece is not 1/ways of each split dimension.
        wrong = []
        for name, array in arrays.items():
            want = tuple(n // plan.ways(a) for n, a in zip(array.shape, axes_of(name)))
            if array.addressable_shards[0].data.shape != want:
                wrong.append(name)
        return wrong

    def param_splits(model):
        flat = {"/".join(k): v for k, v in traverse_util.flatten_dict(model.params).items()}
        axes = {"/".join(k): v for k, v in model.param_axes.items()}
        split = [n for n, a in axes.items() if any(model.plan.ways(x) > 1 for x in a)]
        return {"split": len(split), "unsplit": unsplit(flat, axes.get, model.plan)}

    def near_tie_free(single_logits, prompt, tokens):
        # Each greedy token is the one-device argmax of its prefix (up to a near tie).
        logits = single_logits(prompt + tokens)
        bad = []
        for i, token in enumerate(tokens):
            row = logits[len(prompt) - 1 + i]
            if row.max() - row[token] > 1e-4:
                bad.append(i)
        return bad

    prompts = [ids, ids[:4], ids[3:9]]
    for family in families:
        path = checkpoint(family)
        single = load_model(path)
        reference = single.logits(ids)
        # Four ways by tensor, and two by two (MoE experts split whole over its four devices there).
        configs = [(4, 1, False), (2, 2, family in moe)]
        for tp, dp, ep in configs:
            name = f"{family}-tp{tp}{f'-dp{dp}' if dp > 1 else ''}{'-ep' if ep else ''}"
            model = load_model(path, tensor_parallel_size=tp, data_parallel_size=dp, enable_expert_parallel=ep)
            out["logits"][name] = float(np.abs(model.logits(ids) - reference).max())
            out["splits"][name] = param_splits(model)
        # Two ranks of two devices, two sequences at most each: the three prompts run on both ranks.
        llm = LLM(path, tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=family in moe,
                  **engine_options)
        engine = llm.engine
        requests = [engine.make_request(p, greedy) for p in prompts]
        for request in requests:
            engine.add(request)
        engine.run(requests)
        plan, caches = llm.model.plan, engine.runner.caches
        cache_axes = {f"{i}/{name}": axes for i in range(len(caches))
                      for name, (_, _, axes) in engine.layout.layer_arrays(i).items()}
        flat_caches = {f"{i}/{name}": a for i, layer in enumerate(caches) for name, a in layer.items()}
        out["greedy"][family] = {
            "mismatches": [near_tie_free(single.logits, p, r.output_token_ids) for p, r in zip(prompts, requests)],
            "lengths": [len(r.output_token_ids) for r in requests],
            "ranks": sorted({r.rank for r in requests}),
            "cache_unsplit": unsplit(flat_caches, cache_axes.get, plan),
            "cache_specs": sorted({str(a.sharding.spec) for a in flat_caches.values()})}

    # The Pallas kernels in interpret mode, in a prefill forward and an engine's decode loop at TP = 2.
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for kind, family in kinds.items():
        path = checkpoint(family)
        single = load_model(path)
        with registry.targeting(registry.Target.interpreted()):
            model = load_model(path, tensor_parallel_size=2)
            with registry.recording() as chosen:
                logits = model.logits(ids)
            llm = LLM(path, tensor_parallel_size=2, **engine_options)
            tokens = llm.generate(prompt_token_ids=[ids], sampling_params=short)[0].token_ids
        for choices in llm.engine.runner.kernel_choices.values():
            for op, names in choices.items():
                chosen.setdefault(op, set()).update(names)
        out["kernels"][kind] = {"diff": float(np.abs(logits - single.logits(ids)).max()),
                                "mismatches": near_tie_free(single.logits, ids, tokens),
                                "chosen": {op: sorted(names) for op, names in chosen.items()}}

    if not rest:  # the checks below run in one of the processes
        print(json.dumps(out))
        sys.exit(0)

    # Strict mode on a sharded engine: the warm-up compiles the grid; serving compiles nothing.
    path = checkpoint("qwen3")
    strict = LLM(path, tensor_parallel_size=2, data_parallel_size=2,
                 **{**engine_options, "warmup": True, "strict": True})
    out["strict_tokens"] = [o.token_ids for o in strict.generate(prompt_token_ids=prompts, sampling_params=greedy)]

    # An export made on 4 devices serves on 4 and is refused on 2.
    four = LLM(path, tensor_parallel_size=4, **engine_options)
    expected = [o.token_ids for o in four.generate(prompt_token_ids=[ids], sampling_params=greedy)]
    four.export(f"{root}/export-tp4")
    served = LLM(path, executables=f"{root}/export-tp4", show_progress=False)
    out["export_same_tokens"] = [o.token_ids for o in served.generate(prompt_token_ids=[ids],
                                                                      sampling_params=greedy)] == expected
    try:
        LLM(path, executables=f"{root}/export-tp4", tensor_parallel_size=2, show_progress=False)
        out["export_on_two"] = "served"
    except ExportMismatchError as e:
        out["export_on_two"] = str(e)

    refused = {}
    for label, options in (("too_many_devices", dict(tensor_parallel_size=16)),
                           ("heads", dict(tensor_parallel_size=8)),
                           ("data_parallel", dict(tensor_parallel_size=4, data_parallel_size=4))):
        try:
            load_model(path, **options)
            refused[label] = "loaded"
        except ConfigError as e:
            refused[label] = str(e)
    out["refused"] = refused
    odd_vocab = write_tiny_checkpoint(f"{root}/odd-vocab", "qwen3", with_tokenizer=False, max_position_embeddings=64)
    model = load_model(odd_vocab, tensor_parallel_size=2)
    out["odd_vocab"] = {"replicated": sorted(model.plan.replicated),
                        "diff": float(np.abs(model.logits(ids) - load_model(odd_vocab).logits(ids)).max())}
    print(json.dumps(out))
""")

TWO_PROCESSES = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    from jaxinfer import LLM, SamplingParams
    process, port, path, parallelism = int(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    llm = LLM(path, coordinator_address=f"localhost:{port}", num_processes=2, process_id=process, **parallelism,
              max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16, warmup=False, show_progress=False)
    ids = [5, 17, 99, 3, 42, 7, 250, 1, 60, 11, 4]
    if llm.is_leader:
        outputs = llm.generate(prompt_token_ids=[ids, ids[:4], ids[3:9]],
                               sampling_params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        llm.shutdown()
        print(json.dumps([o.token_ids for o in outputs]))
    else:
        print(json.dumps({"calls": llm.follow()}))
""")

ONE_DEVICE_CHECK = textwrap.dedent("""
    import json, sys
    from jaxinfer import load_model
    model = load_model(sys.argv[1])
    ids = [5, 17, 99, 3, 42, 7, 250, 1, 60, 11, 4]
    bad = []
    for prompt, tokens in zip([ids, ids[:4], ids[3:9]], json.loads(sys.argv[2])):
        logits = model.logits(prompt + tokens)
        bad += [(len(prompt), i) for i, t in enumerate(tokens) if logits[len(prompt) - 1 + i].max() - logits[len(prompt) - 1 + i][t] > 1e-4]
    print(json.dumps(bad))
""")


def _env(devices: int | None = 8) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


@pytest.fixture(scope="module")
def findings(tmp_path_factory):
    """The script's findings from two processes at once (a CI machine's two cores): one takes the
    kernels, the checks after the families and a third of the families, the other the rest."""
    root = tmp_path_factory.mktemp("sharding")
    split = len(FAMILIES) // 3
    parts = [(FAMILIES[:split], MIXER_KINDS, True), (FAMILIES[split:], {}, False)]
    runs = []
    for i, (families, kinds, rest) in enumerate(parts):
        (root / str(i)).mkdir()
        with open(root / f"{i}.out", "w") as out, open(root / f"{i}.err", "w") as err:
            runs.append(subprocess.Popen([sys.executable, "-c", SCRIPT, str(root / str(i)),
                                          *[json.dumps(x) for x in (families, OVERRIDES, MOE_FAMILIES, kinds, rest)]],
                                         env=_env(), stdout=out, stderr=err))
    merged = {}
    for i, run in enumerate(runs):
        assert run.wait(timeout=1800) == 0, (root / f"{i}.err").read_text()[-4000:]
        for key, value in json.loads((root / f"{i}.out").read_text().strip().splitlines()[-1]).items():
            merged[key] = {**merged[key], **value} if isinstance(value, dict) and key in merged else value
    return merged


def _configs(family):
    return [f"{family}-tp4", f"{family}-tp2-dp2{'-ep' if family in MOE_FAMILIES else ''}"]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_one_device(family, findings):
    for name in _configs(family):
        assert findings["logits"][name] < 2e-5, (name, findings["logits"][name])


@pytest.mark.parametrize("family", FAMILIES)
def test_every_declared_split_is_real(family, findings):
    for name in _configs(family):
        splits = findings["splits"][name]
        assert splits["split"] > 0 and splits["unsplit"] == [], (name, splits)
    greedy = findings["greedy"][family]
    assert greedy["cache_unsplit"] == [], greedy
    # Pages and slots over the ranks; heads over the tensor devices, except MLA's latent rows.
    assert all("'data'" in spec for spec in greedy["cache_specs"]), greedy
    split_by_head = any("'model'" in spec for spec in greedy["cache_specs"])
    assert split_by_head != (family in REPLICATED_CACHES), greedy


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_one_device(family, findings):
    greedy = findings["greedy"][family]
    assert greedy["ranks"] == [0, 1] and greedy["lengths"] == [6, 6, 6], greedy
    assert greedy["mismatches"] == [[], [], []], greedy


@pytest.mark.parametrize("kind", sorted(MIXER_KINDS))
def test_kernels_run_on_local_shapes_inside_the_per_device_forward(kind, findings):
    result = findings["kernels"][kind]
    for op, kernel in KERNEL_OPS[kind].items():  # the mixer's Pallas kernels served its ops
        assert kernel in result["chosen"].get(op, []), (op, result)
    assert result["diff"] < 2e-5 and result["mismatches"] == [], result


def test_strict_mode_serves_a_sharded_engine(findings):
    assert [len(tokens) for tokens in findings["strict_tokens"]] == [6, 6, 6]


def test_an_export_serves_on_its_mesh_and_is_refused_on_another(findings):
    assert findings["export_same_tokens"]
    assert "tensor_parallel_size=2 (the export has 4)" in findings["export_on_two"]


def test_counts_that_cannot_work_are_refused_before_loading(findings):
    refused = findings["refused"]
    assert "needs 16 devices; 8 are available" in refused["too_many_devices"]
    assert "4 heads" in refused["heads"] and "do not split over 8 devices" in refused["heads"]
    assert "4 x 4 needs 16 devices; 8 are available" in refused["data_parallel"]


def test_a_vocabulary_that_does_not_split_stays_replicated(findings):
    assert findings["odd_vocab"]["replicated"] == ["vocab"] and findings["odd_vocab"]["diff"] < 2e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("family, parallelism", [
    ("llama", dict(tensor_parallel_size=8)),  # each layer split over both processes' devices
    # A data-parallel rank per process, its layers split over its 4 devices, the experts over all 8.
    ("qwen3_moe", dict(tensor_parallel_size=4, data_parallel_size=2, enable_expert_parallel=True)),
])
def test_two_processes_serve_the_tokens_of_one(family, parallelism, tmp_path):
    from jaxinfer.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "ckpt", family, with_tokenizer=False, max_position_embeddings=64,
                                 vocab_size=264, num_attention_heads=8)
    port, parallelism = str(_free_port()), json.dumps(parallelism)
    follower = subprocess.Popen([sys.executable, "-c", TWO_PROCESSES, "1", port, path, parallelism], env=_env(None),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    leader = subprocess.run([sys.executable, "-c", TWO_PROCESSES, "0", port, path, parallelism], env=_env(None),
                            capture_output=True, text=True, timeout=600)
    follower_out, follower_err = follower.communicate(timeout=120)
    assert leader.returncode == 0, leader.stderr[-3000:]
    assert follower.returncode == 0, follower_err[-3000:]
    assert json.loads(follower_out.strip().splitlines()[-1])["calls"] > 1
    tokens = json.loads(leader.stdout.strip().splitlines()[-1])
    assert [len(t) for t in tokens] == [6, 6, 6]
    # Each token is one device's greedy choice for its prefix (up to a near tie).
    check = subprocess.run([sys.executable, "-c", ONE_DEVICE_CHECK, path, json.dumps(tokens)], env=_env(None),
                           capture_output=True, text=True, timeout=600)
    assert check.returncode == 0, check.stderr[-3000:]
    assert json.loads(check.stdout.strip().splitlines()[-1]) == []


def test_info_gives_the_bytes_each_device_holds(tmp_path, capsys):
    """On any machine (an abstract mesh): the weights split 4 ways, and a count that does not split
    is refused."""
    from jaxinfer.cli import main
    from jaxinfer.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "ckpt", "qwen3", with_tokenizer=False, vocab_size=264)
    assert main(["info", path, "--tensor-parallel-size", "4"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("per device:"))
    assert "on each of 4 devices" in line and "KV heads on 2 device(s) each" in line
    assert main(["info", path, "--tensor-parallel-size", "2", "--data-parallel-size", "2"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("per device:"))
    assert "on each of 4 devices" in line and "data_parallel_size=2" in line
    assert main(["info", path, "--tensor-parallel-size", "3"]) == 2
    assert "num_key_value_heads (2) and tensor_parallel_size (3)" in capsys.readouterr().err


@pytest.mark.parametrize("arguments, message", [
    (("localhost:1234", 2, None), "need all three"),
    (("localhost:1234", 2, 2), "an id in \\[0, count\\)"),
    ((None, 2, 0), "give HOST:PORT"),
])
def test_incomplete_multi_host_arguments_are_a_config_error(arguments, message, monkeypatch):
    from jaxinfer.engine import multihost
    from jaxinfer.errors import ConfigError

    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match=message):
        multihost.initialize(*arguments)
