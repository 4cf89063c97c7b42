"""The checkpoint folder's tokenizer and chat template (local files only, never a hub)."""

from __future__ import annotations

import os

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES)


def load_tokenizer(path: str):
    """The folder's HF tokenizer, or None when it holds no tokenizer files."""
    if not has_tokenizer(path):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
