"""What every model implementation provides to the engine.

A model is a Flax linen module, used functionally: ``model.apply({"params": params}, token_ids, md,
caches)`` returns ``(logits, caches)``. Parameter paths mirror HF checkpoint names (``layers.3`` <->
``layers_3``), so loading is a name mapping, not a conversion. Capability flags are class attributes
the engine reads instead of special-casing families.
"""

from __future__ import annotations

import re
from typing import ClassVar

import flax.linen as nn
import jax.numpy as jnp

from jaxinfer.cache.checkpoint_scales import SCALE_NAME
from jaxinfer.cache.specs import CacheSpec
from jaxinfer.config import ModelConfig

_LAYER_INDEX = re.compile(r"^(.*)_(\d+)$")


class CausalLM(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype = jnp.float32

    # Capability flags.
    supports_tensor_parallel: ClassVar[bool] = True
    supports_expert_parallel: ClassVar[bool] = False
    # Checkpoint tensors that are derived buffers, not parameters (regexes over HF names); KV-cache
    # scales are read for an fp8 cache by jaxinfer.cache.checkpoint_scales.
    ignored_checkpoint_keys: ClassVar[tuple[str, ...]] = (r".*rotary_emb\.inv_freq$", SCALE_NAME.pattern)

    @classmethod
    def validate_config(cls, config: ModelConfig) -> None:
        """Raise ``ConfigError`` for any config value the implementation does not support."""

    @classmethod
    def check_checkpoint_layout(cls, config: ModelConfig, checkpoint) -> None:
        """``ConfigError`` where config sizes contradict the checkpoint's tensor names and header shapes
        (layer count, embedding matrix); cheap, so it runs before the config is expanded into layers.
        Families add their own (expert counts)."""
        from jaxinfer.weights import check_layout

        skipped = tuple(pattern for pattern, _ in cls.skipped_checkpoint_keys_for(config))
        check_layout(checkpoint, config, cls.ignored_checkpoint_keys_for(config) + skipped)

    @classmethod
    def cache_specs(cls, config: ModelConfig) -> tuple[tuple[CacheSpec, ...], ...]:
        """What each layer keeps between steps (``jaxinfer.cache.specs``): one tuple of specs per layer."""
        raise NotImplementedError

    @classmethod
    def ignored_checkpoint_keys_for(cls, config: ModelConfig) -> tuple[str, ...]:
        """``ignored_checkpoint_keys`` plus config-dependent ones (e.g. a stored but tied LM head)."""
        return cls.ignored_checkpoint_keys

    @classmethod
    def skipped_checkpoint_keys_for(cls, config: ModelConfig) -> tuple[tuple[str, str], ...]:
        """(regex, what it is) of checkpoint tensors the family does not serve (a vision tower,
        multi-token-prediction layers): skipped with one log line each, never a load error."""
        return ()

    @classmethod
    def checkpoint_sources(cls, config: ModelConfig, expected: dict, available: set[str]) -> dict:
        """{parameter path: where its value comes from in the checkpoint} (see ``jaxinfer.weights``).

        By default every parameter is the tensor of the same name; families with stacked experts or
        re-laid-out weights override this.
        """
        from jaxinfer.weights import Tensor

        return {path: Tensor(cls.path_to_checkpoint_name(path)) for path in expected}

    @classmethod
    def checkpoint_tensors(cls, config: ModelConfig, params: dict) -> dict:
        """The inverse of ``checkpoint_sources``: {checkpoint name: array} for flat parameters
        ``{path: array}`` (tiny checkpoints are written with it). Families whose sources derive a
        parameter from a re-laid-out tensor override this."""
        from jaxinfer.weights import Stacked, Tensor

        sources = cls.checkpoint_sources(config, params, set())
        tensors = {}
        for path, value in params.items():
            source = sources[path]
            if isinstance(source, Tensor):
                tensors[source.names[0]] = value
            elif isinstance(source, Stacked):
                tensors.update({name: value[i] for i, name in enumerate(source.names)})
            else:
                raise NotImplementedError(f"{cls.__name__} cannot write {path}: it is derived on load")
        return tensors

    @staticmethod
    def path_to_checkpoint_name(path: tuple[str, ...]) -> str:
        out = []
        for part in path:
            match = _LAYER_INDEX.match(part)
            out.append(f"{match.group(1)}.{match.group(2)}" if match else part)
        return ".".join(out)
