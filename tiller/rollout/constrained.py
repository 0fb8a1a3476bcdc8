"""Constrained decoding: a grammar (here a JSON schema) limits every sampled token to those that keep the text a
prefix of the grammar's language, so the finished text is valid by construction (the approach of Willard & Louf
2023, "Efficient Guided Generation for LLMs"); the token masks come from llguidance (guidance-ai's Earley parser,
one of vLLM's structured-output backends).

`GrammarCompiler(tokenizer, vocab_size).json_schema(schema)` compiles once per request and returns a `Grammar`;
every generated row gets its own matcher (`Grammar.matcher()`: the `n` rows of a request diverge). Per decode
step the continuous batcher (`tiller.rollout.continuous`) calls `allowed_tokens(rows, V)` and sets the
logits of the other tokens to -inf before sampling, then feeds each row's sampled token to its matcher. The
end-of-sequence token is allowed only where the text is complete; once the grammar admits nothing more, eos
is the only token left.

JSON layout: by default objects and arrays are written on one line with `", "` and `": "` separators and no other
whitespace (as Python's `json.dumps`), so a model cannot spend its budget on whitespace. A schema with an
`"x-guidance"` key gets llguidance's own defaults and those options instead (`{"whitespace_flexible": true}`: any
whitespace around `,` and `:`; see llguidance's JsonCompileOptions).

Letters: `B` constrained rows, `V` vocabulary (the model's logits width).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import torch

from tiller.errors import UserError

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance JSON options for a schema without an `"x-guidance"` key (see the module docstring)."""

Matcher = llguidance.LLMatcher
"""One row's grammar state: `consume_token`, `is_error` / `get_error`, masks via `allowed_tokens`."""

_BITS = torch.arange(8, dtype=torch.uint8)


class GrammarError(UserError):
    """A grammar or schema that llguidance cannot compile; the message is llguidance's."""


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar bound to one tokenizer. `matcher()` gives a fresh matcher (one per generated row)."""

    prototype: Matcher
    eos_ids: tuple[int, ...]
    mask_vocab: int
    """Tokens the matcher's masks cover (the tokenizer's vocabulary or the logits width, the larger)."""

    def matcher(self) -> Matcher:
        return self.prototype.deep_copy()


class GrammarCompiler:
    """Compiles grammars for one Hugging Face (fast) tokenizer and a model whose logits are `vocab_size` wide.

    Wrapping the tokenizer costs ~1 s for a 150k vocabulary, so a server makes one compiler and keeps it.
    """

    def __init__(self, tokenizer, vocab_size: int):
        width = int(vocab_size)
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=max(width, len(tokenizer)))
        except ValueError as err:  # a slow (Python) tokenizer
            raise GrammarError(f"constrained decoding needs a fast tokenizer: {err}") from None
        self.vocab_size = width
        # llguidance >= 1.7 lists every end token (`eos_tokens`); 1.3-1.6 (the newest on glibc < 2.31) has one
        eos = getattr(self.tokenizer, "eos_tokens", None)
        self.eos_ids = tuple(eos) if eos else (self.tokenizer.eos_token,)

    def json_schema(self, schema: dict[str, Any]) -> Grammar:
        """The grammar of JSON texts valid under `schema` (`{"type": "object"}`: any JSON object)."""
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
        try:
            layout = None if "x-guidance" in schema else JSON_LAYOUT
            source = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=layout)
        except (ValueError, TypeError) as err:
            raise GrammarError(str(err)) from None
        return self.compile(source)

    def regex(self, pattern: str) -> Grammar:
        """The grammar of texts matching `pattern` in full (vLLM's `structured_outputs` regex; llguidance's regex
        dialect: Rust's `regex` syntax, anchored at both ends)."""
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError(f"a regex must be a non-empty string, got {pattern!r}")
        try:
            source = llguidance.LLMatcher.grammar_from_regex(pattern)
        except (ValueError, TypeError) as err:
            raise GrammarError(str(err)) from None
        return self.compile(source)

    def compile(self, source: str) -> Grammar:
        """A grammar from llguidance's grammar text (`LLMatcher.grammar_from_*`)."""
        matcher = llguidance.LLMatcher(self.tokenizer, source, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return Grammar(matcher, self.eos_ids, self.tokenizer.vocab_size)


def allowed_tokens(rows: list[tuple[Matcher, Grammar]], vocab_size: int) -> torch.Tensor:
    """Which tokens each (matcher, its grammar) allows next: bool [B, V] on the CPU.

    llguidance writes one bit per token into int32 words (bit j of word w is token 32 w + j); ids past the
    tokenizer's vocabulary are never allowed.
    """
    words = max((g.mask_vocab + 31) // 32 for _, g in rows)
    bitmask = torch.zeros((len(rows), max(words, (vocab_size + 31) // 32)), dtype=torch.int32)
    for row, (matcher, grammar) in enumerate(rows):
        part = bitmask[row, : (grammar.mask_vocab + 31) // 32]
        matcher.unsafe_compute_mask_ptr(part.data_ptr(), part.numel() * part.element_size())
    # read as bytes (little-endian, as every platform torch ships for): byte k of word w holds tokens 32 w + 8 k + b
    bits = (bitmask.view(torch.uint8).unsqueeze(-1) >> _BITS) & 1  # [B, 4 W, 8]
    return bits.view(len(rows), -1)[:, :vocab_size].bool()


class GrammarRows:
    """One matcher per row of a decode loop, in the loop's batch order (the native engine's eager loop):
    `mask(logits)` before sampling, `consume(tokens)` after, `select(keep)` when rows leave the batch."""

    def __init__(self, grammar: Grammar, rows: int):
        self.grammar = grammar
        self.matchers = [grammar.matcher() for _ in range(rows)]

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] with the tokens each row's grammar forbids set to -inf."""
        allowed = allowed_tokens([(m, self.grammar) for m in self.matchers], logits.shape[-1])
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def consume(self, tokens: list[int]) -> None:
        for matcher, token in zip(self.matchers, tokens):
            matcher.consume_token(token)
        broken = next((m.get_error() for m in self.matchers if m.is_error()), None)
        if broken is not None:  # e.g. past llguidance's per-step limits
            raise RuntimeError(f"constrained decoding failed: {broken}")

    def select(self, keep: list[int]) -> None:
        self.matchers = [self.matchers[i] for i in keep]
