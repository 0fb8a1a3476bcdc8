"""OpenAI-compatible HTTP server over a rollout engine (`tiller serve MODEL_DIR`): see `tiller.serve.app`."""
