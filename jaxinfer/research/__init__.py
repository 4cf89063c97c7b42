"""Research forwards of a loaded model (``jaxinfer.load_model``): per-sequence results of one causal
forward over a batch of sequences, with captures of what happens inside it (hidden states, attention
probabilities, routing, sparse-attention selections, recurrent states), in HF's conventions.

``request.py`` checks what is asked for against the model's layers, ``batch.py`` pads sequences to
bucketed shapes, ``program.py`` is the compiled forward, ``forward.py`` runs it and cuts out each
sequence's results (``ForwardResult``). The layers record through ``jaxinfer.models.layers.capture``.
"""

from jaxinfer.research.forward import MAX_ATTENTION_BYTES, ForwardResult
from jaxinfer.research.request import CAPTURES

__all__ = ["CAPTURES", "ForwardResult", "MAX_ATTENTION_BYTES"]
