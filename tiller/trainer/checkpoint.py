"""Moved to `tiller.models.checkpoint` (checkpoint I/O sits below the workers and trainers that both use it);
this name stays importable for code written against it."""

from tiller.models.checkpoint import (  # noqa: F401
    MARKER, PREFIX, export_hf, export_main, latest_checkpoint, list_checkpoints, load_checkpoint,
    resolve_checkpoint, save_checkpoint, write_text_atomic,
)
