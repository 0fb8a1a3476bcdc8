"""Tiny-model kit: tokenizer round trips, shapes and parameter counts, determinism, save -> load -> generate."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiller.errors import UserError
from tiller.models import load_causal_lm, load_tokenizer
from tiller.models.tiny import (
    CHAT_TEMPLATE, build_model, choose_shape, count_params, make_tiny_model, train_tokenizer,
)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def test_tokenizer_reload_round_trips_text_and_settings(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tok.pad_token == "<|pad|>" and tok.eos_token == "<|im_end|>"
    assert tok.padding_side == "left"
    assert tok.chat_template == CHAT_TEMPLATE
    for text in ["What is 123 + 45? The answer is 168.", "  two  spaces\nnew line\t tab", "naïve café ×÷ 日本"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    # special tokens are single ids and survive decode
    ids = tok("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids[-1] == tok.eos_token_id


def test_digits_are_single_tokens(tokenizer):
    ids = tokenizer("12345", add_special_tokens=False)["input_ids"]
    assert len(ids) == 5
    assert [tokenizer.decode([i]) for i in ids] == list("12345")


def test_left_padding_and_chat_template(tokenizer):
    batch = tokenizer(["1 + 1 =", "What is 12 + 34?"], padding=True, return_tensors="pt")
    short = batch["attention_mask"][0]
    assert short[0] == 0 and short[-1] == 1  # left padded
    assert batch["input_ids"][0, 0] == tokenizer.pad_token_id
    msgs = [{"role": "user", "content": "2+2?"}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    out = tokenizer.apply_chat_template(msgs + [{"role": "assistant", "content": "4"}], tokenize=True,
                                        return_dict=True, return_assistant_tokens_mask=True)
    masked = [i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tokenizer.decode(masked) == "4<|im_end|>"  # the assistant's text and its stop token only


def test_alphabet_tokenizer_is_character_level():
    tok = train_tokenizer(alphabet="0123456789+-×= ")
    # 256 bytes + 4 specials + one merge for the 2-byte "×"
    assert len(tok) == 261
    ids = tok("12×3=36", add_special_tokens=False)["input_ids"]
    assert len(ids) == 7 and tok.decode(ids) == "12×3=36"


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_count_params_is_exact(tokenizer, arch):
    model = build_model(tokenizer, arch, hidden_size=64, num_layers=2)
    shape = choose_shape(1, len(tokenizer))  # just to exercise it; not used below
    assert shape["hidden_size"] >= 64
    expected = count_params(dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                 intermediate_size=192, head_dim=32), len(tokenizer), arch)
    assert sum(p.numel() for p in model.parameters()) == expected
    # worked check for qwen2, V=512, h=64, 2 layers, i=192:
    # per layer = q,o 2*64*64 + k,v 2*64*64 + biases 3*64 + mlp 3*64*192 + norms 2*64
    #           = 16,384 + 192 + 36,864 + 128 = 53,568
    # total = 512*64 + 2*53,568 + 64 = 139,968 (llama has no q/k/v biases: minus 2*192 = 139,584)
    assert expected == (139_968 if arch == "qwen2" else 139_584)


@pytest.mark.parametrize("target", [1_000_000, 30_000_000, 150_000_000])
def test_choose_shape_lands_near_target(target):
    actual = count_params(choose_shape(target, 512), 512)
    assert 0.85 * target <= actual <= 1.15 * target


def test_build_is_deterministic_and_leaves_global_rng(tokenizer):
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_model(tokenizer, n_params=300_000, seed=7)
    after = torch.rand(1)
    assert torch.equal(before, after)  # caller's RNG stream untouched
    b = build_model(tokenizer, n_params=300_000, seed=7)
    c = build_model(tokenizer, n_params=300_000, seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    assert a.config.tie_word_embeddings and a.lm_head.weight.data_ptr() == a.model.embed_tokens.weight.data_ptr()
    assert a.config.vocab_size == len(tokenizer)
    assert a.config.pad_token_id == tokenizer.pad_token_id and a.config.eos_token_id == tokenizer.eos_token_id


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_llama_dir"])
def test_fixture_loads_and_generates(fixture, request):
    path = request.getfixturevalue(fixture)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    assert 500_000 <= n <= 1_500_000
    assert model.config.model_type == ("qwen2" if fixture == "tiny_model_dir" else "llama")
    batch = tok(["1 + 1 =", "What is 12 + 34? The answer is"], padding=True, return_tensors="pt")
    prompt_len = batch["input_ids"].shape[1]
    out = model.generate(**batch, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert out.shape == (2, prompt_len + 5)
    # left padding must not change a row's greedy continuation
    single = tok(["1 + 1 ="], return_tensors="pt")
    alone = model.generate(**single, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert out[0, prompt_len:].tolist() == alone[0, single["input_ids"].shape[1]:].tolist()


def test_make_tiny_model_round_trip_same_logits(tmp_path, tokenizer):
    path = make_tiny_model(tmp_path / "m", arch="llama", n_params=200_000, seed=3)
    assert (path / "model.safetensors").exists() and (path / "tokenizer.json").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # no temp dir left behind
    rebuilt = build_model(AutoTokenizer.from_pretrained(path), "llama", n_params=200_000, seed=3)
    loaded = load_causal_lm(path)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(rebuilt(ids).logits, loaded(ids).logits)
    assert load_causal_lm(path, dtype="bf16").dtype == torch.bfloat16


def test_loading_errors_name_the_problem(tmp_path, tiny_model_dir):
    missing = tmp_path / "nope"
    with pytest.raises(UserError, match="nope"):
        load_causal_lm(missing)
    with pytest.raises(UserError, match="nope"):
        load_tokenizer(str(missing))
    with pytest.raises(UserError, match="float64"):
        load_causal_lm(tiny_model_dir, dtype="float64")
    assert load_tokenizer(tiny_model_dir, padding_side="right").padding_side == "right"
    with pytest.raises(UserError, match="arch"):
        build_model(train_tokenizer(alphabet="ab"), arch="gpt9")


def test_module_cli_builds_model_and_rejects_missing_corpus(tmp_path, capsys):
    from tiller.models.tiny import main

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"{a} + {a} = {2 * a}" for a in range(200)))
    assert main(["--out", str(tmp_path / "m"), "--arch", "llama", "--n-params", "2e5", "--corpus", str(corpus)]) == 0
    assert "llama model" in capsys.readouterr().out
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "m").config.model_type == "llama"
    with pytest.raises(UserError, match="nope.txt"):
        main(["--out", str(tmp_path / "x"), "--corpus", str(tmp_path / "nope.txt")])


@pytest.mark.parametrize("n_params", [1e6, 30e6, 60e6, 100e6, 120e6, 150e6])
def test_chosen_shapes_have_valid_grouped_query_attention(n_params):
    from tiller.models.tiny import choose_shape

    # 120M once picked 13 heads over 3 kv heads, which no attention implementation can split
    s = choose_shape(int(n_params), 512)
    assert s["num_attention_heads"] % s["num_key_value_heads"] == 0
    assert s["num_attention_heads"] * s["head_dim"] == s["hidden_size"]
