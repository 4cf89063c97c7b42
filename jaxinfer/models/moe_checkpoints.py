"""How MoE checkpoints lay out expert weights, as ``jaxinfer.weights`` sources.

Parameters keep one layout (stacked, nn.Linear orientation, see ``models/layers/moe.py``); these
helpers say where each comes from on disk.
"""

from __future__ import annotations

from jaxinfer.weights import Stacked, Tensor


def per_expert_sources(model_cls, expected: dict, names: dict[str, str]) -> dict:
    """Experts stored one tensor per expert: ``<block>.experts.{e}.<name>.weight``.

    ``names`` maps our parameter names (gate_proj, up_proj, down_proj) to the checkpoint's
    (e.g. w1, w3, w2 in Mixtral-style checkpoints).
    """
    sources = {}
    for path, struct in expected.items():
        if len(path) >= 2 and path[-2] == "experts" and path[-1] in names:
            prefix = model_cls.path_to_checkpoint_name(path[:-1])
            sources[path] = Stacked([f"{prefix}.{e}.{names[path[-1]]}.weight" for e in range(struct.shape[0])])
        else:
            sources[path] = Tensor(model_cls.path_to_checkpoint_name(path))
    return sources
