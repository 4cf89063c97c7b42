"""GPU proof for the MLA and DeepSeek sparse-attention kernels: parity of the default implementation
against the plain-jnp references, and kernel times next to XLA's fusion of the jnp path and the
ceilings measured in the same run.

    PYTHONPATH=. python3 scripts/mla_check.py                 # writes mla_check.json to $JAXINFER_BENCH_DIR (or .)
    PYTHONPATH=. python3 scripts/mla_check.py --parity-only
    PYTHONPATH=. python3 scripts/mla_check.py --skip-parity
    PYTHONPATH=. python3 scripts/mla_check.py --interpret --parity-only   # on a CPU: the script itself

Shapes are DeepSeek-V3 / V3.2's (128 heads, kv_lora_rank 512, rope 64, pages of 64, bf16; the
indexer's 64 heads of 128 and top-k 2048):

- **MLA decode** (absorbed, over the paged latent cache) at B = 1, 32, 128 and contexts 4096 and
  32768: the latent rows every sequence reads (``ctx * (R + P)`` elements) over the kernel's time,
  against the copy bandwidth.
- **Sparse MLA decode** at context 32768 with top-k 2048, next to dense MLA decode at context 2048
  (the same rows read), and the indexer's scores + top-k over the 32768 keys of each sequence; the
  sparse kernel also at each power-of-two ``num_splits`` up to its key blocks (the dispatch's data
  for steps of few tokens, where one program per token and head block leaves the SMs idle).
- **Sparse prefill**: every token of one 8192- or 32768-token sequence over its 2048 selected rows
  (``H * (4R + 2P)`` FLOPs per token and row: two score matmuls and the value matmul), and the
  indexer over the prefix of each token.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import copy_bandwidth, environment, kernel_time, matmul_rate, write_json  # noqa: E402

from jaxinfer.kernels import mla, registry, sparse_mla  # noqa: E402

DEEPSEEK = dict(heads=128, latent=512, rope=64, page_size=64, index_heads=64, index_dim=128, top_k=2048)
SMALL = dict(heads=16, latent=64, rope=16, page_size=16, index_heads=4, index_dim=32, top_k=48)  # interpret mode


def latent_cache(num_seqs, context, shape, dtype, seed=0):
    """A shuffled paged latent cache holding ``context`` rows of each sequence, and its block tables."""
    pages_per_seq = -(-context // shape["page_size"])
    num_pages = num_seqs * pages_per_seq
    cache = jax.random.normal(jax.random.PRNGKey(seed), (num_pages, shape["page_size"], shape["latent"] + shape["rope"]),
                              dtype)
    tables = np.random.RandomState(seed).permutation(num_pages).reshape(num_seqs, pages_per_seq)
    return cache, jnp.asarray(tables, jnp.int32)


def queries(num_tokens, shape, dtype, seed=1):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return (jax.random.normal(k1, (num_tokens, shape["heads"], shape["latent"]), dtype),
            jax.random.normal(k2, (num_tokens, shape["heads"], shape["rope"]), dtype))


def random_selection(tables, seq_ids, positions, top_k, page_size, seed=2):
    """[T, top_k] cache slots of each token's sequence up to its own position: all of them where it
    sees at most ``top_k`` (-1 past them), else ``top_k`` drawn at random (with repetition: the rows
    an indexer picks are scattered over the pages like these; repeats count as keys in the
    reference and the kernel alike). Padding tokens (sequence -1) select nothing."""
    seq_ids, positions = jnp.asarray(seq_ids), jnp.asarray(positions)
    visible = positions[:, None] + 1
    column = jnp.arange(top_k)[None, :]
    drawn = jax.random.randint(jax.random.PRNGKey(seed), (len(seq_ids), top_k), 0, 2**30) % visible
    few = visible <= top_k
    picked = jnp.where(few, column, drawn)
    valid = (~few | (column < visible)) & (seq_ids >= 0)[:, None]
    pages = jnp.take_along_axis(tables[jnp.maximum(seq_ids, 0)], picked // page_size, axis=1)
    return jnp.where(valid, pages * page_size + picked % page_size, -1).astype(jnp.int32)


def _scale(shape):
    return (128 + shape["rope"]) ** -0.5  # DeepSeek's qk_head_dim ** -0.5 (nope 128 + rope)


def _relative_error(got, want) -> float:
    got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
    return float(jnp.max(jnp.abs(got - want)) / (jnp.max(jnp.abs(want)) + 1e-30))


def _widened(*arrays):
    return [a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in arrays]


def _chosen(op, fn, *args):
    with registry.recording() as chosen:
        out = jax.block_until_ready(fn(*args))
    return out, sorted(chosen.get(op.name, ()))


def parity(shape):
    """Each op's default implementation against its reference in float32 on the same (rounded) inputs."""
    rows = []
    scale = _scale(shape)
    for dtype in (jnp.bfloat16, jnp.float16):
        # Ragged decode: an empty (padding) row, a one-token sequence, lengths across page and split edges.
        lengths = np.array([0, 1, 700, 2049, 3000, 64, 1500], np.int32)
        cache, tables = latent_cache(len(lengths), int(lengths.max()), shape, dtype)
        q_latent, q_rope = queries(len(lengths), shape, dtype)
        seq_lens = jnp.asarray(lengths)
        decode = jax.jit(functools.partial(mla.mla_paged_decode_attention_op, scale=scale))
        got, chosen = _chosen(mla.mla_paged_decode_attention_op, decode, q_latent, q_rope, cache, tables, seq_lens)
        want = mla.reference.mla_paged_decode_attention(*_widened(q_latent, q_rope, cache), tables, seq_lens,
                                                        scale=scale)
        rows.append({"op": "mla_paged_decode_attention", "dtype": jnp.dtype(dtype).name, "implementation": chosen,
                     "max_rel_error": _relative_error(got, want), "padding_row_zero": bool(jnp.all(got[0] == 0))})
        print(rows[-1], flush=True)

        # Sparse attention over a selection: tokens of two sequences, one padding token, one token
        # seeing fewer rows than top_k.
        seq_ids = np.array([0, 0, 1, 1, -1, 1], np.int32)
        positions = np.array([5, 2999, 10, 2048, 0, 1499], np.int32)
        cache, tables = latent_cache(2, 3000, shape, dtype)
        slots = random_selection(tables, seq_ids, positions, shape["top_k"], shape["page_size"])
        q_latent, q_rope = queries(len(seq_ids), shape, dtype)
        attend = jax.jit(functools.partial(sparse_mla.sparse_mla_attention_op, scale=scale))
        got, chosen = _chosen(sparse_mla.sparse_mla_attention_op, attend, q_latent, q_rope, cache, slots)
        want = sparse_mla.reference.sparse_mla_attention(*_widened(q_latent, q_rope, cache), slots, scale=scale)
        rows.append({"op": "sparse_mla_attention", "dtype": jnp.dtype(dtype).name, "implementation": chosen,
                     "max_rel_error": _relative_error(got, want), "padding_row_zero": bool(jnp.all(got[4] == 0))})
        print(rows[-1], flush=True)
        # The kernel itself (the dispatch takes the tiled path for so few tokens), whole and in splits.
        from jaxinfer.kernels.sparse_mla import attention_pallas
        for splits in (1, 4):
            kernel = jax.jit(functools.partial(attention_pallas.sparse_mla_attention, scale=scale, num_splits=splits,
                                               interpret=registry.current_target().interpret))
            got = jax.block_until_ready(kernel(q_latent, q_rope, cache, slots))
            rows.append({"op": "sparse_mla_attention", "dtype": jnp.dtype(dtype).name,
                         "implementation": [f"triton, num_splits={splits}"], "max_rel_error": _relative_error(got, want),
                         "padding_row_zero": bool(jnp.all(got[4] == 0))})
            print(rows[-1], flush=True)

        # The indexer: scores against the reference, and the selections' agreement (ties in rounded
        # scores may order equal keys differently, so the overlap of the selected sets is reported).
        q, weights, index_cache, index_tables = indexer_inputs(len(seq_ids), 2, 3000, shape, dtype)
        args = (q, weights, index_cache, jnp.asarray(positions), jnp.asarray(seq_ids), index_tables)
        select = jax.jit(functools.partial(sparse_mla.indexer_select_op, scale=shape["index_dim"] ** -0.5,
                                           top_k=shape["top_k"]))
        got, chosen = _chosen(sparse_mla.indexer_select_op, select, *args)
        want = sparse_mla.reference.indexer_select(*_widened(q, weights, index_cache), *args[3:],
                                                   scale=shape["index_dim"] ** -0.5, top_k=shape["top_k"])
        overlap = [len(set(g[g >= 0]) & set(w[w >= 0])) / int((w >= 0).sum()) if (w >= 0).any() else float(
            not (g >= 0).any()) for g, w in zip(np.asarray(got), np.asarray(want))]
        rows.append({"op": "indexer_select", "dtype": jnp.dtype(dtype).name, "implementation": chosen,
                     "min_selection_overlap": float(min(overlap)),
                     "none_marked_equal": bool(np.array_equal(np.asarray(got) < 0, np.asarray(want) < 0))})
        if "triton" in chosen:
            from jaxinfer.kernels.sparse_mla import indexer_pallas
            scores = indexer_pallas.indexer_scores(*args, scale=shape["index_dim"] ** -0.5,
                                                   interpret=registry.current_target().interpret)
            truth = sparse_mla.reference.indexer_scores(*_widened(q, weights, index_cache), *args[3:],
                                                        scale=shape["index_dim"] ** -0.5)
            finite = jnp.isfinite(truth)
            rows[-1]["scores_max_rel_error"] = _relative_error(jnp.where(finite, scores, 0), jnp.where(finite, truth, 0))
            rows[-1]["scores_masked_equal"] = bool(jnp.array_equal(jnp.isfinite(scores), finite))
        print(rows[-1], flush=True)
    return rows


def indexer_inputs(num_tokens, num_seqs, context, shape, dtype, seed=3):
    """Indexer queries [T, H, D], weights [T, H], and a paged index-key cache of ``num_seqs``
    sequences of ``context`` keys with its block tables."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    pages_per_seq = -(-context // shape["page_size"])
    num_pages = num_seqs * pages_per_seq
    index_cache = jax.random.normal(keys[0], (num_pages, shape["page_size"], shape["index_dim"]), dtype)
    tables = jnp.asarray(np.random.RandomState(seed).permutation(num_pages).reshape(num_seqs, pages_per_seq),
                         jnp.int32)
    q = jax.random.normal(keys[1], (num_tokens, shape["index_heads"], shape["index_dim"]), dtype)
    weights = jax.random.normal(keys[2], (num_tokens, shape["index_heads"]), jnp.float32) * shape["index_heads"] ** -0.5
    return q, weights, index_cache, tables


def _timed(op, options, *args, jnp_path=None):
    """Kernel time of ``op(*args, **options)`` on its default implementation (and on ``jnp_path``'s,
    forced). Each timing traces a function of its own: a traced program keeps its choices."""
    with registry.recording() as chosen:
        seconds = kernel_time(lambda *a: op(*a, **options), *args)
    row = {"implementation": sorted(chosen.get(op.name, ())), "kernel_us": seconds * 1e6}
    if jnp_path:
        with registry.force(op.name, jnp_path):
            row[f"{jnp_path}_us"] = kernel_time(lambda *a: op(*a, **options), *args) * 1e6
    return row, seconds


def mla_decode_benchmarks(shape, bandwidth, batches=(1, 32, 128), contexts=(2048, 4096, 32768)):
    rows = []
    width = shape["latent"] + shape["rope"]
    for context in contexts:
        for batch in batches:
            cache, tables = latent_cache(batch, context, shape, jnp.bfloat16)
            q_latent, q_rope = queries(batch, shape, jnp.bfloat16)
            seq_lens = jnp.full((batch,), context, jnp.int32)
            # XLA's fusion of the reference materialises every sequence's rows and scores: timed where
            # that stays under a few GB.
            reference = "reference" if batch * context <= 32 * 4096 else None
            row, seconds = _timed(mla.mla_paged_decode_attention_op, {"scale": _scale(shape)}, q_latent, q_rope,
                                  cache, tables, seq_lens, jnp_path=reference)
            latent_bytes = batch * context * width * 2
            row.update(batch=batch, context=context, latent_GB=latent_bytes / 1e9,
                       TBps=latent_bytes / seconds / 1e12, of_copy_bandwidth=latent_bytes / seconds / bandwidth)
            rows.append(row)
            print("mla decode", row, flush=True)
            del cache
    return rows


def kernel_by_splits(q_latent, q_rope, cache, slots, scale) -> dict[int, float]:
    """The sparse attention kernel's time (us) at each power-of-two ``num_splits`` up to its key
    blocks, where the kernel takes the call."""
    from jaxinfer.kernels.mla import decode_pallas
    from jaxinfer.kernels.sparse_mla import attention_pallas

    (num_tokens, num_heads, latent_dim), top_k = q_latent.shape, slots.shape[1]
    plan = decode_pallas.plan_blocking(num_tokens, num_heads, top_k, latent_dim, q_rope.shape[-1],
                                       jnp.dtype(cache.dtype).itemsize, num_splits=1)
    out, splits = {}, 1
    while splits <= -(-top_k // plan.block_keys) and attention_pallas.supports(q_latent, q_rope, cache, slots,
                                                                              num_splits=splits):
        attend = functools.partial(attention_pallas.sparse_mla_attention, scale=scale, num_splits=splits)
        out[splits] = kernel_time(attend, q_latent, q_rope, cache, slots) * 1e6
        splits *= 2
    return out


def sparse_decode_benchmarks(shape, bandwidth, dense_rows, batches=(1, 32, 128), context=32768):
    """Sparse MLA decode at ``context`` over ``top_k`` rows, and the indexer's select per step."""
    rows = []
    attend_options = {"scale": _scale(shape)}
    select_options = {"scale": shape["index_dim"] ** -0.5, "top_k": shape["top_k"]}
    width = shape["latent"] + shape["rope"]
    dense_at_top_k = {r["batch"]: r["kernel_us"] for r in dense_rows if r["context"] == shape["top_k"]}
    for batch in batches:
        cache, tables = latent_cache(batch, context, shape, jnp.bfloat16)
        q_latent, q_rope = queries(batch, shape, jnp.bfloat16)
        seq_ids = np.arange(batch, dtype=np.int32)
        positions = np.full(batch, context - 1, np.int32)
        slots = random_selection(tables, seq_ids, positions, shape["top_k"], shape["page_size"])
        row, seconds = _timed(sparse_mla.sparse_mla_attention_op, attend_options, q_latent, q_rope, cache, slots,
                              jnp_path="tiled")
        read = batch * shape["top_k"] * width * 2
        row.update(batch=batch, context=context, top_k=shape["top_k"], TBps=read / seconds / 1e12,
                   of_copy_bandwidth=read / seconds / bandwidth)
        if batch in dense_at_top_k:
            row["x_dense_decode_at_top_k"] = row["kernel_us"] / dense_at_top_k[batch]
        row["kernel_us_by_splits"] = kernel_by_splits(q_latent, q_rope, cache, slots, _scale(shape))
        del cache
        q, weights, index_cache, index_tables = indexer_inputs(batch, batch, context, shape, jnp.bfloat16)
        indexer_row, indexer_seconds = _timed(sparse_mla.indexer_select_op, select_options, q, weights, index_cache,
                                              jnp.asarray(positions), jnp.asarray(seq_ids), index_tables,
                                              jnp_path="tiled")
        key_bytes = batch * context * shape["index_dim"] * 2
        row["indexer"] = {**indexer_row, "key_TBps": key_bytes / indexer_seconds / 1e12}
        rows.append(row)
        print("sparse decode", row, flush=True)
    return rows


def sparse_prefill_benchmarks(shape, flops_rate, lengths=(8192, 32768)):
    """One sequence's prefill: each token over its top-k rows, and the indexer over its prefix."""
    rows = []
    attend_options = {"scale": _scale(shape)}
    select_options = {"scale": shape["index_dim"] ** -0.5, "top_k": shape["top_k"]}
    for length in lengths:
        cache, tables = latent_cache(1, length, shape, jnp.bfloat16)
        q_latent, q_rope = queries(length, shape, jnp.bfloat16)
        seq_ids = np.zeros(length, np.int32)
        positions = np.arange(length, dtype=np.int32)
        slots = random_selection(tables, seq_ids, positions, shape["top_k"], shape["page_size"])
        pairs = float(np.minimum(positions + 1, shape["top_k"]).sum())
        flops = pairs * shape["heads"] * (4 * shape["latent"] + 2 * shape["rope"])
        row, seconds = _timed(sparse_mla.sparse_mla_attention_op, attend_options, q_latent, q_rope, cache, slots,
                              jnp_path="tiled" if length <= 8192 else None)
        row.update(tokens=length, TFLOPs=flops / seconds / 1e12, of_matmul_rate=flops / seconds / flops_rate)
        del cache, q_latent, q_rope
        q, weights, index_cache, index_tables = indexer_inputs(length, 1, length, shape, jnp.bfloat16)
        indexer_row, indexer_seconds = _timed(sparse_mla.indexer_select_op, select_options, q, weights, index_cache,
                                              jnp.asarray(positions), jnp.asarray(seq_ids), index_tables,
                                              jnp_path="tiled" if length <= 8192 else None)
        score_flops = float((positions + 1).sum()) * shape["index_heads"] * shape["index_dim"] * 2
        row["indexer"] = {**indexer_row, "score_TFLOPs": score_flops / indexer_seconds / 1e12}
        rows.append(row)
        print("sparse prefill", row, flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parity-only", action="store_true")
    parser.add_argument("--skip-parity", action="store_true", help="the benchmarks alone (parity run separately)")
    parser.add_argument("--interpret", action="store_true", help="the Pallas kernels in interpret mode, small shapes")
    args = parser.parse_args()
    result = {"environment": environment(), "shape": SMALL if args.interpret else DEEPSEEK}
    if args.interpret:
        with registry.targeting(registry.Target.interpreted()):
            result["parity"] = parity(SMALL)
    elif not args.skip_parity:
        result["parity"] = parity(DEEPSEEK)
    write_json("mla_check.json", result)
    if not args.parity_only:
        bandwidth, flops_rate = copy_bandwidth(), matmul_rate()
        result.update(copy_bandwidth_TBps=bandwidth / 1e12, matmul_TFLOPs=flops_rate / 1e12)
        result["mla_decode"] = mla_decode_benchmarks(DEEPSEEK, bandwidth)
        write_json("mla_check.json", result)
        result["sparse_decode"] = sparse_decode_benchmarks(DEEPSEEK, bandwidth, result["mla_decode"])
        write_json("mla_check.json", result)
        result["sparse_prefill"] = sparse_prefill_benchmarks(DEEPSEEK, flops_rate)
    print(write_json("mla_check.json", result))


if __name__ == "__main__":
    main()
