"""tiller: reinforcement-learning post-training of language models.

One process by default (debuggable with breakpoints); Ray and torch.distributed when you outgrow it.
Importing tiller never imports Ray or vLLM.
"""

__version__ = "0.1.0"
