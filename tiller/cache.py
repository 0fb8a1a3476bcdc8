"""Where tiller keeps what it builds once per machine: `$TILLER_CACHE`, default `~/.cache/tiller`."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """`$TILLER_CACHE/<parts>` (default `~/.cache/tiller/<parts>`); not created here."""
    base = os.environ.get("TILLER_CACHE") or Path.home() / ".cache" / "tiller"
    return Path(base).joinpath(*parts)
