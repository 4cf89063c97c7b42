"""Exported serving programs: a fresh process serves them with nothing traced or compiled and the
live engine's tokens; every mismatch (checkpoint, config, engine option, jax / device, a tampered
manifest, a truncated or corrupt program file) is refused with its own error before anything is
loaded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jaxinfer import LLM, CheckpointError, SamplingParams, load_model
from jaxinfer.engine.manifest import MANIFEST_FILE
from jaxinfer.errors import ExportError, ExportMismatchError
from tests.conftest import assert_same_greedy_tokens

# One mixed key (16 tokens) and two decode keys (1-2 sequences, one page of 32 tokens).
OPTIONS = dict(dtype="float32", max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16, page_size=32,
               show_progress=False)
# The session's tiny HF checkpoints, with the overrides tests/test_moe.py ("qwen3_moe") and
# tests/test_mla.py ("q-lora-yarn-interleaved-groups") give them, so that they are shared.
FAMILIES = {
    "llama": {},
    "qwen3_next": {},  # its gated delta rule solves a triangular system: LAPACK on the CPU
    "qwen3_moe": dict(head_dim=16, intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]),
    "deepseek_v3": dict(num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
                        v_head_dim=12, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                        n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1, q_lora_rank=32,
                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                             original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=0.8,
                                             beta_fast=32, beta_slow=1), n_group=2, topk_group=1),
}
PROMPTS = [[5, 17, 42, 99, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]]  # 17 tokens: a chunked prefill
GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)

# Runs in a fresh process: counts every XLA compile and every trace from the first jax import on,
# serves each export (strict), then the CLI on the first one, and prints what it saw as JSON.
_FRESH_PROCESS = r"""
import collections, contextlib, io, json, sys
import jax
events = collections.Counter()
jax.monitoring.register_event_duration_secs_listener(lambda event, seconds, **kw: events.update([event]))
from jaxinfer import LLM, SamplingParams
from jaxinfer.cli import main
jobs = json.loads(sys.argv[1])
out = {"tokens": {}, "reports": {}}
for family, (path, export, prompts, greedy) in jobs.items():
    llm = LLM(path, executables=export, strict=True, show_progress=False)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(**greedy))
    out["tokens"][family] = [o.token_ids for o in outs]
    out["reports"][family] = llm.startup_report.__dict__
family, (path, export, prompts, greedy) = next(iter(jobs.items()))
stdout = io.StringIO()
with contextlib.redirect_stdout(stdout):
    rc = main(["generate", "--executables", export, "--json", "--temperature", "0", "--ignore-eos",
               "--max-tokens", str(greedy["max_tokens"]), "--prompt-ids", ",".join(map(str, prompts[0])), "-v"])
out["cli"] = [rc, json.loads(stdout.getvalue().strip().splitlines()[-1])["token_ids"]]
out["compiles"] = events["/jax/core/compile/backend_compile_duration"]
out["traces"] = events["/jax/core/compile/jaxpr_trace_duration"]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def exports(hf_checkpoint, tmp_path_factory):
    """{family: (checkpoint, export dir, live greedy tokens)}: one export per family, the live tokens
    from the engine that exported (it serves with the programs it wrote)."""
    out = {}
    for family, overrides in FAMILIES.items():
        path, _ = hf_checkpoint(family, **overrides)
        llm = LLM(path, warmup=False, **OPTIONS)
        export = str(tmp_path_factory.mktemp(f"{family}-export") / "export")
        manifest = llm.export(export)
        assert {p.form for p in manifest.programs} == {"executable"}
        live = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(**GREEDY))]
        out[family] = (path, export, live)
    return out


@pytest.fixture(scope="module")
def fresh_process(exports):
    jobs = {family: (path, export, PROMPTS, GREEDY) for family, (path, export, _) in exports.items()}
    result = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, json.dumps(jobs)], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def test_a_fresh_process_serves_an_export_without_tracing_or_compiling(fresh_process):
    seen, _ = fresh_process
    assert seen["compiles"] == 0 and seen["traces"] == 0
    for report in seen["reports"].values():
        assert report["source"] == "export" and report["programs_compiled"] == 0
        assert report["programs_from_export"] == 3 + 2  # the grid, the cache allocation, the weights' check
        assert report["first_token_s"] is not None


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_exported_programs_give_the_live_engines_tokens(family, exports, fresh_process):
    seen, _ = fresh_process
    assert seen["tokens"][family] == exports[family][2]


def test_cli_serves_an_export_and_reports_its_start_up(exports, fresh_process):
    seen, stderr = fresh_process
    assert seen["cli"] == [0, exports["llama"][2][0]]
    assert "start-up (export):" in stderr and "from the export" in stderr


def test_the_manifest_is_readable_and_records_what_the_programs_need(exports):
    _, export, _ = exports["deepseek_v3"]
    with open(os.path.join(export, MANIFEST_FILE)) as f:
        text = f.read()
    manifest = json.loads(text)
    assert text.startswith("{\n  \"cache\"") and list(manifest) == sorted(manifest)
    assert manifest["engine"]["max_num_seqs"] == 2 and manifest["dtype"] == "float32"
    assert manifest["mesh"] == {"axis_names": ["data", "model", "kv_replica"], "shape": [1, 1, 1], "plan": {
        "tensor_parallel_size": 1, "data_parallel_size": 1, "kv_replicas": 1, "expert_parallel": False,
        "replicated": []}}
    assert all(len(p["axes"]) == len(p["shape"]) for p in manifest["params"])
    assert set(manifest["environment"]) == {"jax", "jaxlib", "platform", "device_kind", "device_count"}
    assert len(manifest["grid"]["keys"]) == 3 and manifest["grid"]["page_buckets"] == [1]
    layer = manifest["cache"]["layers"][0]
    assert set(layer) == {"latent"} and layer["latent"]["dtype"] == "float32"  # MLA: one latent row per token
    programs = {p["name"]: p for p in manifest["programs"]}
    assert programs["allocate_caches"]["form"] == "executable"
    grid = [p for p in programs.values() if p["key"]]
    assert all(p["kernels"] and len(p["sha256"]) == 64 and p["size"] > 0 for p in grid)


# ---- refusals: all before anything is loaded ----------------------------------------------------


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if the weights would be read: every refusal must come before that."""
    from jaxinfer.engine import export_loading

    def refuse(*args, **kwargs):
        raise AssertionError("the export was not refused before loading the weights")

    monkeypatch.setattr(export_loading, "load_params", refuse)


def _copy(path, tmp_path, name="copy"):
    target = tmp_path / name
    shutil.copytree(path, target)
    return str(target)


def _edit_manifest(export, edit):
    with open(os.path.join(export, MANIFEST_FILE)) as f:
        manifest = json.load(f)
    edit(manifest)
    with open(os.path.join(export, MANIFEST_FILE), "w") as f:
        json.dump(manifest, f)


def test_another_checkpoint_is_refused(exports, tmp_path, no_loading):
    """Same config.json, but weight files whose headers differ (a tensor stored as float16)."""
    from safetensors.numpy import load_file, save_file

    path, export, _ = exports["llama"]
    other = _copy(path, tmp_path)
    tensors = load_file(os.path.join(other, "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.float16)
    save_file(tensors, os.path.join(other, "model.safetensors"))
    with pytest.raises(ExportMismatchError, match="weight files .* do not hold the tensors"):
        LLM(other, executables=export, show_progress=False)
    qwen = exports["qwen3_moe"][0]
    with pytest.raises(ExportMismatchError, match="config.json"):
        LLM(qwen, executables=export, show_progress=False)


def test_an_edited_config_is_refused(exports, tmp_path, no_loading):
    path, export, _ = exports["llama"]
    other = _copy(path, tmp_path)
    with open(os.path.join(other, "config.json")) as f:
        config = json.load(f)
    config["rms_norm_eps"] = 1e-5
    with open(os.path.join(other, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ExportMismatchError, match="config.json .* differs .* edited"):
        LLM(other, executables=export, show_progress=False)


def test_other_engine_options_are_refused(exports, no_loading):
    path, export, _ = exports["llama"]
    with pytest.raises(ExportMismatchError, match=r"max_num_seqs=4 \(the export has 2\)"):
        LLM(path, executables=export, max_num_seqs=4)
    with pytest.raises(ExportMismatchError, match=r"dtype='bfloat16' \(the export has 'float32'\)"):
        LLM(path, dtype="bfloat16", executables=export)
    with pytest.raises(ExportMismatchError, match=r"page_bucket_growth=2"):
        LLM(path, executables=export, page_bucket_growth=2)


@pytest.mark.parametrize("field, value", [("jax", "0.0.1"), ("jaxlib", "0.0.1"), ("device_kind", "NVIDIA H200"),
                                          ("device_count", 8), ("platform", "gpu")])
def test_another_jax_or_device_is_refused(exports, tmp_path, field, value, no_loading):
    path, export, _ = exports["llama"]
    copy = _copy(export, tmp_path)
    _edit_manifest(copy, lambda m: m["environment"].update({field: value}))
    with pytest.raises(ExportMismatchError, match=f"{field} {value!r}"):
        LLM(path, executables=copy)


def test_a_tampered_manifest_is_refused(exports, tmp_path, no_loading):
    path, export, _ = exports["llama"]
    hashed = _copy(export, tmp_path, "hashed")
    _edit_manifest(hashed, lambda m: m["programs"][0].update(sha256="0" * 64))
    with pytest.raises(ExportError, match="does not match the sha256"):
        LLM(path, executables=hashed)
    options = _copy(export, tmp_path, "options")  # programs of max_num_seqs 2 claimed for 1
    _edit_manifest(options, lambda m: m["engine"].update(max_num_seqs=1, max_num_batched_tokens=16))
    with pytest.raises(ExportError, match="not the grid of its engine options"):
        LLM(path, executables=options)
    mesh = _copy(export, tmp_path, "mesh")  # a mesh axis the engine does not know
    _edit_manifest(mesh, lambda m: m["mesh"].update(axis_names=["data", "model", "pipeline"]))
    with pytest.raises(ExportError, match="the manifest's mesh .* is malformed"):
        LLM(path, executables=mesh)
    axes = _copy(export, tmp_path, "axes")  # a logical axis no layer declares
    _edit_manifest(axes, lambda m: m["params"][0].update(axes=["posix.system"] * len(m["params"][0]["shape"])))
    with pytest.raises(ExportError, match="malformed logical axes"):
        LLM(path, executables=axes)
    broken = _copy(export, tmp_path, "broken")
    with open(os.path.join(broken, MANIFEST_FILE), "r+") as f:
        f.truncate(100)
    with pytest.raises(ExportError, match="not valid JSON"):
        LLM(path, executables=broken)
    with pytest.raises(ExportError, match="holds no manifest.json"):
        LLM(path, executables=str(tmp_path))


def test_a_truncated_or_corrupt_program_is_refused(exports, tmp_path, no_loading):
    path, export, _ = exports["llama"]
    truncated = _copy(export, tmp_path, "truncated")
    name = sorted(os.listdir(os.path.join(truncated, "programs")))[-1]
    with open(os.path.join(truncated, "programs", name), "r+b") as f:
        f.truncate(1000)
    with pytest.raises(ExportError, match="has 1000 bytes; the manifest records"):
        LLM(path, executables=truncated)
    corrupt = _copy(export, tmp_path, "corrupt")
    with open(os.path.join(corrupt, "programs", name), "r+b") as f:
        f.seek(500)
        byte = f.read(1)
        f.seek(500)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ExportError, match="does not match the sha256"):
        LLM(path, executables=corrupt)


def test_a_bad_weight_is_refused_by_the_exports_own_check(exports, tmp_path):
    from safetensors.numpy import load_file, save_file

    path, export, _ = exports["llama"]
    other = _copy(path, tmp_path)
    tensors = load_file(os.path.join(other, "model.safetensors"))
    tensors["model.norm.weight"][3] = np.nan
    save_file(tensors, os.path.join(other, "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        LLM(other, executables=export, show_progress=False)


def test_a_portable_export_loads_without_tracing_the_model(exports, tmp_path, monkeypatch):
    """StableHLO programs (everything is plain jnp on the CPU), through the CLI: loading compiles them
    but never runs model code, and they give the live engine's tokens (of a one-sequence grid here)."""
    pytest.importorskip("flatbuffers")
    from jaxinfer.cli import main
    from jaxinfer.models import decoder

    path, _, live = exports["llama"]
    options = ["--max-model-len", "16", "--max-num-seqs", "1", "--max-num-batched-tokens", "16", "--dtype", "float32"]
    assert main(["export", "--model", path, "--out", str(tmp_path / "portable"), "--portable", *options]) == 0
    with open(tmp_path / "portable" / MANIFEST_FILE) as f:
        assert {p["form"] for p in json.load(f)["programs"]} == {"stablehlo"}

    def no_model_code(*args, **kwargs):
        raise AssertionError("model code was traced")

    with monkeypatch.context() as patch:
        patch.setattr(decoder.DecoderModel, "__call__", no_model_code)
        llm = LLM(path, executables=str(tmp_path / "portable"), strict=True, show_progress=False)
        out = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=SamplingParams(**{**GREEDY, "max_tokens": 8}))
    assert llm.startup_report.programs_from_export == 2 + 2
    # Other programs (recompiled, other shapes) than the live engine's: equal up to a near tie.
    assert_same_greedy_tokens([out[0].token_ids], [live[0][:8]], PROMPTS[:1],
                              lambda ids: load_model(path, dtype="float32").logits(ids)[-1])


# ---- an export directory is data ------------------------------------------------------------------


class _Planted:
    """A pickle that creates a file when unpickled: what a hostile program file would hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def _replace_program(export, name, data):
    """Write ``data`` as program ``name``'s file and record it in the manifest, as someone who can
    write the directory could."""
    import hashlib

    def edit(manifest):
        entry = next(p for p in manifest["programs"] if p["name"] == name)
        with open(os.path.join(export, entry["file"]), "wb") as f:
            f.write(data)
        entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())

    _edit_manifest(export, edit)


def test_a_planted_pickle_is_never_unpickled(exports, tmp_path):
    import pickle

    path, export, _ = exports["llama"]
    with open(os.path.join(export, MANIFEST_FILE)) as f:
        names = [p["name"] for p in json.load(f)["programs"]]
    grid_program = next(n for n in names if n not in ("allocate_caches", "check_finite"))
    for name in ("check_finite", "allocate_caches", grid_program):
        copy = _copy(export, tmp_path, name)
        marker = tmp_path / f"{name}-ran"
        _replace_program(copy, name, pickle.dumps(_Planted(str(marker))))
        with pytest.raises(ExportError, match="malformed executable file: not a jaxinfer executable file"):
            LLM(path, executables=copy, show_progress=False)
        assert not marker.exists()


def test_a_forged_description_names_no_python_type(exports, tmp_path):
    """The JSON beside the executable may name only the pytree nodes an export can hold."""
    import struct

    from jaxinfer.engine import executable_file

    path, export, _ = exports["llama"]
    copy = _copy(export, tmp_path)
    with open(os.path.join(copy, MANIFEST_FILE)) as f:
        entry = next(p for p in json.load(f)["programs"] if p["key"])
    with open(os.path.join(copy, entry["file"]), "rb") as f:
        data = f.read()
    start = len(executable_file.MAGIC) + 8
    (length,) = struct.unpack_from("<Q", data, len(executable_file.MAGIC))
    header = json.loads(data[start:start + length])
    header["out_tree"] = ["posix.system", {"tuple": ["touch /tmp/x"]}, []]
    text = json.dumps(header).encode()
    forged = executable_file.MAGIC + struct.pack("<Q", len(text)) + text + data[start + length:]
    _replace_program(copy, entry["name"], forged)
    with pytest.raises(ExportError, match="unknown tree node type 'posix.system'"):
        LLM(path, executables=copy, show_progress=False)


def test_a_program_file_is_the_executable_and_a_json_description(exports):
    from jaxinfer.engine import executable_file

    _, export, _ = exports["deepseek_v3"]
    with open(os.path.join(export, MANIFEST_FILE)) as f:
        entry = next(p for p in json.load(f)["programs"] if p["key"] and p["key"]["kind"] == "decode")
    with open(os.path.join(export, entry["file"]), "rb") as f:
        header, payload = executable_file._split(f.read())
    assert payload and header["in_tree"][0] == "tuple" and header["no_kwargs"] is False
    names = set()

    def nodes(tree):
        if tree != "*":
            names.add(tree[0])
            for child in tree[2]:
                nodes(child)

    nodes(header["in_tree"])
    assert "jaxinfer.engine.runner.DecodeState" in names and "jaxinfer.engine.sampling.SamplingBatch" in names
    assert any(a["donated"] for a in header["args"])  # the caches


@pytest.mark.parametrize("link", ["manifest", "program", "programs folder"])
def test_reads_stay_inside_the_export_directory(exports, tmp_path, link, no_loading):
    """A manifest, program file or programs folder that is a symlink out of the directory is refused,
    even when what it points at is a faithful copy."""
    path, export, _ = exports["llama"]
    copy = _copy(export, tmp_path)
    outside = _copy(export, tmp_path, "outside")
    if link == "manifest":
        target = os.path.join(copy, MANIFEST_FILE)
        os.replace(target, os.path.join(outside, MANIFEST_FILE))
        os.symlink(os.path.join(outside, MANIFEST_FILE), target)
    elif link == "program":
        name = sorted(os.listdir(os.path.join(copy, "programs")))[0]
        os.remove(os.path.join(copy, "programs", name))
        os.symlink(os.path.join(outside, "programs", name), os.path.join(copy, "programs", name))
    else:
        shutil.rmtree(os.path.join(copy, "programs"))
        os.symlink(os.path.join(outside, "programs"), os.path.join(copy, "programs"))
    with pytest.raises(ExportError, match="outside the export directory"):
        LLM(path, executables=copy, show_progress=False)


def test_a_program_an_export_cannot_describe_is_refused_when_written():
    """Host callbacks (Python the program would call back) and pytree nodes outside the engine's own
    are refused as the export is written, never stored in a form that would load differently."""
    from collections import OrderedDict

    import jax
    import jax.numpy as jnp

    from jaxinfer.engine import executable_file

    row = jax.ShapeDtypeStruct((3,), jnp.float32)
    callback = jax.jit(lambda x: jax.pure_callback(lambda a: np.asarray(a) * 2, row, x))
    with pytest.raises(ExportError, match=r"has \['host_callbacks'\], which an export cannot store as data"):
        executable_file.serialize(callback.lower(row).compile())
    ordered = jax.jit(lambda d: d).lower(OrderedDict(a=jax.ShapeDtypeStruct((2,), jnp.float32))).compile()
    with pytest.raises(ExportError, match="hold a OrderedDict, which an export does not describe"):
        executable_file.serialize(ordered)
