"""Output files written atomically: a temporary file beside the target, renamed over it at the end."""

from __future__ import annotations

import os
from pathlib import Path


def replaceable_target(path: str | Path) -> Path:
    """The file an atomic write to ``path`` may replace: ``path`` itself, or for a symbolic link the file it points
    to (the link stays a link). Refused (ValueError) where something other than a regular file is there: the rename
    would swap a device, a pipe or a folder for an ordinary file (``--save-session /dev/null`` as root replaced the
    device node)."""
    target = Path(os.path.realpath(path)) if Path(path).is_symlink() else Path(path)
    if target.exists() and not target.is_file():
        raise ValueError(f"{path} is not a regular file (a folder, device or pipe): ds4x writes files by renaming "
                         f"a new one over the old, which would replace it")
    return target
