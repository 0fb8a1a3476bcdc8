"""Run records: `Tracker` (console / JSONL / TensorBoard / W&B / MLflow), `timer`, and `tiller report`."""

from tiller.tracking.tracker import CONSOLE_KEYS, LOGGERS, Tracker, parse_loggers, timer

__all__ = ["CONSOLE_KEYS", "LOGGERS", "Tracker", "parse_loggers", "timer"]
