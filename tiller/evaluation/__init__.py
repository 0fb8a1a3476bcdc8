"""Batch generation (`tiller generate`), evaluation with mean@n / pass@k / maj@k (`tiller eval`), and the
pieces they share with the OpenAI-compatible server (`tiller.evaluation.runner`)."""

from tiller.evaluation.metrics import evaluation_metrics, k_ladder, maj_at_k, majority_answer, pass_at_k

__all__ = ["evaluation_metrics", "k_ladder", "maj_at_k", "majority_answer", "pass_at_k"]
