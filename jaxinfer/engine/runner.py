"""The device side of the engine: the two jitted programs, their inputs, and their executables.

* ``mixed step``: one forward over a ragged batch of new tokens (prefill chunks and decode tokens of
  several sequences), then one sample per sequence.
* ``decode loop``: ``decode_steps`` forward+sample steps in a ``lax.while_loop`` on the device,
  feeding each sampled token back in, stopping sequences on EOS / stop ids / their token budget /
  logits that are not finite (``NONFINITE_TOKEN`` is then their last output) (one loop for
  all-greedy batches, whose sampler is the argmax alone, and one with the full sampler).

Both donate the KV caches, so the cache is updated in place. Inputs are built on the host as numpy
arrays padded to a ``CompileKey`` bucket; the compiled executable for that key is looked up (compiled
at warm-up, or installed from an export), never traced at serving time. A third, small program
allocates the zero-filled caches on the devices in their shardings (also compiled ahead of time, so
that re-making the caches after a failed step compiles nothing, and an export can carry it).

Kernels are chosen for the runner's target (its mesh's devices) and the selection in force when it
was made (``jaxinfer.kernels.registry``); ``kernel_choices`` keeps each program's. The model runs
on each device's pieces (``jaxinfer.sharding.forward``). With ``D`` data-parallel ranks every step
input holds ``D`` equal parts, one per rank (its token rows, its sequences, its page and slot ids),
split over the ranks with the logits; the sampled tokens come back whole on every device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import NamedSharding

from jaxinfer.cache.layout import CacheLayout
from jaxinfer.cache.metadata import StepMetadata, build_ranks_metadata
from jaxinfer.engine import multihost
from jaxinfer.engine.aot import DECODE, MIXED, CompileKey
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.request import Request
from jaxinfer.engine.scheduler import rank_rows
from jaxinfer.engine.sampling import NONFINITE_TOKEN, SamplingBatch, sample, seed_key_data
from jaxinfer.errors import CompilationAfterWarmupError
from jaxinfer.kernels import registry as kernel_registry
from jaxinfer.loader import LoadedModel


@struct.dataclass
class DecodeState:
    tokens: jax.Array  # [S] int32: the pending token of each sequence
    positions: jax.Array  # [S] int32: its position
    block_tables: jax.Array  # [S, P] int32
    active: jax.Array  # [S] bool
    remaining: jax.Array  # [S] int32: tokens the sequence may still generate
    stop_ids: jax.Array  # [S, K] int32, -1 padded
    state_slots: jax.Array | None = None  # [S] int32: each sequence's state slot (layers with state)


def _fill_block_table(row: np.ndarray, pages: list[int]) -> None:
    """A sequence's block-table row: its pages, then its last page again to the row's end. A kernel
    that reads a whole block of entries past the sequence's end (masking their rows) then reads rows of
    its own, never those of whichever request holds page 0, which may be a request whose activations
    overflowed (0 * NaN is NaN)."""
    row[:len(pages)] = pages
    if pages:
        row[len(pages):] = pages[-1]


def _sampling_rows(requests: list[Request], num_rows: int, seqs_per_rank: int) -> SamplingBatch:
    """The sampling settings of ``requests`` in their rows (``rank_rows``), greedy elsewhere."""
    temperature = np.zeros(num_rows, np.float32)
    top_k = np.zeros(num_rows, np.int32)
    top_p = np.ones(num_rows, np.float32)
    min_p = np.zeros(num_rows, np.float32)
    key_data = np.zeros((num_rows, 2), np.uint32)
    counters = np.zeros(num_rows, np.int32)
    wants_logprobs = np.zeros(num_rows, bool)
    for i, r in zip(rank_rows(requests, seqs_per_rank), requests):
        p = r.params
        temperature[i], top_k[i], top_p[i], min_p[i] = p.temperature, max(p.top_k, 0), p.top_p, p.min_p
        key_data[i] = seed_key_data(r.seed)
        counters[i] = len(r.output_token_ids)
        wants_logprobs[i] = p.logprobs is not None
    return SamplingBatch(temperature, top_k, top_p, min_p, key_data, counters, wants_logprobs)


class ModelRunner:
    """The programs of one engine and the caches they update. ``allocate_caches()`` makes the
    caches (the engine calls it once its programs are in place)."""

    def __init__(self, model: LoadedModel, config: EngineConfig, layout: CacheLayout):
        self.model = model
        self.config = config
        self.layout = layout
        self.caches = None
        self._call_in_flight = False  # a call was given the caches and has not handed new ones back
        self._executables: dict[CompileKey, jax.stages.Compiled] = {}
        self._allocator: jax.stages.Compiled | None = None
        self.strict = False  # set once the warm-up is done, in strict mode
        self.compiler_options: dict[str, str | int | bool] = {}  # XLA options for every executable compiled here
        self.kernel_selection = kernel_registry.selection(kernel_registry.target_for(model.mesh))
        self.leader: multihost.Leader | None = None  # set on process 0 of several once serving starts
        self.kernel_choices: dict[CompileKey, dict[str, list[str]]] = {}  # op -> implementations, per program
        self._programs = {
            MIXED: jax.jit(self._mixed_step, donate_argnums=(1,)),
            DECODE: jax.jit(self._decode_loop, donate_argnums=(1,)),
        }

    # ---- the device programs -------------------------------------------------------------------

    def _forward(self, params, token_ids, md: StepMetadata, caches):
        """The model on each device's pieces -> (logits, the same on every device; caches)."""
        def forward(params, token_ids, md, caches):
            return self.model.model.apply({"params": params}, token_ids, md, caches)
        cache_specs = self.layout.partition_specs(self.model.plan)
        rows = self.model.rows_spec
        return self.model.per_device(forward, cache_specs, rows=rows, outputs=rows)(params, token_ids, md, caches)

    def _whole(self, outputs):
        """``outputs`` the same on every device (each process reads them whole)."""
        return jax.lax.with_sharding_constraint(outputs, self.model.plan.replicated_sharding())

    def _mixed_step(self, params, caches, token_ids, md: StepMetadata, sampling: SamplingBatch):
        logits, caches = self._forward(params, token_ids, md, caches)
        tokens, logprobs = sample(logits, sampling, self.config.max_logprobs)
        return caches, *self._whole((tokens, logprobs))

    def _decode_loop(self, params, caches, state: DecodeState, sampling: SamplingBatch):
        num_steps, page_size, ranks = self.config.decode_steps, self.layout.page_size, self.model.plan.data_parallel
        num_seqs = state.tokens.shape[0]
        out_tokens = jnp.full((num_steps, num_seqs), -1, jnp.int32)
        k = self.config.max_logprobs or 0
        out_logprobs = (jnp.zeros((num_steps, num_seqs), jnp.float32), jnp.zeros((num_steps, num_seqs, k), jnp.int32),
                        jnp.zeros((num_steps, num_seqs, k), jnp.float32))

        def step(all_greedy: bool, carry):
            i, caches, st, out_tokens, out_logprobs = carry
            md = build_ranks_metadata(ranks, st.positions, st.active.astype(jnp.int32), st.block_tables,
                                      page_size=page_size, num_tokens=num_seqs // ranks, state_slots=st.state_slots,
                                      decode=True, xp=jnp)
            logits, caches = self._forward(params, st.tokens, md, caches)
            tokens, logprobs = sample(logits, sampling.replace(counters=sampling.counters + i),
                                      self.config.max_logprobs, all_greedy)
            out_tokens = out_tokens.at[i].set(jnp.where(st.active, tokens, -1))
            if logprobs is not None:
                out_logprobs = tuple(buf.at[i].set(val) for buf, val in zip(out_logprobs, logprobs))
            remaining = st.remaining - st.active
            failed = tokens == NONFINITE_TOKEN  # ends the row now: nothing more is generated for it
            stopped = jnp.any(tokens[:, None] == st.stop_ids, axis=-1) | (remaining <= 0) | failed
            st = st.replace(
                tokens=jnp.where(st.active & ~failed, tokens, st.tokens),
                positions=st.positions + st.active,
                active=st.active & ~stopped,
                remaining=remaining,
            )
            return i + 1, caches, st, out_tokens, out_logprobs

        def keep_going(this_loop_runs, carry):
            i, _, st, _, _ = carry
            return this_loop_runs & (i < num_steps) & jnp.any(st.active)

        # Temperatures do not change within a call, so an all-greedy batch is told apart once, and
        # runs a loop whose sampler is the argmax alone: the sampler's conds cost a greedy
        # one-sequence step of Qwen3-30B-A3B 1.7% (benchmarks/results/2026-11-30-h200-r9/). Two loops
        # in a row, of which only one iterates, rather than a cond around them: a cond's operands
        # (the caches) would be copied.
        all_greedy = jnp.all(sampling.temperature <= 0)  # padding rows are greedy
        carry = (jnp.int32(0), caches, state, out_tokens, out_logprobs)
        for greedy_loop in (True, False):
            carry = jax.lax.while_loop(functools.partial(keep_going, all_greedy == greedy_loop),
                                       functools.partial(step, greedy_loop), carry)
        _, caches, _, out_tokens, out_logprobs = carry
        return caches, *self._whole((out_tokens, out_logprobs))

    # ---- host-side inputs ----------------------------------------------------------------------

    def mixed_inputs(self, key: CompileKey, items: list[tuple[Request, int]]):
        """The inputs of a mixed step of ``key`` (whose sizes are each rank's) for ``items``, each in its
        rank's part, in order."""
        ranks = self.model.plan.data_parallel
        t, s, p = key.num_tokens, key.num_seqs * ranks, key.pages_per_seq
        token_ids = np.zeros(t * ranks, np.int32)
        num_computed = np.zeros(s, np.int32)
        num_new = np.zeros(s, np.int32)
        block_tables = np.zeros((s, p), np.int32)
        state_slots = np.full(s, -1, np.int32) if self.layout.num_slots else None
        offsets = [rank * t for rank in range(ranks)]
        for row, (r, n) in zip(rank_rows([r for r, _ in items], key.num_seqs), items):
            token_ids[offsets[r.rank]:offsets[r.rank] + n] = r.tokens(r.num_computed, r.num_computed + n)
            num_computed[row], num_new[row] = r.num_computed, n
            _fill_block_table(block_tables[row], r.pages)
            if state_slots is not None:
                state_slots[row] = r.slot
            offsets[r.rank] += n
        md = build_ranks_metadata(ranks, num_computed, num_new, block_tables, page_size=self.layout.page_size,
                                  num_tokens=t, state_slots=state_slots)
        return token_ids, md, _sampling_rows([r for r, _ in items], s, key.num_seqs)

    def decode_inputs(self, key: CompileKey, requests: list[Request]):
        """The inputs of a decode loop of ``key`` (whose sizes are each rank's) for ``requests``."""
        ranks = self.model.plan.data_parallel
        s, p, k = key.num_seqs * ranks, key.pages_per_seq, self.config.max_stop_token_ids
        tokens = np.zeros(s, np.int32)
        positions = np.zeros(s, np.int32)
        block_tables = np.zeros((s, p), np.int32)
        active = np.zeros(s, bool)
        remaining = np.zeros(s, np.int32)
        stop_ids = np.full((s, k), -1, np.int32)
        rows = rank_rows(requests, key.num_seqs)
        for row, r in zip(rows, requests):
            tokens[row] = r.token_at(r.num_tokens - 1)
            positions[row] = r.num_computed
            _fill_block_table(block_tables[row], r.pages)
            active[row] = True
            remaining[row] = r.remaining_output
            stop_ids[row, :len(r.stop_ids)] = r.stop_ids
        state_slots = None
        if self.layout.num_slots:
            state_slots = np.full(s, -1, np.int32)
            state_slots[rows] = [r.slot for r in requests]
        state = DecodeState(tokens, positions, block_tables, active, remaining, stop_ids, state_slots)
        return state, _sampling_rows(requests, s, key.num_seqs)

    def example_inputs(self, key: CompileKey):
        """Inputs of ``key``'s shapes for no request (what a program is traced against)."""
        return self.mixed_inputs(key, []) if key.kind == MIXED else self.decode_inputs(key, [])

    # ---- compilation and calls -----------------------------------------------------------------

    def abstract_params(self):
        """The parameters as sharded ``ShapeDtypeStruct``s."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                            self.model.params)

    @property
    def input_sharding(self) -> NamedSharding:
        """Every step input's sharding: split by row over the data-parallel ranks."""
        return NamedSharding(self.model.mesh, self.model.rows_spec)

    def abstract_args(self, key: CompileKey) -> tuple:
        """``(params, caches, *inputs)`` of the program of ``key``, as sharded ``ShapeDtypeStruct``s
        (built on the host: nothing is traced)."""
        inputs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.input_sharding),
                              self.example_inputs(key))
        return (self.abstract_params(), self.layout.abstract(self.model.plan), *inputs)

    def traced_program(self, kind: str):
        """The jitted program of ``kind`` (``MIXED`` / ``DECODE``), to lower or export. Trace it
        under ``kernel_registry.applied(self.kernel_selection)``: kernels are chosen while tracing."""
        return self._programs[kind]

    def lower(self, key: CompileKey) -> jax.stages.Lowered:
        """Trace and lower the program of ``key`` against abstract, sharded inputs."""
        args = self.abstract_args(key)
        with kernel_registry.applied(self.kernel_selection), kernel_registry.recording() as chosen:
            lowered = self._programs[key.kind].lower(*args)
        if key not in self.kernel_choices:  # a key lowered again reuses its trace: nothing is recorded then
            self.kernel_choices[key] = {op: sorted(names) for op, names in sorted(chosen.items())}
        return lowered

    def add_executable(self, key: CompileKey, executable: jax.stages.Compiled) -> None:
        self._executables[key] = executable

    def install(self, key: CompileKey, executable, kernel_choices: dict[str, list[str]]) -> None:
        """Serve ``key`` with a program made elsewhere (an export), with the kernels its trace chose."""
        self._executables[key] = executable
        self.kernel_choices[key] = {op: list(names) for op, names in kernel_choices.items()}

    # ---- the caches ----------------------------------------------------------------------------

    def _zero_caches(self):
        abstract = self.layout.abstract(self.model.plan)
        fills = [self.layout.fill_values(layer) for layer in range(len(abstract))]
        return [{name: jnp.full(s.shape, fill[name], s.dtype) for name, s in layer.items()}
                for layer, fill in zip(abstract, fills)]

    def allocator_program(self):
        """The jitted program that makes the zero-filled caches (zeros, so stale or unused pages and
        slots never hold NaNs; an fp8 array's scale holds its value) on the devices, in their shardings."""
        shardings = [{name: s.sharding for name, s in layer.items()} for layer in self.layout.abstract(self.model.plan)]
        return jax.jit(self._zero_caches, out_shardings=shardings)

    def lower_allocator(self) -> jax.stages.Lowered:
        return self.allocator_program().lower()

    @property
    def allocator(self) -> jax.stages.Compiled | None:
        return self._allocator

    def install_allocator(self, executable) -> None:
        self._allocator = executable

    def allocate_caches(self) -> None:
        """Make the caches with the allocating program (compiled here, or through the persistent
        compilation cache, the first time unless one was installed)."""
        if self.leader is not None:
            self.leader.send(multihost.ALLOCATE)
        if self._allocator is None:
            if self.strict:
                raise CompilationAfterWarmupError("strict mode: the cache allocation was not compiled at warm-up")
            self._allocator = self.compile_lowered(self.lower_allocator())
        self.caches = self._allocator()

    def compile_lowered(self, lowered: jax.stages.Lowered) -> jax.stages.Compiled:
        """XLA-compile a lowered program with this runner's ``compiler_options``."""
        return lowered.compile(compiler_options=self.compiler_options or None)

    def compile(self, key: CompileKey) -> None:
        self.add_executable(key, self.compile_lowered(self.lower(key)))

    def executable(self, key: CompileKey) -> jax.stages.Compiled:
        """The compiled program for ``key`` (for inspection: its HLO, cost and memory analyses)."""
        return self._executables[key]

    @property
    def compiled_keys(self) -> list[CompileKey]:
        return sorted(self._executables)

    def call(self, key: CompileKey, inputs):
        """Run ``key``'s program on ``inputs`` (host arrays) and the caches -> its outputs as numpy."""
        if self.leader is not None:
            self.leader.send(multihost.PROGRAM, key, inputs)
        executable = self._executables.get(key)
        if executable is None:
            if self.strict:
                raise CompilationAfterWarmupError(f"strict mode: {key} is not in the warm-up grid")
            self.compile(key)
            executable = self._executables[key]
        inputs = jax.device_put(inputs, self.input_sharding)
        self._call_in_flight = True
        self.caches, *outputs = executable(self.model.params, self.caches, *inputs)
        self._call_in_flight = False
        return jax.device_get(outputs)

    def recover_caches(self) -> bool:
        """After a call that did not complete (it raised, or was interrupted before its new caches were
        stored): re-make the caches if the call consumed them (they are donated). True when it did, so
        nothing any sequence had cached survives."""
        if not self._call_in_flight:
            return False
        self._call_in_flight = False
        if not any(leaf.is_deleted() for leaf in jax.tree.leaves(self.caches)):
            return False
        self.allocate_caches()
        return True

    def run_mixed(self, key: CompileKey, items: list[tuple[Request, int]]):
        """-> (tokens [S], ``NONFINITE_TOKEN`` where a row's logits were not finite; logprobs or None)
        as numpy."""
        return self.call(key, self.mixed_inputs(key, items))

    def run_decode(self, key: CompileKey, requests: list[Request]):
        """-> (tokens [steps, S] with -1 after a sequence stopped, ``NONFINITE_TOKEN`` where its logits
        were not finite, logprobs buffers) as numpy."""
        return self.call(key, self.decode_inputs(key, requests))
