"""Per-call state that some kernels need beyond their operands, opaque to models.

The engine makes one ``KernelContext`` per model call (``AttentionMetadata.kernel_context``); models
hand it to the ops they call and never read it. It carries:

- ``call_id``: an int32 that no recent call shares. Kernels whose CTAs hand data to each other as
  flagged words (``mgpu_inline``) derive each call's flag from it, so that words a reused buffer
  still holds from an earlier call never pass for this one's. ``flag(kernel, ...)`` hands out one flag
  per call of a kernel within the model call; a kernel that returns its successor's flag stores it
  back (``chain_flag``), so a chain of calls (a step's layers) builds no flag of its own.
- faults: a kernel that can detect at run time that its result is wrong (a persistent kernel whose
  wait reached its spin limit) reports a flag here (``report_fault``); the engine returns
  ``any_fault()`` with the call's outputs and raises ``jaxinfer.errors.KernelFaultError`` when it
  is set.

The object lives for one trace: the jitted program rebuilds it from its pytree (``call_id``), so
flags and faults collected while tracing one program never leak into another.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FLAGS_PER_KERNEL = 256  # calls of one flagged kernel in one model call
KERNELS_PER_CALL = 4  # flagged kernels one model call may use
CALL_ID_PERIOD = 2 ** 31 // (FLAGS_PER_KERNEL * KERNELS_PER_CALL)  # call ids repeat after this many calls


@jax.tree_util.register_pytree_node_class
class KernelContext:
    def __init__(self, call_id):
        self.call_id = call_id  # [] int32, in [0, CALL_ID_PERIOD)
        self._chained: dict[str, object] = {}
        self._calls: dict[str, int] = {}
        self._faults: list[tuple[str, jax.Array]] = []

    def tree_flatten(self):
        return (self.call_id,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0])

    def flag(self, kernel: str, make_words):
        """The flag words of this call of ``kernel`` (``make_words`` turns an int32 flag into them):
        what its previous call in this model call handed on (``chain_flag``), else a fresh flag.
        Kernel ``k`` (by first use) of the model call numbered ``c`` takes the flags
        ``(c * KERNELS_PER_CALL + k) * FLAGS_PER_KERNEL + n`` for its calls ``n = 0, 1, ...``, so a
        kernel that hands on its flag plus one walks its own range."""
        if kernel not in self._calls:
            if len(self._calls) == KERNELS_PER_CALL:
                raise ValueError(f"a model call used more than {KERNELS_PER_CALL} flagged kernels")
            self._calls[kernel] = 0
        n = self._calls[kernel]
        if n == FLAGS_PER_KERNEL:
            raise ValueError(f"a model call made more than {FLAGS_PER_KERNEL} calls of {kernel}")
        self._calls[kernel] = n + 1
        chained = self._chained.pop(kernel, None)
        if chained is not None:
            return chained
        k = list(self._calls).index(kernel)
        base = (jnp.asarray(self.call_id, jnp.int32) * KERNELS_PER_CALL + k) * FLAGS_PER_KERNEL
        return make_words(base + jnp.int32(n))

    def chain_flag(self, kernel: str, next_words) -> None:
        """Keep ``next_words``, the flag words a call of ``kernel`` returned for its next call (its
        own flag plus one)."""
        self._chained[kernel] = next_words

    def report_fault(self, kernel: str, failed: jax.Array) -> None:
        """``failed``: a bool array, any True meaning this call of ``kernel`` returned wrong values."""
        self._faults.append((kernel, jnp.any(failed)))

    @property
    def fault_sources(self) -> tuple[str, ...]:
        return tuple(sorted({name for name, _ in self._faults}))

    def any_fault(self) -> jax.Array:
        """[] bool: whether any kernel of this model call reported a fault."""
        if not self._faults:
            return jnp.zeros((), bool)
        return jnp.any(jnp.stack([f for _, f in self._faults]))
