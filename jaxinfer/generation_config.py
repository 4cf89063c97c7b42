"""The checkpoint's ``generation_config.json``: EOS ids and the sampling defaults of ``generate()``.

Read through transformers' ``GenerationConfig`` (local files only; the class runs no code from the
checkpoint), then checked. The sampling defaults are what HF's ``generate()`` would use with this
file: greedy unless ``do_sample`` is true, and then ``temperature``, ``top_k``, ``top_p`` and
``min_p`` from the file, HF's global defaults (1.0, 50, 1.0, off) for those it does not set.
"""

from __future__ import annotations

import dataclasses
import os

from jaxinfer import checks
from jaxinfer.checkpoint_folder import CheckpointFolder
from jaxinfer.config import eos_id_list
from jaxinfer.errors import ConfigError

FILE = "generation_config.json"
# transformers' GenerationConfig defaults for what a file leaves unset (GenerationConfig._get_default_generation_params)
HF_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": 0.0}


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: tuple[int, ...] | None  # None: the file sets none
    sampling: dict  # SamplingParams keyword arguments

    @classmethod
    def read(cls, path: str | os.PathLike | CheckpointFolder, vocab_size: int) -> "GenerationDefaults | None":
        """The folder's generation config, or None when it has none (or ``path`` is not a folder)."""
        if not isinstance(path, CheckpointFolder):
            if not os.path.isdir(os.fspath(path)):
                return None
            path = CheckpointFolder(path)
        if not path.has(FILE):
            return None
        raw = path.read_json(FILE)  # malformed JSON is a ConfigError naming the file
        if not isinstance(raw, dict):
            raise ConfigError(f"{FILE} in {path.path!r} must hold a JSON object")
        from transformers import GenerationConfig

        try:
            hf = GenerationConfig.from_dict(dict(raw))
        except Exception as e:
            raise ConfigError(f"{FILE} in {path.path!r} is rejected by transformers' GenerationConfig: {e}") from e
        return cls.from_hf(hf, vocab_size)

    @classmethod
    def from_hf(cls, hf, vocab_size: int) -> "GenerationDefaults":
        def field(name, check, **bounds):
            return checks.optional(check, getattr(hf, name, None), f"{FILE}: {name}", **bounds)

        eos = getattr(hf, "eos_token_id", None)
        if eos is not None:
            eos = eos_id_list(eos, f"{FILE}: eos_token_id", vocab_size)
        set_values = {
            "temperature": field("temperature", checks.number, ge=0),
            "top_k": field("top_k", checks.integer, ge=0),
            "top_p": field("top_p", checks.number, gt=0, le=1),
            "min_p": field("min_p", checks.number, ge=0, le=1),
        }
        if field("do_sample", checks.boolean):
            sampling = {k: HF_SAMPLING_DEFAULTS[k] if v is None else v for k, v in set_values.items()}
            sampling["top_k"] = min(sampling["top_k"], vocab_size)  # as HF's top-k warper clamps it
        else:
            sampling = {"temperature": 0.0}  # HF's generate() is greedy unless do_sample is set
        return cls(eos_token_ids=eos, sampling=sampling)
