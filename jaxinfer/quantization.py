"""Quantized checkpoints: what ``quantization_config`` says, and a view of the checkpoint that reads
the quantized weights as the floats they stand for.

fp8 (``quant_method: "fp8"``: transformers' fine-grained FP8, the format of the DeepSeek-V3 / V3.2,
GLM-5-FP8, MiniMax-M2 and Qwen3 FP8 releases): a quantized linear's ``<m>.weight`` is float8 e4m3
and ``<m>.weight_scale_inv`` (float32) holds one scale per ``weight_block_size = [bo, bi]`` block,
``[ceil(out / bo), ceil(in / bi)]`` of them (the last block of a row or column may be ragged); with
no block size, ``<m>.weight_scale`` is one scale for the whole tensor. The real weight is the fp8
value times its block's scale, in float32 (DeepSeek's and vLLM's convention). Which linears are
quantized is what the file holds: an fp8 weight and its scale. ``modules_to_not_convert`` /
``ignored_layers`` must agree with it.

``Fp8Checkpoint`` dequantizes on read, slice by slice (a device's slice of a weight reads only its
rows and their scales), to float32; the loader casts to the serving dtype. Weights whose layers take
them in fp8 (``TAKES_FP8``) are instead kept as they are stored (``Fp8Weight``: values and scales,
each device its piece) with ``quantization="auto"``.

MXFP4 (``quant_method: "mxfp4"``, GPT-OSS's experts): ``<m>_blocks`` (uint8, two e2m1 values per
byte) and ``<m>_scales`` (uint8 e8m0 exponents), one scale per 32 values along a row. GPT-OSS's loader
reads them through ``Mxfp4Tensor``: kept packed on the device (``Mxfp4Weight``) with
``quantization="auto"`` where each device's piece is whole groups, else dequantized on load.

Checked before anything is read, from the headers: every scale's shape and dtype, a quantized weight
without its scale, a scale without its weight. Scale values (finite, positive) are checked as each
tensor is read.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.errors import CheckpointError, ConfigError

FP8_DTYPE = "F8_E4M3"
SCALE_DTYPES = ("F32", "BF16", "F16")
BLOCK_SCALE = ".weight_scale_inv"  # per block
TENSOR_SCALE = ".weight_scale"  # per tensor
_ITEMSIZE = {"F8_E4M3": 1, "F8_E5M2": 1, "U8": 1, "I8": 1, "BOOL": 1, "F16": 2, "BF16": 2, "I16": 2, "F32": 4,
             "I32": 4, "F64": 8, "I64": 8}
# Parameters whose layers take an ``Fp8Weight``: a Linear's weight, the stacked experts' projections.
TAKES_FP8 = ("weight", "gate_proj", "up_proj", "down_proj")
SUPPORTED = "fp8 (block or per-tensor e4m3 weights with dynamic activations) and mxfp4 (GPT-OSS's experts)"
MXFP4_GROUP = 32  # values per e8m0 scale, along ``in``
MXFP4_DTYPE = "U8"  # blocks and scales are both stored as bytes
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)  # e2m1, by code


@dataclasses.dataclass(frozen=True)
class Fp8Quantization:
    """``quantization_config`` of an fp8 checkpoint: the block size (None: one scale per tensor) and
    the modules it names as left unquantized."""

    block: tuple[int, int] | None
    not_converted: tuple[str, ...] = ()

    def describe(self) -> str:
        scales = f"one scale per {self.block[0]} x {self.block[1]} block" if self.block else "one scale per tensor"
        return f"fp8 e4m3 weights, {scales}"


def parse(written: dict) -> Fp8Quantization | None:
    """The quantization of a checkpoint from its config.json (``written``; a multimodal config may
    hold it in ``text_config``): an ``Fp8Quantization``, or None for an unquantized checkpoint (and
    for mxfp4, which GPT-OSS's loader reads from the tensors' names). ``ConfigError`` naming the
    field for anything else."""
    raw = written.get("quantization_config")
    if raw is None and isinstance(written.get("text_config"), dict):
        raw = written["text_config"].get("quantization_config")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"quantization_config must be a JSON object, got {type(raw).__name__}")
    method = raw.get("quant_method")
    if method == "mxfp4":
        return None
    if method != "fp8":
        raise ConfigError(f"quantization_config.quant_method {method!r} is not supported; supported: {SUPPORTED}")
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"quantization_config.fmt {fmt!r} is not supported: fp8 weights must be e4m3")
    activations = raw.get("activation_scheme", "dynamic")
    if activations != "dynamic":
        raise ConfigError(f"quantization_config.activation_scheme {activations!r} is not supported: only "
                          "'dynamic' (no activation scales in the checkpoint)")
    block = raw.get("weight_block_size")
    if block is not None:
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
            raise ConfigError(f"quantization_config.weight_block_size must be two positive integers [out, in], "
                              f"got {block!r}")
        block = (block[0], block[1])
    not_converted = []
    for key in ("modules_to_not_convert", "ignored_layers"):
        names = raw.get(key) or []
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"quantization_config.{key} must be a list of module names, got {names!r}")
        not_converted += names
    return Fp8Quantization(block, tuple(not_converted))


def _scale_name(quantization: Fp8Quantization, weight: str) -> str:
    return weight[:-len(".weight")] + (BLOCK_SCALE if quantization.block else TENSOR_SCALE)


def _listed(module: str, names: tuple[str, ...]) -> bool:
    """``module`` (``model.layers.0.mlp.gate``) is, or is inside, a listed module (``lm_head``,
    ``model.layers.0.mlp.gate``, ``gate``)."""
    return any(module == n or module.endswith("." + n) or module.startswith(n + ".") for n in names)


class Fp8Checkpoint:
    """A ``SafetensorsCheckpoint`` whose fp8 weights read as float32 (their scales applied) and whose
    scale tensors are hidden: everything else reads as stored."""

    def __init__(self, checkpoint, quantization: Fp8Quantization):
        self._checkpoint = checkpoint
        self.quantization = quantization
        self.path = checkpoint.path
        self._scales = self._check_headers()

    def __getattr__(self, name):
        return getattr(self._checkpoint, name)

    def _check_headers(self) -> dict[str, str]:
        """{fp8 weight: its scale tensor}, after the header checks."""
        stored = self._checkpoint
        names = set(stored.names())
        quantization = self.quantization
        suffix = BLOCK_SCALE if quantization.block else TENSOR_SCALE
        other = TENSOR_SCALE if quantization.block else BLOCK_SCALE
        problems, scales = [], {}
        for name in sorted(names):
            if name.endswith(other):
                problems.append(f"{name}: a {'per-tensor' if quantization.block else 'per-block'} scale, but "
                                f"quantization_config {'gives' if quantization.block else 'gives no'} "
                                "weight_block_size")
            elif name.endswith(suffix):
                weight = name[:-len(suffix)] + ".weight"
                if weight not in names:
                    problems.append(f"{name}: a scale without its weight {weight}")
                elif stored.dtype(weight) != FP8_DTYPE:
                    problems.append(f"{name}: a scale for {weight}, which is stored as {stored.dtype(weight)}, "
                                    "not fp8")
            elif stored.dtype(name) == FP8_DTYPE:
                scale = _scale_name(quantization, name)
                module = name[:-len(".weight")] if name.endswith(".weight") else name
                if not name.endswith(".weight") or len(stored.shape(name)) != 2:
                    problems.append(f"{name}: fp8 is read for 2-D linear weights only, got shape "
                                    f"{list(stored.shape(name))}")
                elif scale not in names:
                    problems.append(f"{name}: an fp8 weight without its scale {scale}")
                elif _listed(module, quantization.not_converted):
                    problems.append(f"{name}: stored in fp8, but quantization_config's modules_to_not_convert / "
                                    f"ignored_layers lists {module}")
                else:
                    problem = self._check_scale(name, scale)
                    if problem:
                        problems.append(problem)
                    else:
                        scales[name] = scale
        if problems:
            shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
            raise CheckpointError(f"checkpoint {self.path!r} ({self.quantization.describe()}): {shown}")
        return scales

    def _check_scale(self, weight: str, scale: str) -> str | None:
        stored = self._checkpoint
        if stored.dtype(scale) not in SCALE_DTYPES:
            return f"{scale}: scale dtype {stored.dtype(scale)}; expected one of {', '.join(SCALE_DTYPES)}"
        shape, block = tuple(stored.shape(scale)), self.quantization.block
        if block is None:
            want = ((), (1,))
            if shape not in want:
                return f"{scale}: a per-tensor scale has shape [] or [1], got {list(shape)}"
            return None
        out, cols = stored.shape(weight)
        want = (math.ceil(out / block[0]), math.ceil(cols / block[1]))
        if shape != want:
            return (f"{scale}: scale shape {list(shape)}, but {weight} of shape [{out}, {cols}] in "
                    f"weight_block_size {list(block)} blocks needs {list(want)}")
        return None

    # ---- the SafetensorsCheckpoint interface ---------------------------------------------------

    def names(self) -> list[str]:
        hidden = set(self._scales.values())
        return [n for n in self._checkpoint.names() if n not in hidden]

    def dtype(self, name: str) -> str:
        return "F32" if name in self._scales else self._checkpoint.dtype(name)

    def stored_bytes(self) -> int:
        """The bytes of every tensor as stored (fp8 weights, their scales, the rest)."""
        stored = self._checkpoint
        return sum(math.prod(stored.shape(n)) * _ITEMSIZE.get(stored.dtype(n), 4) for n in stored.names())

    def read(self, name: str, index=None) -> np.ndarray:
        if name not in self._scales:
            return self._checkpoint.read(name, index)
        shape = self._checkpoint.shape(name)
        rows, cols = _ranges(index, shape)
        values = self._checkpoint.read(name, (slice(*rows), slice(*cols))).astype(np.float32)
        scale = self._read_scale(name, rows, cols)
        out = values * scale
        return out if index is None or _is_plain(index) else out[_rest(index)]

    # ---- weights kept in fp8 -------------------------------------------------------------------

    def keeps(self, path: tuple, names: tuple[str, ...], shape, axes, plan) -> bool:
        """Whether the parameter at ``path``, read from the tensors ``names`` (one, or one per expert),
        stays in fp8 on the device: a layer takes it (``TAKES_FP8``), its tensors are fp8 weights, and
        each device's piece starts and ends on block boundaries. Else it is dequantized on load."""
        if path[-1] not in TAKES_FP8 or not names or not all(n in self._scales for n in names):
            return False
        block = self.quantization.block
        if block is None:  # one scale per tensor, whole on every device
            return True
        ways = [plan.ways(a) for a in axes[-2:]]
        return all(w == 1 or (n // w) % b == 0 for n, w, b in zip(shape[-2:], ways, block))

    def stream(self, names: tuple[str, ...], stacked: bool, shape, axes, plan) -> "Fp8Weight":
        """A kept parameter onto the devices: its fp8 values and float32 scales as stored, each device
        reading its piece (``stacked``: one tensor per expert along the first axis)."""
        stored, block = self._checkpoint, self.quantization.block
        scale_names = [self._scales[n] for n in names]

        def gather(read_one, tensor_names, index):
            index = tuple(index)
            if not stacked:
                return read_one(tensor_names[0], index)
            experts = range(len(tensor_names))[index[0]]
            return np.stack([read_one(tensor_names[e], index[1:]) for e in experts])

        values = jax.make_array_from_callback(
            shape, plan.sharding(axes), lambda index: gather(lambda n, i: stored.read(n, i or None), names, index))
        if block is None:  # one scale per tensor, as [1, 1], whole on every device
            scale_shape, scale_axes = (*shape[:-2], 1, 1), (*axes[:-2], None, None)
            def read_scale(name, index):
                return np.asarray(stored.read(name), np.float32).reshape(1, 1)[index]
        else:  # split as the values are: each piece is whole blocks (``keeps``)
            scale_shape, scale_axes = (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1])), axes
            def read_scale(name, index):
                return np.asarray(stored.read(name, index or None), np.float32)

        def scales_of(index):
            return _checked(gather(read_scale, scale_names, index), scale_names[0])

        scales = jax.make_array_from_callback(scale_shape, plan.sharding(scale_axes), scales_of)
        return Fp8Weight(values, scales, block)

    def _read_scale(self, name: str, rows, cols) -> np.ndarray:
        """The scale of each element of ``name[rows, cols]``, after checking the values read."""
        scale_name = self._scales[name]
        block = self.quantization.block
        if block is None:
            scales = np.asarray(self._checkpoint.read(scale_name), np.float32).reshape(1, 1)
        else:
            scales = np.asarray(self._checkpoint.read(scale_name, (slice(rows[0] // block[0], -(-rows[1] // block[0])),
                                                                    slice(cols[0] // block[1], -(-cols[1] // block[1])))),
                                np.float32)
        _checked(scales, scale_name)
        if block is None:
            return scales
        expanded = np.repeat(np.repeat(scales, block[0], axis=0), block[1], axis=1)
        r0, c0 = rows[0] % block[0], cols[0] % block[1]
        return expanded[r0:r0 + rows[1] - rows[0], c0:c0 + cols[1] - cols[0]]


def _checked(scales: np.ndarray, name: str) -> np.ndarray:
    """``scales`` as read from ``name``; ``CheckpointError`` unless all are finite and positive."""
    bad = ~(np.isfinite(scales) & (scales > 0))
    if np.any(bad):
        raise CheckpointError(f"{name}: scales must be finite and positive; it holds {scales[bad][:4].tolist()}")
    return scales


def _ranges(index, shape) -> tuple[tuple[int, int], tuple[int, int]]:
    """The (start, stop) rows and columns ``index`` (None, or slices with step 1) covers."""
    parts = tuple(index) if index is not None else ()
    parts += (slice(None),) * (2 - len(parts))
    out = []
    for part, size in zip(parts[:2], shape):
        start, stop, step = part.indices(size) if isinstance(part, slice) else (0, size, 1)
        out.append((start, stop) if step == 1 else (0, size))
    return tuple(out)


def _is_plain(index) -> bool:
    """Whether ``index`` is only step-1 slices of the two dimensions (``_ranges`` covered it)."""
    parts = tuple(index)
    return len(parts) <= 2 and all(isinstance(p, slice) and p.step in (None, 1) for p in parts)


def _rest(index):
    """What is left of ``index`` once its step-1 slices were applied (a strided or integer index)."""
    return tuple(p if not (isinstance(p, slice) and p.step in (None, 1)) else slice(None) for p in tuple(index))


@struct.dataclass
class Fp8Weight:
    """A weight kept in fp8 on the device: ``values`` (float8 e4m3, ``[..., out, in]``) and ``scales``
    (float32, one per ``block`` of the last two dimensions, or ``[..., 1, 1]`` for one per tensor)
    of this device's piece. A layer that takes it dequantizes it with ``as_array``; a kernel may read
    it as it is."""

    values: jax.Array
    scales: jax.Array
    block: tuple[int, int] | None = struct.field(pytree_node=False, default=None)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    def dequantize(self, dtype) -> jax.Array:
        """The reference: the fp8 value times its block's scale, in float32, then ``dtype``."""
        rows, cols = self.values.shape[-2:]
        scales = self.scales
        if self.block is not None:
            scales = jnp.repeat(jnp.repeat(scales, self.block[0], axis=-2), self.block[1], axis=-1)
            scales = scales[..., :rows, :cols]
        return (self.values.astype(jnp.float32) * scales).astype(dtype)


@struct.dataclass
class Mxfp4Weight:
    """A weight kept in MXFP4 on the device, as GPT-OSS stores its experts: ``blocks`` (uint8,
    ``[..., out, in / 32, 16]``, two e2m1 values per byte, low nibble first) and ``scales`` (uint8
    e8m0 exponents, ``[..., out, in / 32]``: each group of 32 values along ``in`` is multiplied by
    ``2 ** (scale - 127)``) of this device's piece. ``as_array`` dequantizes it; a kernel may read
    the packed bytes as they are."""

    blocks: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the weight it stands for, ``[..., out, in]``."""
        return (*self.blocks.shape[:-2], self.blocks.shape[-2] * MXFP4_GROUP)

    def dequantize(self, dtype) -> jax.Array:
        """The reference: each e2m1 value times its group's power of two, in float32, then ``dtype``."""
        table = jnp.asarray(FP4_VALUES)
        values = jnp.stack([table[self.blocks & 0x0F], table[self.blocks >> 4]], axis=-1)
        values = values.reshape(*self.blocks.shape[:-1], MXFP4_GROUP)
        values = jnp.ldexp(values, self.scales.astype(jnp.int32)[..., None] - 127)
        return values.reshape(self.shape).astype(dtype)


QUANTIZED_WEIGHTS = (Fp8Weight, Mxfp4Weight)


def as_array(weight, dtype):
    """``weight`` as a plain array of ``dtype``: a quantized weight dequantized, anything else as it is."""
    return weight.dequantize(dtype) if isinstance(weight, QUANTIZED_WEIGHTS) else weight


def spec_of(weight, spec):
    """The ``PartitionSpec``s of a kept weight's parts, from the ``spec`` of the weight it stands for
    (an MXFP4 weight's groups split as its ``in`` dimension does)."""
    if isinstance(weight, Mxfp4Weight):
        return Mxfp4Weight(spec, spec)
    scale_spec = spec if weight.block is not None else type(spec)(*tuple(spec)[:-2], None, None)
    return Fp8Weight(spec, scale_spec, weight.block)


# ---- MXFP4 (GPT-OSS's experts) ------------------------------------------------------------------


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [..., G, B], scales uint8 [..., G] -> float32 [..., G * 2B].

    Each byte holds two FP4 (e2m1) values, low nibble first; each group of 2B values shares the
    power-of-two scale ``2 ** (scale - 127)``.
    """
    low = FP4_VALUES[blocks & 0x0F]
    high = FP4_VALUES[blocks >> 4]
    values = np.stack([low, high], axis=-1).reshape(*blocks.shape[:-1], 2 * blocks.shape[-1])
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:-2], -1)


def _check_mxfp4(blocks: np.ndarray, scales: np.ndarray, name: str) -> None:
    """``CheckpointError`` where a group of ``name`` would not be finite: an exponent of 255 (e8m0's
    NaN), or 254 with a value of magnitude 2 or more (past float32's range)."""
    big = ((blocks & 0x07) >= 4) | (((blocks >> 4) & 0x07) >= 4)
    bad = (scales == 255) | ((scales == 254) & big.any(axis=-1))
    if np.any(bad):
        raise CheckpointError(f"{name}: MXFP4 groups whose scale makes them infinite or NaN (exponents "
                              f"{scales[bad][:4].tolist()})")


def mxfp4_tensors(checkpoint) -> dict[str, str]:
    """{``<name>_blocks``: ``<name>_scales``} of the MXFP4 tensors a checkpoint stores (bytes both)."""
    names = set(checkpoint.names())
    return {n: n[:-len("_blocks")] + "_scales" for n in sorted(names)
            if n.endswith("_blocks") and n[:-len("_blocks")] + "_scales" in names
            and checkpoint.dtype(n) == MXFP4_DTYPE}


def parameter_count(checkpoint) -> int:
    """The weights a checkpoint holds, counting the values a quantized tensor stands for: two per
    MXFP4 byte, and no scales."""
    mxfp4 = mxfp4_tensors(checkpoint)
    scales = set(mxfp4.values())
    return sum(math.prod(checkpoint.shape(n)) * (2 if n in mxfp4 else 1) for n in checkpoint.names()
               if n not in scales)


def stored_bytes(checkpoint) -> int:
    """The bytes of every tensor of a checkpoint as stored (quantized values, their scales, the rest)."""
    if isinstance(checkpoint, Fp8Checkpoint):
        return checkpoint.stored_bytes()
    return sum(math.prod(checkpoint.shape(n)) * _ITEMSIZE.get(checkpoint.dtype(n), 4) for n in checkpoint.names())


class Mxfp4Tensor:
    """A stacked expert projection stored in MXFP4 as ``<name>_blocks`` ``[E, R, G, 16]`` and
    ``<name>_scales`` ``[E, R, G]``: the parameter ``[E, out, G * 32]`` takes the stored rows
    ``rows`` (GPT-OSS's fused ``gate_up_proj`` interleaves gate and up: ``0::2`` / ``1::2``).

    ``read`` gives a slice of the dequantized float32 weight (reading only the groups it covers);
    ``keeps`` / ``stream`` keep it packed on the device (``Mxfp4Weight``), each device its piece."""

    dtypes = (MXFP4_DTYPE,)

    def __init__(self, blocks: str, scales: str, rows: slice = slice(None)):
        self.names = (blocks, scales)
        self.rows = rows

    def shape(self, checkpoint) -> tuple[int, ...]:
        blocks, scales = (tuple(checkpoint.shape(n)) for n in self.names)
        if len(blocks) != 4 or blocks[-1] * 2 != MXFP4_GROUP or scales != blocks[:-1]:
            raise CheckpointError(f"{self.names[0]} {list(blocks)} / {self.names[1]} {list(scales)}: MXFP4 experts "
                                  f"are blocks [E, rows, groups, {MXFP4_GROUP // 2}] with scales [E, rows, groups]")
        return blocks[0], len(range(blocks[1])[self.rows]), blocks[2] * MXFP4_GROUP

    def _read(self, checkpoint, name: str, experts: slice, rows: slice, groups: slice) -> np.ndarray:
        """``name``'s stored ``[experts, rows, groups]``, ``rows`` counted in the parameter's rows."""
        stored = range(checkpoint.shape(name)[1])[self.rows][rows]
        span = slice(stored.start, stored[-1] + 1) if len(stored) else slice(0, 0)
        return checkpoint.read(name, (experts, span, groups))[:, ::stored.step]

    def _read_checked(self, checkpoint, experts: slice, rows: slice, groups: slice):
        """The blocks and scales of ``[experts, rows, groups]``, refused where not finite."""
        blocks, scales = (self._read(checkpoint, n, experts, rows, groups) for n in self.names)
        _check_mxfp4(blocks, scales, self.names[0])
        return blocks, scales

    def read(self, checkpoint, index) -> np.ndarray:
        parts = tuple(index) if index is not None else ()
        experts, rows, cols = parts + (slice(None),) * (3 - len(parts))
        start, stop, step = cols.indices(self.shape(checkpoint)[2])
        first, last = start // MXFP4_GROUP, max(start // MXFP4_GROUP, -(-stop // MXFP4_GROUP))
        values = dequantize_mxfp4(*self._read_checked(checkpoint, experts, rows, slice(first, last)))
        offset = first * MXFP4_GROUP
        return values[..., start - offset:stop - offset:step]

    def keeps(self, shape, axes, plan) -> bool:
        """Whether each device's piece of ``in`` is whole groups of 32 (else it is dequantized on load)."""
        return (shape[-1] // plan.ways(axes[-1])) % MXFP4_GROUP == 0

    def stream(self, checkpoint, shape, axes, plan) -> Mxfp4Weight:
        """The packed blocks and exponents onto the devices, each device reading its piece."""
        groups = shape[-1] // MXFP4_GROUP

        def blocks_of(index):  # checked with their scales (a sixteenth of their bytes)
            return self._read_checked(checkpoint, *index[:3])[0]

        def scales_of(index):
            return self._read(checkpoint, self.names[1], *index)

        blocks = jax.make_array_from_callback((*shape[:-1], groups, MXFP4_GROUP // 2),
                                              plan.sharding((*axes, None)), blocks_of)
        scales = jax.make_array_from_callback((*shape[:-1], groups), plan.sharding(axes), scales_of)
        return Mxfp4Weight(blocks, scales)
