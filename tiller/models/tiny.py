"""Tiny-model kit: a locally trained tokenizer and a randomly initialised Qwen2 / Llama causal LM.

Tests, the demo and the benchmarks need real Hugging Face models without a model hub. This module
builds them from scratch:

1. `train_tokenizer` trains a byte-level BPE tokenizer (the GPT-2 / Qwen2 scheme: text is mapped to
   its UTF-8 bytes, each byte to a printable character, then BPE merges are learned; Sennrich et al.
   2016, "Neural Machine Translation of Rare Words with Subword Units") with the `tokenizers` library.
   Digits are split one by one before BPE, so every digit is its own token and numbers never merge
   (as in Llama / Qwen2); arithmetic tasks then tokenize uniformly. Special tokens: `<|pad|>` (pad),
   `<|im_start|>`, `<|im_end|>` (eos, ends an assistant turn) and `<|endoftext|>` (bos id in the model
   config). The chat template is ChatML (Qwen2's), with `{% generation %}` markers around assistant
   text so `apply_chat_template(..., return_assistant_tokens_mask=True)` works for SFT masking.
   Left padding is saved with the tokenizer (RL prompts are left padded).
2. `build_model` picks a shape (hidden size, layers, heads, MLP width) whose parameter count is
   closest to `n_params`, builds the transformers config (vocab = len(tokenizer), tied embeddings,
   pad / eos / bos ids set) and initialises it under `torch.manual_seed(seed)` inside a forked RNG,
   so the same seed gives the same weights and the caller's RNG is untouched.
3. `make_tiny_model` (also `python -m tiller.models.tiny --out DIR --n-params 30e6`) does both and
   saves them with `save_pretrained` (safetensors) into one directory, written atomically (temp dir
   then rename); `AutoTokenizer` / `AutoModelForCausalLM.from_pretrained` load it like any hub model.

Shapes chosen by `build_model` (vocab 512, Qwen2; Llama differs only by the q/k/v biases;
`python -m tiller.models.tiny` prints this table):

    n_params  hidden  layers  heads  kv  intermediate  actual
         1M     160       3      5   5           480  1.08M
         2M     192       4      6   6           576  2.02M
         5M     192      10      6   6           576  4.90M
        10M     384       5      6   6          1152  9.79M
        30M     512      10      8   2          1536  30.43M
        60M     640      13     10   2          1920  61.06M
       100M     768      15     12   3          2304  102.18M
       150M     832      19     13   3          2496  151.23M

Deviations from real Qwen2 / Llama checkpoints: MLP width is 3 x hidden (real models use 2.7-5.4 x),
head dim is 32 up to hidden 256 and 64 above, no grouped-query attention below 8 heads.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from tiller.errors import UserError
from tiller.models.checkpoint import save_pretrained_atomic

PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END, ENDOFTEXT]

# ChatML, as Qwen2 uses it. `{% generation %}` marks what the assistant wrote (for SFT loss masks).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

ARCHS = ("qwen2", "llama")

_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A farmer has some apples and gives half of them to his neighbour.",
    "Tom bought three books for twelve dollars each. How much did he spend?",
    "She walks to school every morning and takes the bus home.",
    "Please answer the question and put the final answer after ####.",
    "Let's think step by step.",
    "The answer is the sum of the two numbers.",
    "There are seven days in a week and twelve months in a year.",
    "If a train travels sixty miles in one hour, how far does it go in three hours?",
    "You are a helpful assistant. Answer briefly and correctly.",
    "Count the letters in the word and report the number.",
    "The store sells pencils in boxes of ten, and each box costs four dollars.",
    "Maria has twice as many marbles as Sam, who has eight marbles.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "Reverse the list, then sort it from the smallest to the largest number.",
    "What is the product of these numbers? Show your work.",
    "The model reads the prompt, writes a response, and receives a reward.",
    "He saved five dollars every week for a whole year.",
    "Each student gets three pencils, two erasers and one ruler.",
    "The garden is a rectangle, nine metres long and four metres wide.",
    "Subtract the smaller number from the larger one.",
    "Yes, that is correct. No, that is not right. Maybe try again.",
    "The cat sat on the mat while the dog slept by the door.",
    "Multiply the price by the quantity to get the total cost.",
]


def builtin_corpus(n_arithmetic: int = 1500, seed: int = 0) -> list[str]:
    """A small deterministic corpus: English sentences, chat turns and arithmetic with answers."""
    rng = random.Random(seed)
    lines = list(_SENTENCES) * 4
    ops = [("+", lambda a, b: a + b), ("-", lambda a, b: a - b), ("*", lambda a, b: a * b)]
    for _ in range(n_arithmetic):
        a, b = rng.randint(0, 999), rng.randint(0, 99)
        sym, fn = rng.choice(ops)
        form = rng.randrange(4)
        if form == 0:
            lines.append(f"{a} {sym} {b} = {fn(a, b)}")
        elif form == 1:
            lines.append(f"What is {a} {sym} {b}? The answer is {fn(a, b)}.")
        elif form == 2:
            lines.append(f"Question: compute {a}{sym}{b}.\nAnswer: {fn(a, b)}\n#### {fn(a, b)}")
        else:
            lines.append(f"user: {a} {sym} {b}\nassistant: {fn(a, b)}")
    return lines


def train_tokenizer(
    corpus: Iterable[str] | None = None,
    alphabet: str | Sequence[str] | None = None,
    vocab_size: int = 512,
    min_frequency: int = 2,
    model_max_length: int = 2048,
):
    """Train a byte-level BPE tokenizer and wrap it as a `PreTrainedTokenizerFast`.

    corpus: lines of text to learn merges from; None with no alphabet uses `builtin_corpus()`.
    alphabet: characters that must each be one token. With no corpus this gives a character-level
        tokenizer (bytes + the alphabet's multi-byte characters, no other merges).
    vocab_size: upper bound; at least 256 bytes + 4 special tokens are always present.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    lines: list[str] = []
    if corpus is not None:
        lines = [str(line) for line in corpus]
    elif alphabet is None:
        lines = builtin_corpus()
    if alphabet is not None:
        # Each character as its own "word": merges are learned inside words only, so this adds the
        # merges that make a multi-byte character one token and nothing across characters.
        chars = [c for c in dict.fromkeys("".join(alphabet)) if c.strip()]
        lines = lines + chars * max(min_frequency, 1)
        if corpus is None:
            vocab_size = max(vocab_size, 256 + len(SPECIAL_TOKENS) + 4 * len(chars))
            min_frequency = 1
    if not lines:
        raise UserError("train_tokenizer: the corpus is empty; pass text lines or an alphabet")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        unk_token=None,
        additional_special_tokens=[IM_START, ENDOFTEXT],
        padding_side="left",
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def _candidate_shapes() -> list[tuple[int, int]]:
    """(hidden, layers) pairs with a sensible width/depth ratio (hidden / layers in 16..96)."""
    hiddens = list(range(64, 257, 32)) + list(range(320, 1281, 64))
    return [(h, n) for h in hiddens for n in range(2, 33) if 16 <= h / n <= 96]


def _shape(hidden: int, layers: int) -> dict:
    head_dim = 32 if hidden <= 256 else 64
    heads = hidden // head_dim
    # grouped-query attention from 8 heads up: the largest divisor of `heads` not above heads // 4
    kv_heads = heads if heads < 8 else max(d for d in range(1, heads // 4 + 1) if heads % d == 0)
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, intermediate_size=3 * hidden, head_dim=head_dim)


def count_params(shape: dict, vocab_size: int, arch: str = "qwen2") -> int:
    """Exact parameter count of a tied-embedding Qwen2 / Llama model with this shape.

    Per layer: q, o: h*(heads*d); k, v: h*(kv*d); Qwen2 adds q/k/v biases; MLP (gate, up, down):
    3*h*i; two RMSNorm weights 2*h. Plus embedding V*h (tied with the LM head) and a final norm h.
    """
    h, i = shape["hidden_size"], shape["intermediate_size"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    attn = 2 * h * q + 2 * h * kv + ((q + 2 * kv) if arch == "qwen2" else 0)
    per_layer = attn + 3 * h * i + 2 * h
    return vocab_size * h + shape["num_hidden_layers"] * per_layer + h


def choose_shape(n_params: int, vocab_size: int, arch: str = "qwen2") -> dict:
    """Shape whose parameter count is closest (in log ratio) to `n_params`, preferring hidden/layers ~ 48."""
    if n_params <= 0:
        raise UserError(f"n_params must be positive, got {n_params}")

    def score(hl):
        p = count_params(_shape(*hl), vocab_size, arch)
        return abs(math.log(p / n_params)) + 0.05 * abs(math.log(hl[0] / hl[1] / 48))

    return _shape(*min(_candidate_shapes(), key=score))


def shape_table(vocab_size: int = 512, arch: str = "qwen2",
                sizes: Sequence[float] = (1e6, 2e6, 5e6, 10e6, 30e6, 60e6, 100e6, 150e6)) -> str:
    rows = ["n_params  hidden  layers  heads  kv  intermediate  actual"]
    for n in sizes:
        s = choose_shape(int(n), vocab_size, arch)
        rows.append(f"{n / 1e6:>6.0f}M  {s['hidden_size']:>6}  {s['num_hidden_layers']:>6}  "
                    f"{s['num_attention_heads']:>5}  {s['num_key_value_heads']:>2}  "
                    f"{s['intermediate_size']:>12}  {count_params(s, vocab_size, arch) / 1e6:.2f}M")
    return "\n".join(rows)


def build_config(tokenizer, arch: str = "qwen2", n_params: int | None = None, hidden_size: int | None = None,
                 num_layers: int | None = None, max_position_embeddings: int = 2048, **overrides):
    """A transformers `Qwen2Config` / `LlamaConfig` sized for `tokenizer` (vocab = len(tokenizer))."""
    from transformers import LlamaConfig, Qwen2Config

    if arch not in ARCHS:
        raise UserError(f"unknown tiny-model arch {arch!r}; valid: {', '.join(ARCHS)}")
    vocab = len(tokenizer)
    if hidden_size is not None or num_layers is not None:
        shape = _shape(hidden_size or 128, num_layers or 2)
    else:
        shape = choose_shape(int(n_params or 1_000_000), vocab, arch)
    ids = dict(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT)
        if ENDOFTEXT in tokenizer.get_vocab() else tokenizer.bos_token_id,
    )
    kwargs = dict(vocab_size=vocab, tie_word_embeddings=True, max_position_embeddings=max_position_embeddings,
                  rms_norm_eps=1e-6, **shape, **ids)
    kwargs.update(overrides)
    if arch == "qwen2":
        return Qwen2Config(use_sliding_window=False, **kwargs)
    return LlamaConfig(attention_bias=False, mlp_bias=False, **kwargs)


def build_model(tokenizer, arch: str = "qwen2", n_params: int | None = None, hidden_size: int | None = None,
                num_layers: int | None = None, seed: int = 0, **config_overrides):
    """Randomly initialised causal LM for `tokenizer`; the same seed gives the same weights.

    Give either `n_params` (a shape is chosen, see `choose_shape`) or `hidden_size` / `num_layers`.
    The caller's torch RNG state is left untouched.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = build_config(tokenizer, arch, n_params, hidden_size, num_layers, **config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        pad_token_id=config.pad_token_id, eos_token_id=config.eos_token_id, bos_token_id=config.bos_token_id,
    )
    return model.eval()


def make_tiny_model(out_dir: str | os.PathLike, arch: str = "qwen2", n_params: int | None = 1_000_000,
                    corpus: Iterable[str] | None = None, alphabet: str | None = None, vocab_size: int = 512,
                    seed: int = 0, hidden_size: int | None = None, num_layers: int | None = None) -> Path:
    """Train a tokenizer, build a model and save both to `out_dir` atomically; returns the path."""
    out = Path(out_dir)
    tokenizer = train_tokenizer(corpus=corpus, alphabet=alphabet, vocab_size=vocab_size)
    model = build_model(tokenizer, arch, n_params=n_params, hidden_size=hidden_size,
                        num_layers=num_layers, seed=seed)
    return save_pretrained_atomic(out, model, tokenizer)


CLS_TOKEN, SEP_TOKEN = "[CLS]", "[SEP]"


def build_encoder_classifier(tokenizer, hidden_size: int = 64, num_layers: int = 2, num_labels: int = 2,
                             max_position_embeddings: int = 512, seed: int = 0):
    """A randomly initialised BERT sequence classifier for `tokenizer` (a cross-encoder for pair classifiers).

    Adds `[CLS]` / `[SEP]` to the tokenizer when it lacks cls / sep tokens (a tokenizer from `train_tokenizer`
    does), so resize-free: build the model after this call. Heads of 16 dims, MLP 4 x hidden (BERT's ratio);
    hidden 64 x 2 layers with a 512 vocab is ~0.17M parameters. No dropout (BERT has 0.1): a model this small
    underfits rather than overfits. Same seed, same weights; the caller's RNG is kept.
    """
    from transformers import BertConfig, BertForSequenceClassification

    extra = {k: v for k, v in (("cls_token", CLS_TOKEN), ("sep_token", SEP_TOKEN))
             if getattr(tokenizer, k) is None}
    if extra:
        tokenizer.add_special_tokens(extra)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
                        num_attention_heads=max(1, hidden_size // 16), intermediate_size=4 * hidden_size,
                        max_position_embeddings=max_position_embeddings, type_vocab_size=2, num_labels=num_labels,
                        pad_token_id=tokenizer.pad_token_id, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = BertForSequenceClassification(config)
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    """`python -m tiller.models.tiny [--out DIR --arch qwen2 --n-params 30e6]`: build a model, or print shapes."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tiller.models.tiny", description=(
        "Build a tiny random-init causal LM + byte-level BPE tokenizer (built-in corpus) into --out; "
        "without --out, print the shape table."))
    parser.add_argument("--out", help="output directory (Hugging Face format)")
    parser.add_argument("--arch", default="qwen2", choices=ARCHS)
    parser.add_argument("--n-params", type=float, default=1e6, help="target parameter count, e.g. 30e6")
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--corpus", help="text file to train the tokenizer on (one line per example)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.out:
        print(shape_table(args.vocab_size, args.arch))
        return 0
    corpus = None
    if args.corpus:
        if not os.path.exists(args.corpus):
            raise UserError(f"--corpus file not found: {args.corpus}")
        corpus = Path(args.corpus).read_text().splitlines()
    path = make_tiny_model(args.out, args.arch, int(args.n_params), corpus=corpus, vocab_size=args.vocab_size,
                           seed=args.seed)
    n = count_params(choose_shape(int(args.n_params), args.vocab_size, args.arch), args.vocab_size, args.arch)
    print(f"wrote {args.arch} model ({n / 1e6:.2f}M parameters) to {path}")
    return 0


if __name__ == "__main__":
    from tiller.entry import run_main

    run_main(main)
