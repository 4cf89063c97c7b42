"""How MoE checkpoints lay out expert weights, as ``jaxinfer.weights`` sources.

Parameters keep one layout (stacked, nn.Linear orientation, see ``models/layers/moe.py``); these
helpers say where each comes from on disk.
"""

from __future__ import annotations

import re

from jaxinfer.errors import ConfigError
from jaxinfer.weights import Stacked, Tensor

_EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.")


def check_expert_count(checkpoint, field: str, num_experts: int, ignored: tuple[str, ...] = ()) -> None:
    """Per-expert checkpoints: the expert indices in the tensor names (those matching no ``ignored``
    regex) are exactly ``range(num_experts)``, read from the names alone, before any per-expert
    source is built. ``ConfigError`` naming ``field``."""
    patterns = [re.compile(p) for p in ignored]
    names = [n for n in checkpoint.names() if not any(p.search(n) for p in patterns)]
    held = sorted({int(m.group(1)) for m in map(_EXPERT_NAME.search, names) if m})
    if held and held != list(range(num_experts)):
        raise ConfigError(f"{field} is {num_experts}, but the checkpoint's tensors hold experts "
                          f"{held[0]}..{held[-1]} ({len(held)} distinct)")


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
