"""The verdict of scripts/model_check.py (the GPU's end-to-end bf16 check), on made-up runs."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "scripts"))
import model_check  # noqa: E402


def _run(tokens, logprobs):
    return {"tokens": tokens, "logprobs": logprobs}


def _runs(kernels, ref16, ref32):
    n = len(model_check.PROMPT_LENGTHS)
    return {"kernels": [kernels] * n, "reference_bfloat16": [ref16] * n, "reference_float32": [ref32] * n}


def test_compares_over_the_tokens_all_runs_agree_on():
    ref32 = _run([5, 6, 7, 8], [-1.0, -2.0, -3.0, -4.0])
    kernels = _run([5, 6, 9, 9], [-1.01, -2.02, -0.5, -0.5])  # flips at the third token
    ref16 = _run([5, 6, 7, 9], [-1.0, -2.01, -3.0, -9.0])  # flips at the fourth
    (row, *_) = model_check.compare(_runs(kernels, ref16, ref32))
    assert row["tokens_agreeing_with_float32"] == 2 and row["reference_bfloat16_tokens_agreeing"] == 3
    assert row["compared_tokens"] == 2
    assert abs(row["kernels_drift"] - 0.02) < 1e-9 and abs(row["reference_bfloat16_drift"] - 0.01) < 1e-9


def test_a_family_passes_within_twice_the_bfloat16_drift():
    ref32 = _run([5, 6], [-1.0, -2.0])
    close = model_check.compare(_runs(_run([5, 6], [-1.0, -2.025]), _run([5, 6], [-1.0, -2.01]), ref32))
    far = model_check.compare(_runs(_run([5, 6], [-1.0, -2.04]), _run([5, 6], [-1.0, -2.01]), ref32))
    assert model_check.family_passes(close)  # 0.025 <= 2 * 0.01 + 0.01
    assert not model_check.family_passes(far)  # 0.04 > 0.03
    first_token_differs = model_check.compare(_runs(_run([4, 6], [-1.0, -2.0]), ref32, ref32))
    assert not model_check.family_passes(first_token_differs)


def test_a_first_token_near_tie_is_compared_at_that_token():
    # float32 picks 5 over 4 by 0.012; the kernels pick 4 on one request.
    ref32 = {**_run([5, 6], [-1.0, -2.0]), "first_top": {"5": -1.0, "4": -1.012}}
    ref16 = _run([5, 6], [-1.0, -2.01])

    def family(first_request):
        rows = model_check.compare(_runs(ref16, ref16, ref32))
        rows[0] = model_check.compare(_runs(first_request, ref16, ref32))[0]
        return rows

    near_tie = family(_run([4, 6], [-0.995, -2.0]))  # 4 at a logprob 0.017 from float32's
    assert near_tie[0]["compared_tokens"] == 0 and abs(near_tie[0]["kernels_first_token_drift"] - 0.017) < 1e-9
    assert model_check.family_passes(near_tie)  # 0.017 <= 2 * 0.01 + 0.01
    assert not model_check.family_passes(family(_run([4, 6], [-0.95, -2.0])))  # 0.062 from float32's
    assert not model_check.family_passes(family(_run([3, 6], [-1.0, -2.0])))  # not float32's runner-up


def test_the_seed_draws_other_weights(tmp_path):
    from safetensors.numpy import load_file

    def weights(seed):
        path = tmp_path / f"seed{seed}"
        model_check.write_checkpoint(str(path), "llama", seed)
        return load_file(str(path / "model.safetensors"))

    first, again, other = weights(0), weights(0), weights(1)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert (first[name] == again[name]).all()
    assert not (first[name] == other[name]).all()
