"""What one model step needs to read and write the paged cache.

A step runs ``T`` tokens (padded to a bucket) from ``S`` sequences (padded to a bucket). Token ``t``
belongs to sequence ``token_seq_ids[t]``, sits at ``positions[t]`` in it, and its K/V go to cache slot
``slot_mapping[t]`` (``page * page_size + offset``; negative for padding, which is never written).
Sequence ``s`` holds ``seq_lens[s]`` tokens once this step's are written (0 for padding), its pages
listed in ``block_tables[s]``. Token ``t`` attends to positions ``<= positions[t]`` of its sequence.

``decode`` (static) says every sequence brings exactly one token, ``T == S`` and token ``s`` belongs
to sequence ``s``; attention then takes the decode op. ``logits_indices[s]`` is the token row whose
logits sequence ``s`` samples from (its last token in the step).

``step_id`` (an int32 scalar, or None) numbers the model calls of an engine: no two recent calls
share one. Kernels whose CTAs hand data to each other as flagged words derive their flag from it
(``jaxinfer.kernels.mgpu_inline``), so that the words a reused buffer still holds from an earlier
call never pass for this one's; without it those kernels are not used.
"""

from __future__ import annotations

from flax import struct
import jax


@struct.dataclass
class AttentionMetadata:
    positions: jax.Array  # [T] int32
    slot_mapping: jax.Array  # [T] int32, < 0 for padding
    token_seq_ids: jax.Array  # [T] int32
    block_tables: jax.Array  # [S, pages_per_seq] int32
    seq_lens: jax.Array  # [S] int32
    logits_indices: jax.Array  # [S] int32
    step_id: jax.Array | None = None  # [] int32
    decode: bool = struct.field(pytree_node=False, default=False)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
