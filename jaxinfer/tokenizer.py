"""The checkpoint folder's tokenizer and chat template: local files only, never a hub, never code.

The tokenizer is loaded by transformers with ``trust_remote_code=False``: a tokenizer that only code
shipped with the checkpoint (``auto_map``) can build is refused with ``TokenizerUnavailableError``,
and nothing from the folder is imported. Chat templates render as transformers renders them, in its
sandboxed Jinja environment bounded in memory and time (``jaxinfer.chat_template``); a template that
fails on a conversation, or asks for more than the bounds, is the request's error.
"""

from __future__ import annotations

import os
import re

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


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: str, what: str) -> None:
    """``InvalidRequestError`` if ``text`` holds a lone surrogate (a code point U+D800..U+DFFF): not valid
    Unicode text, which the tokenizer (UTF-8) cannot take."""
    found = _SURROGATE.search(text)
    if found is not None:
        raise InvalidRequestError(
            f"{what} holds a lone surrogate (U+{ord(found.group()):04X}) at character {found.start()}, which is not "
            "valid Unicode text: it has no UTF-8 encoding for the tokenizer. Remove it, or if it is half of a "
            "UTF-16 surrogate pair decode the text properly (text.encode('utf-16', 'surrogatepass').decode('utf-16'))"
        )


def _check_conversation(conversation, index: int) -> None:
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise InvalidRequestError(f"conversation {index} must be a non-empty list of messages, got {conversation!r}")
    for i, message in enumerate(conversation):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequestError(
                f"message {i} of conversation {index} must be a dict with a 'role' string, got {message!r}"
            )
        stack, seen = [(value, repr(key)) for key, value in message.items()], set()
        while stack:  # the strings in the message, nested ones too (content blocks, tool calls)
            value, path = stack.pop()
            if isinstance(value, str):
                check_text(value, f"message {i} of conversation {index} ({path})")
            elif isinstance(value, (dict, list, tuple)) and id(value) not in seen:
                seen.add(id(value))
                items = value.items() if isinstance(value, dict) else enumerate(value)
                stack.extend((item, f"{path}[{key!r}]") for key, item in items)


def render_chat(tokenizer, conversations, add_generation_prompt: bool) -> list[list[int]]:
    """Token ids of each conversation through the tokenizer's chat template, as
    ``tokenizer.apply_chat_template`` makes them, the template rendered in the bounded sandbox of
    ``jaxinfer.chat_template``; ``InvalidRequestError`` for a malformed conversation, a template that
    raises on it, or one over the sandbox's bounds (``ChatTemplateLimitError``)."""
    from jaxinfer.chat_template import ChatTemplateLimitError, encode_chat, render_chat_template

    for index, conversation in enumerate(conversations):
        _check_conversation(conversation, index)
    out = []
    for index, conversation in enumerate(conversations):
        try:
            text = render_chat_template(tokenizer, list(conversation), add_generation_prompt=add_generation_prompt)
            check_text(text, f"the chat template's text for conversation {index}")
            ids = encode_chat(tokenizer, text)
        except ChatTemplateLimitError as e:
            raise ChatTemplateLimitError(f"the chat template was refused on conversation {index}: {e}") from None
        except InvalidRequestError:
            raise
        except Exception as e:  # jinja2's TemplateError (also raise_exception() in a template), bad content
            message = " ".join(str(e).split())
            if len(message) > 2000:  # e.g. raise_exception() of a long string
                message = f"{message[:2000]}... ({len(message):,} characters)"
            raise InvalidRequestError(
                f"the chat template failed on conversation {index}: {type(e).__name__}: {message}"
            ) from e
        out.append(ids)
    return out
