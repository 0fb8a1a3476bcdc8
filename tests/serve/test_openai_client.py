"""`tiller serve` driven by the official `openai` client (sync and async) on a loopback port, tiny model.

Log-probs are checked against a teacher-forced forward of the same model (the sampled ids come back exactly
through vLLM's `return_tokens_as_token_ids` extension); `seed`, `n`, `stop`, `logit_bias` are exact;
`response_format` json_object / json_schema replies parse and follow the schema, with the logprobs of the masked
distribution; what tiller cannot honour is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from tests.serving import served_model, serving

openai = pytest.importorskip("openai")

CHAT = [{"role": "user", "content": "2+3="}]


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    """(base_url, served) of a uvicorn server on 127.0.0.1."""
    served = served_model(tiny_model_dir, "--max-model-len", "2048")
    with serving(served) as port:
        yield f"http://127.0.0.1:{port}/v1", served


@pytest.fixture(scope="module")
def client(live):
    with openai.OpenAI(base_url=live[0], api_key="none", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """log_softmax of a teacher-forced fp32 forward: ids -> [len(ids), V]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()

    def logp(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logp


def _ids(entries) -> list[int]:
    return [int(e.split(":")[1]) for e in entries]


def _chat_prompt(served) -> list[int]:
    tok = served.tokenizer
    return served.encode_text(tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False))


def test_chat_logprobs_and_top_logprobs_match_a_teacher_forced_forward(client, live, reference):
    _, served = live
    resp = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=1.0, seed=3,
                                          logprobs=True, top_logprobs=20,
                                          extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == 8 == resp.usage.completion_tokens
    prompt, sampled = _chat_prompt(served), _ids(e.token for e in content)
    ref = reference(prompt + sampled)[len(prompt) - 1 : -1]  # the distribution each sampled token came from
    for t, (entry, tok) in enumerate(zip(content, sampled)):
        assert entry.logprob == pytest.approx(ref[t, tok].item(), abs=1e-4)
        assert len(entry.top_logprobs) == 20
        top = torch.topk(ref[t], 20)
        assert [e.logprob for e in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert set(_ids(e.token for e in entry.top_logprobs)) == set(top.indices.tolist())  # ties may reorder


def test_completion_logprobs_k_match_a_teacher_forced_forward(client, live, reference):
    _, served = live
    resp = client.completions.create(model="tiny", prompt="1+2=", max_tokens=6, temperature=1.0, logprobs=3,
                                     extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    lp = resp.choices[0].logprobs
    prompt, sampled = served.encode_text("1+2="), _ids(lp.tokens)
    ref = reference(prompt + sampled)[len(prompt) - 1 : -1]
    assert lp.token_logprobs == pytest.approx([ref[t, k].item() for t, k in enumerate(sampled)], abs=1e-4)
    for t, top in enumerate(lp.top_logprobs):
        want = torch.topk(ref[t], 3)
        assert sorted(top.values(), reverse=True) == pytest.approx(want.values.tolist(), abs=1e-4)


def test_logit_bias_is_exact(client, live, reference):
    """+100 on one token makes greedy decoding pick it every step; the reported logprob is of the biased
    distribution: log_softmax(logits + bias)[token]."""
    _, served = live
    token = 77
    resp = client.completions.create(model="tiny", prompt="1+2=", max_tokens=4, temperature=0, logprobs=1,
                                     logit_bias={str(token): 100},
                                     extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert _ids(lp.tokens) == [token] * 4
    prompt = served.encode_text("1+2=")
    logits = reference(prompt + [token] * 4)[len(prompt) - 1 : -1]  # log_softmax = logits up to a row constant
    biased = logits.clone()
    biased[:, token] += 100
    want = torch.log_softmax(biased, dim=-1)[:, token]
    assert lp.token_logprobs == pytest.approx(want.tolist(), abs=1e-4)


def test_n_seed_and_stop(client):
    kw = dict(model="tiny", messages=CHAT, max_tokens=10, temperature=1.0, n=3, seed=11)
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert len(a.choices) == 3 and [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    other = client.chat.completions.create(**{**kw, "seed": 12})
    assert [c.message.content for c in other.choices] != [c.message.content for c in a.choices]
    free = client.completions.create(model="tiny", prompt="The quick", max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = free[2:4]
    cut = client.completions.create(model="tiny", prompt="The quick", max_tokens=10, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.text == free[: free.find(stop)] and cut.finish_reason == "stop"


def test_seeded_request_gives_the_same_tokens_alone_and_under_load(live):
    """Seeded rows batch with others (continuous batching) and draw from their own generator."""
    base_url, served = live
    seeded = dict(model="tiny", messages=CHAT, max_tokens=24, temperature=1.0, seed=5, logprobs=True,
                  extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})

    async def run():
        async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=60) as ac:
            alone = await ac.chat.completions.create(**seeded)
            before = dict(served.batcher.stats)
            noise = [ac.completions.create(model="tiny", prompt=p, max_tokens=8 + i, temperature=0.8,
                                           extra_body={"ignore_eos": True})
                     for i, p in enumerate(["1+1=", "hello there", "7*8", "a", "The quick brown fox"] * 2)]
            loaded = await asyncio.gather(*noise[:5], ac.chat.completions.create(**seeded), *noise[5:])
            return alone, loaded[5], dict(served.batcher.stats), before

    alone, loaded, after, before = asyncio.run(run())
    ids = [[e.token for e in r.choices[0].logprobs.content] for r in (alone, loaded)]
    assert ids[0] == ids[1]
    assert after["peak_rows"] > 1 and after["steps"] - before["steps"] < after["tokens"] - before["tokens"]


def test_unsupported_fields_and_bad_response_formats_are_refused(client):
    for kwargs, param in (({"response_format": {"type": "xml"}}, "response_format"),
                          ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                       "schema": {"type": "objectx"}}}},
                           "response_format.json_schema"),
                          ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
                           "response_format.json_schema.name"),
                          ({"presence_penalty": 2.5}, "presence_penalty"),
                          ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, **kwargs)
        assert err.value.body["param"].startswith(param), err.value.body
    text = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, response_format={"type": "text"})
    assert text.choices[0].message.role == "assistant"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}})
    assert err.value.body["param"] == "response_format.json_schema" and "nowhere" in err.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=CHAT, max_tokens=2)


def test_streaming_with_usage(client):
    full = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0)
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_tool_calls_parsed_for_the_client(client, live, monkeypatch):
    """A scripted engine emits a Hermes tool call; the client sees `message.tool_calls` and can answer it."""
    from tiller.rollout import RolloutOutput
    from tiller.serve.batcher import MicroBatcher

    _, served = live
    text = ('<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>')
    prompts = []

    class Scripted:
        def generate(self, prompt_ids, sampling):
            prompts.append(served.tokenizer.decode(prompt_ids[0]))
            ids = served.tokenizer(text, add_special_tokens=False)["input_ids"]
            return RolloutOutput([prompt_ids[0]], [ids], [[0.0] * len(ids)], ["stop"])

    scripted = MicroBatcher(Scripted(), max_wait_s=0.0)
    monkeypatch.setattr(served, "batcher", scripted)
    tools = [{"type": "function", "function": {"name": "calculator", "description": "arithmetic",
                                               "parameters": {"type": "object",
                                                              "properties": {"expression": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "6*7?"}]
    resp = client.chat.completions.create(model="tiny", messages=msgs, tools=tools, max_tokens=8)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [json.loads(c.function.arguments) for c in choice.message.tool_calls] == [{"expression": "6*7"},
                                                                                     {"expression": "1+1"}]
    one = client.chat.completions.create(model="tiny", messages=msgs, tools=tools, max_tokens=8,
                                         parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    follow = msgs + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    client.chat.completions.create(model="tiny", messages=follow, tools=tools, max_tokens=8)
    assert "42" in prompts[-1] and '"expression": "6*7"' in prompts[-1]  # the tool result reached the prompt
    scripted.close()


def test_qwen35_xml_tool_calls_with_tool_call_parser(client, live, monkeypatch):
    """`tiller serve --tool-call-parser qwen3_coder` (vLLM's flag): Qwen3-Coder / Qwen3.5's XML calls become
    `tool_calls` with the schema's types, the text before them the content."""
    from tiller.rollout import RolloutOutput
    from tiller.serve.batcher import MicroBatcher
    from tiller.serve.cli import _parser

    _, served = live
    text = ("Let me compute.\n<tool_call>\n<function=calculator>\n<parameter=expression>\n6*7\n</parameter>\n"
            "<parameter=digits>\n3\n</parameter>\n</function>\n</tool_call>")

    class Scripted:
        def generate(self, prompt_ids, sampling):
            ids = served.tokenizer(text, add_special_tokens=False)["input_ids"]
            return RolloutOutput([prompt_ids[0]], [ids], [[0.0] * len(ids)], ["stop"])

    scripted = MicroBatcher(Scripted(), max_wait_s=0.0)
    monkeypatch.setattr(served, "batcher", scripted)
    monkeypatch.setattr(served, "tool_call_parser", _parser().parse_args(
        ["DIR", "--tool-call-parser", "qwen3_coder"]).tool_call_parser)
    tools = [{"type": "function", "function": {"name": "calculator", "description": "arithmetic", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}, "digits": {"type": "integer"}}}}}]
    resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "6*7?"}], tools=tools,
                                          max_tokens=8)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me compute."
    (call,) = choice.message.tool_calls
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "6*7",
                                                                                         "digits": 3}
    scripted.close()


# ------------------------------------------------------------------------------------ response_format
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "enum": ["x", "y"]}},
          "required": ["a", "b"], "additionalProperties": False}


def test_json_object_replies_parse_as_objects(client):
    """An untrained model under `json_object`: every choice ends with eos once its object is closed (seeds 4 and
    7 give empty objects and ones with long random keys and strings: 3 to ~800 tokens)."""
    sizes = []
    for seed in (4, 7):
        resp = client.chat.completions.create(model="tiny", messages=CHAT, n=3, seed=seed, max_tokens=1500,
                                              response_format={"type": "json_object"})
        for choice in resp.choices:
            assert choice.finish_reason == "stop"
            value = json.loads(choice.message.content)
            assert isinstance(value, dict)
            sizes.append(len(value))
    assert max(sizes) >= 1  # not only `{}`


def test_json_schema_replies_follow_it_with_masked_logprobs(client, live, reference):
    """Every choice is an object with exactly `a` (integer) and `b` ("x" or "y"); each reported logprob is the
    teacher-forced log_softmax over the tokens the grammar allowed at that step (replayed with a fresh matcher),
    so it is finite and the chosen token was allowed."""
    from tiller.rollout.constrained import GrammarCompiler, allowed_tokens

    _, served = live
    resp = client.chat.completions.create(
        model="tiny", messages=CHAT, n=3, seed=21, max_tokens=200, logprobs=True,
        response_format={"type": "json_schema", "json_schema": {"name": "ab", "schema": SCHEMA, "strict": True}},
        extra_body={"return_tokens_as_token_ids": True})
    grammar = GrammarCompiler(served.tokenizer, len(served.tokenizer)).json_schema(SCHEMA)
    prompt = _chat_prompt(served)
    for choice in resp.choices:
        value = json.loads(choice.message.content)
        assert choice.finish_reason == "stop" and set(value) == {"a", "b"}
        assert isinstance(value["a"], int) and value["b"] in ("x", "y")
        entries = choice.logprobs.content
        sampled = _ids(e.token for e in entries)
        assert sampled[-1] == served.tokenizer.eos_token_id
        ref = reference(prompt + sampled)[len(prompt) - 1 : -1]
        matcher = grammar.matcher()
        for t, (entry, tok) in enumerate(zip(entries, sampled)):
            allowed = allowed_tokens([(matcher, grammar)], ref.shape[-1])[0]
            assert allowed[tok]
            masked = torch.log_softmax(ref[t].masked_fill(~allowed, float("-inf")), dim=-1)
            assert entry.logprob == pytest.approx(masked[tok].item(), abs=1e-4)
            assert matcher.consume_token(tok)
    bounded = {**SCHEMA, "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": SCHEMA["properties"]["b"]}}
    greedy = client.chat.completions.create(
        model="tiny", messages=CHAT, temperature=0, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "ab", "schema": bounded}})
    value = json.loads(greedy.choices[0].message.content)
    assert greedy.choices[0].finish_reason == "stop" and 0 <= value["a"] <= 99 and value["b"] in ("x", "y")


def test_completions_and_streaming_take_response_format(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "ab", "schema": SCHEMA}}
    done = client.completions.create(model="tiny", prompt="JSON:", max_tokens=200, seed=3,
                                     extra_body={"response_format": fmt})
    value = json.loads(done.choices[0].text)
    assert done.choices[0].finish_reason == "stop" and set(value) == {"a", "b"}
    kw = dict(model="tiny", messages=CHAT, max_tokens=200, seed=5, response_format=fmt)
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    assert set(json.loads(full)) == {"a", "b"}


def test_response_format_needs_the_native_engine(tiny_model_dir):
    """`--engine hf` (micro-batching, no per-step masks) answers 400 naming `response_format`."""
    from fastapi.testclient import TestClient

    from tiller.serve.app import create_app
    from tiller.serve.cli import _parser, build_served_model

    served = build_served_model(_parser().parse_args([str(tiny_model_dir), "--dtype", "float32", "--engine", "hf",
                                                      "--served-model-name", "tiny", "--max-model-len", "256"]))
    try:
        with TestClient(create_app(served)) as http, \
                openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0) as hf:
            with pytest.raises(openai.BadRequestError) as err:
                hf.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4,
                                           response_format={"type": "json_object"})
            assert err.value.body["param"] == "response_format" and "native engine" in err.value.body["message"]
            assert hf.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2,
                                              response_format={"type": "text"}).choices[0].message.role == "assistant"
    finally:
        served.batcher.close()
