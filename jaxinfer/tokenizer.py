"""The checkpoint folder's tokenizer and chat template: local files only, never a hub, never code.

The tokenizer is loaded by transformers with ``trust_remote_code=False``: a tokenizer that only code
shipped with the checkpoint (``auto_map``) can build is refused with ``TokenizerUnavailableError``,
and nothing from the folder is imported. Chat templates render in transformers' sandboxed Jinja
environment; a template that fails on a conversation is the request's error.
"""

from __future__ import annotations

import os

from jaxinfer.checkpoint_folder import CheckpointFolder
from jaxinfer.errors import InvalidRequestError, TokenizerUnavailableError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(path: str | CheckpointFolder) -> bool:
    folder = path if isinstance(path, CheckpointFolder) else CheckpointFolder(path)
    return any(folder.has(name) for name in TOKENIZER_FILES)


def load_tokenizer(path: str | os.PathLike | CheckpointFolder):
    """The folder's HF tokenizer, or None when it holds no tokenizer files."""
    folder = path if isinstance(path, CheckpointFolder) else CheckpointFolder(path)
    if not has_tokenizer(folder):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder.path, local_files_only=True, trust_remote_code=False)
    except Exception as e:
        message = " ".join(str(e).split())
        if "trust_remote_code" in message or "custom code" in message:
            raise TokenizerUnavailableError(
                f"the tokenizer of {folder.path!r} needs code shipped with the checkpoint (auto_map in its "
                "tokenizer_config.json or config.json); jaxinfer never runs code from a checkpoint. Serve it "
                "without a tokenizer (LLM(..., skip_tokenizer_init=True)) and pass prompt_token_ids"
            ) from e
        raise TokenizerUnavailableError(
            f"the tokenizer files of {folder.path!r} could not be loaded ({type(e).__name__}: {message}); fix or "
            "remove them, or serve without a tokenizer (skip_tokenizer_init=True) and pass prompt_token_ids"
        ) from e


def _check_conversation(conversation, index: int) -> None:
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise InvalidRequestError(f"conversation {index} must be a non-empty list of messages, got {conversation!r}")
    for i, message in enumerate(conversation):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequestError(
                f"message {i} of conversation {index} must be a dict with a 'role' string, got {message!r}"
            )


def render_chat(tokenizer, conversations, add_generation_prompt: bool) -> list[list[int]]:
    """Token ids of each conversation through the tokenizer's chat template; ``InvalidRequestError``
    for a malformed conversation or a template that raises on it."""
    for index, conversation in enumerate(conversations):
        _check_conversation(conversation, index)
    out = []
    for index, conversation in enumerate(conversations):
        try:
            ids = tokenizer.apply_chat_template(list(conversation), add_generation_prompt=add_generation_prompt,
                                                tokenize=True, return_dict=False)
        except Exception as e:  # jinja2's TemplateError (also raise_exception() in a template), bad content
            raise InvalidRequestError(
                f"the chat template failed on conversation {index}: {type(e).__name__}: {' '.join(str(e).split())}"
            ) from e
        out.append(list(ids))
    return out
