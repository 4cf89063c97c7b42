"""Layers shared by every model family: norms, rotary embeddings, projections, MLPs, attention."""
