"""Choosing an op's implementation by platform, with the plain-jnp reference as the fallback."""

from __future__ import annotations

import jax


class OpDispatcher:
    """``implementations``: name -> {op: function}; ``"reference"`` must define every op.

    ``platform_default`` maps ``jax.default_backend()`` names to an implementation; an op the chosen
    implementation lacks runs the reference.
    """

    def __init__(self, kind: str, implementations: dict[str, dict], platform_default: dict[str, str]):
        self.kind = kind
        self.implementations = implementations
        self.platform_default = platform_default
        self.forced: str | None = None

    def set_implementation(self, name: str | None) -> None:
        """Force one implementation everywhere (``None`` goes back to the per-platform default)."""
        if name is not None and name not in self.implementations:
            raise ValueError(f"unknown {self.kind} implementation {name!r}; known: {sorted(self.implementations)}")
        self.forced = name

    def implementation_name(self) -> str:
        return self.forced or self.platform_default.get(jax.default_backend(), "reference")

    def __call__(self, op: str):
        chosen = self.implementations[self.implementation_name()]
        return chosen.get(op, self.implementations["reference"][op])
