"""The checkpoint folder: the one place a model's files are read from.

``ConfinedFolder`` is a folder whose files are read only where they resolve inside it; checkpoint
folders (here) and export directories (``jaxinfer.engine.manifest.ExportFolder``) are ones.

A file is named relative to the folder and must resolve, after symlinks, to a regular file inside it.
Symlinks in the folder that point elsewhere are refused, so neither jaxinfer nor the transformers
code it calls for the config and tokenizer can be led to read another file. One layout is allowed
to point out: the HuggingFace hub cache, whose snapshot files are symlinks into the repository's
``blobs/`` folder (``models--org--name/snapshots/<rev>/config.json -> ../../blobs/<sha>``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from jaxinfer.errors import CheckpointError, ConfigError

# Subfolders that transformers reads files from when it loads a tokenizer.
_READ_SUBFOLDERS = ("additional_chat_templates",)


def _hub_blobs_dir(root: str) -> str | None:
    """``.../models--org--name/blobs`` when ``root`` is a snapshot folder of the hub cache."""
    snapshots = os.path.dirname(root)
    repo = os.path.dirname(snapshots)
    if os.path.basename(snapshots) != "snapshots" or "--" not in os.path.basename(repo):
        return None
    blobs = os.path.join(repo, "blobs")
    return blobs if os.path.isdir(blobs) else None


class ConfinedFolder:
    """A folder whose files are read only where they resolve, after symlinks, to regular files inside
    it (or inside ``also_allowed``). ``error`` is the exception its refusals raise; ``kind`` names
    the folder in them."""

    error: type[Exception] = CheckpointError
    kind = "folder"

    def __init__(self, path: str | os.PathLike, also_allowed: tuple[str, ...] = ()):
        self.path = os.fspath(path)
        self.root = os.path.realpath(self.path)
        self._allowed = [self.root, *(os.path.realpath(p) for p in also_allowed)]

    def _inside(self, real: str) -> bool:
        return any(os.path.commonpath([real, root]) == root for root in self._allowed)

    def resolve(self, name: str, *, what: str = "file") -> str | None:
        """The real path of the regular file ``name`` in the folder, or None when it does not exist.

        ``error`` for a name that is absolute, climbs out with ``..``, resolves outside the folder or
        is not a regular file.
        """
        if not isinstance(name, str) or not name or os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
            raise self.error(f"{what} {name!r} is not a plain file name inside the {self.kind} {self.path!r}")
        full = os.path.join(self.path, name)
        if not os.path.lexists(full):
            return None
        real = os.path.realpath(full)
        if not self._inside(real):
            raise self.error(f"{what} {name!r} resolves to {real!r}, outside the {self.kind} {self.path!r}; "
                             f"jaxinfer reads no file outside it")
        if not os.path.isfile(real):
            raise self.error(f"{what} {name!r} in {self.path!r} is not a regular file")
        return real

    def read_bytes(self, name: str, *, what: str = "file") -> bytes | None:
        """The bytes of ``name`` (None when absent), opened without following a link swapped in
        after it was resolved."""
        real = self.resolve(name, what=what)
        if real is None:
            return None
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            return f.read()


class CheckpointFolder(ConfinedFolder):
    """A checkpoint folder whose files are confined to it (see the module docstring)."""

    kind = "checkpoint folder"

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise ConfigError(f"{path!r} is not a folder: point at a HuggingFace checkpoint folder")
        blobs = _hub_blobs_dir(os.path.realpath(path))
        super().__init__(path, () if blobs is None else (blobs,))
        self._check_links()

    def _check_links(self) -> None:
        """Refuse any symlink in the folder (or the subfolders transformers reads) that leaves it."""
        for folder in ("", *_READ_SUBFOLDERS):
            full = os.path.join(self.path, folder)
            if folder and not os.path.isdir(full):
                continue
            for entry in os.scandir(full):
                if entry.is_symlink() and not self._inside(os.path.realpath(entry.path)):
                    name = os.path.join(folder, entry.name)
                    raise CheckpointError(
                        f"{name!r} in {self.path!r} is a symlink to {os.path.realpath(entry.path)!r}, outside the "
                        "checkpoint folder; jaxinfer reads no file outside it (copy the file into the folder)"
                    )

    def has(self, name: str) -> bool:
        return self.resolve(name) is not None

    def names(self) -> list[str]:
        """The names of the regular files at the top of the folder."""
        return sorted(e.name for e in os.scandir(self.path) if os.path.isfile(e.path))

    def read_json(self, name: str, error=ConfigError) -> Any:
        """The parsed JSON file ``name``, None when absent; ``error`` naming the file when malformed."""
        real = self.resolve(name)
        if real is None:
            return None
        try:
            with open(real, encoding="utf-8") as f:
                return json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise error(f"{os.path.join(self.path, name)} is not valid JSON: {e}") from e
