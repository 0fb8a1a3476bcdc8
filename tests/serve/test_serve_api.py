"""The OpenAI-compatible server against a real uvicorn on 127.0.0.1 (random free port), tiny model, httpx."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.serving import free_port, served_model, serving
from tiller.serve.protocol import ChatCompletionRequest


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    served = served_model(tiny_model_dir, "--max-model-len", "512", "--max-tokens", "8")
    with serving(served) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        yield client, served


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "2+3="}], "max_tokens": 6}


def test_models_and_health(server):
    client, _ = server
    assert client.get("/health").json() == {"status": "ok", "queue": 0}
    data = client.get("/v1/models").json()
    assert data["object"] == "list" and [m["id"] for m in data["data"]] == ["tiny"]
    assert data["data"][0]["max_model_len"] == 512


def test_chat_completion_greedy_matches_engine_and_counts_usage(server):
    client, served = server
    from tiller.rollout import SamplingParams

    body = client.post("/v1/chat/completions", json={**CHAT, "temperature": 0, "logprobs": True}).json()
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    # the same prompt through the engine directly: the server renders the chat template like the trainer
    tok = served.tokenizer
    prompt = tok(tok.apply_chat_template(CHAT["messages"], add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False)["input_ids"]
    ref = served.batcher.engine.generate([prompt], SamplingParams(max_new_tokens=6, do_sample=False))
    assert choice["message"]["content"] == tok.decode(ref.response_ids[0], skip_special_tokens=True)
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(ref.response_ids[0]),
                             "total_tokens": len(prompt) + len(ref.response_ids[0])}
    lps = choice["logprobs"]["content"]
    assert len(lps) == len(ref.response_ids[0])
    assert [e["logprob"] for e in lps] == pytest.approx(ref.logprobs[0], abs=1e-5)
    assert all(e["logprob"] <= 0 for e in lps)


def test_penalties_reach_the_engine(server):
    """OpenAI's presence / frequency penalties and vLLM's repetition_penalty: the reply is the engine's greedy answer
    under the same penalties (the kit's fresh model repeats one token; the penalties break that)."""
    client, served = server
    from tiller.rollout import SamplingParams

    pen = {"presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 2.0}
    body = client.post("/v1/chat/completions", json={**CHAT, "temperature": 0, "logprobs": True, **pen}).json()
    tok = served.tokenizer
    prompt = tok(tok.apply_chat_template(CHAT["messages"], add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False)["input_ids"]
    ref = served.batcher.engine.generate([prompt], SamplingParams(max_new_tokens=6, do_sample=False, **pen))
    plain = served.batcher.engine.generate([prompt], SamplingParams(max_new_tokens=6, do_sample=False))
    assert ref.response_ids != plain.response_ids
    (choice,) = body["choices"]
    assert choice["message"]["content"] == tok.decode(ref.response_ids[0], skip_special_tokens=True)
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == pytest.approx(ref.logprobs[0], abs=1e-5)


def test_a_regex_constrains_the_reply(server):
    """vLLM's structured_outputs.regex (and its older guided_regex): every choice's text matches the regex in full;
    a bad regex, a second constraint or another structured-outputs kind is a 400 naming the field."""
    import re

    client, _ = server
    for extra in ({"structured_outputs": {"regex": "[0-9]{1,2}-[a-c]"}}, {"guided_regex": "[0-9]{1,2}-[a-c]"}):
        body = client.post("/v1/chat/completions", json={**CHAT, "n": 3, "temperature": 1.0, "seed": 1,
                                                         "max_tokens": 8, **extra}).json()
        texts = [c["message"]["content"] for c in body["choices"]]
        assert all(re.fullmatch("[0-9]{1,2}-[a-c]", t) for t in texts), texts
        assert all(c["finish_reason"] == "stop" for c in body["choices"])
    text = client.post("/v1/completions", json={"model": "tiny", "prompt": "2+3=", "max_tokens": 8,
                                                 "guided_regex": "yes|no"}).json()["choices"][0]["text"]
    assert text in ("yes", "no")
    for extra, param in (({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex"),
                         ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex"),
                         ({"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs.choice"),
                         ({"guided_regex": "a+", "structured_outputs": {"regex": "b+"}}, "guided_regex")):
        resp = client.post("/v1/chat/completions", json={**CHAT, **extra})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_vllms_stop_token_ids_and_text_extensions(server):
    """stop_token_ids end a choice (its text left out, kept with include_stop_str_in_output), skip_special_tokens=false
    keeps special tokens in the text, min_tokens is refused; the ids are the engine's greedy ones."""
    from tiller.rollout import SamplingParams
    from tiller.serve.protocol import CompletionRequest

    client, served = server
    tok = served.tokenizer
    prompt = tok("2+3=", add_special_tokens=False)["input_ids"]
    free = served.batcher.engine.generate([prompt], SamplingParams(max_new_tokens=8, do_sample=False, ignore_eos=True))
    ids = free.response_ids[0]
    stop = ids[2]
    first = ids.index(stop)  # (the 3rd token, or an earlier copy of it)
    body = {"model": "tiny", "prompt": "2+3=", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "stop_token_ids": [stop]}
    out = client.post("/v1/completions", json=body).json()
    assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == first + 1
    assert out["choices"][0]["text"] == tok.decode(ids[:first], skip_special_tokens=True)
    kept = client.post("/v1/completions", json={**body, "include_stop_str_in_output": True}).json()
    assert kept["choices"][0]["text"] == tok.decode(ids[:first + 1], skip_special_tokens=True)
    special = [tok.convert_tokens_to_ids("<|im_end|>")]
    assert served.finish_text(special, ()) == "" and served.finish_text(
        special, (), CompletionRequest(prompt="x", skip_special_tokens=False)) == "<|im_end|>"
    for extra, param in (({"min_tokens": 2}, "min_tokens"), ({"stop_token_ids": [10 ** 6]}, "stop_token_ids")):
        resp = client.post("/v1/completions", json={**body, **extra})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_chat_template_kwargs_render_the_chat(server):
    """vLLM's chat_template_kwargs reach the chat template (over the server's own); vLLM's unsupported extensions set
    to their off values (use_beam_search=false) are accepted."""
    client, served = server
    tok = served.tokenizer
    original = tok.chat_template
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if shout %} LOUD{% endif %}{% if add_generation_prompt %}={% endif %}")
    try:
        chat = [{"role": "user", "content": "2+3"}]
        plain, _ = served.render_chat(ChatCompletionRequest(model="tiny", messages=chat))
        loud, _ = served.render_chat(ChatCompletionRequest(model="tiny", messages=chat,
                                                           chat_template_kwargs={"shout": True}))
    finally:
        tok.chat_template = original
    assert tok.decode(plain) == "2+3=" and tok.decode(loud) == "2+3 LOUD="
    assert client.post("/v1/chat/completions", json={**CHAT, "use_beam_search": False}).status_code == 200


def test_chat_n_seed_and_max_tokens(server):
    client, _ = server
    req = {**CHAT, "n": 3, "temperature": 1.0, "seed": 7, "max_tokens": 5}
    a = client.post("/v1/chat/completions", json=req).json()
    b = client.post("/v1/chat/completions", json=req).json()
    assert len(a["choices"]) == 3 and [c["index"] for c in a["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in a["choices"]] == [c["message"]["content"] for c in b["choices"]]
    assert a["usage"]["completion_tokens"] <= 15
    assert all(c["finish_reason"] in ("stop", "length") for c in a["choices"])


def test_completions_batch_prompt_list_logprobs_and_echo(server):
    client, _ = server
    body = client.post("/v1/completions", json={"model": "tiny", "prompt": ["1+1=", "hello"], "n": 2,
                                                "max_tokens": 4, "temperature": 0.8, "logprobs": 0}).json()
    assert body["object"] == "text_completion" and len(body["choices"]) == 4
    for c in body["choices"]:
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) <= 4
    echo = client.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": 3, "temperature": 0,
                                                "echo": True}).json()
    assert echo["choices"][0]["text"].startswith("1+1=")


def test_stop_string_is_cut_from_text(server):
    client, _ = server
    free = client.post("/v1/completions", json={"prompt": "The quick", "max_tokens": 8, "temperature": 0}).json()
    text = free["choices"][0]["text"]
    if len(text) < 3:
        pytest.skip("greedy text too short to pick a stop string")
    stop = text[1:3]
    cut = client.post("/v1/completions", json={"prompt": "The quick", "max_tokens": 8, "temperature": 0,
                                               "stop": stop}).json()["choices"][0]
    assert cut["text"] == text[:text.find(stop)] and cut["finish_reason"] == "stop"


def test_chat_streaming_sse_concatenates_to_the_full_answer(server):
    client, _ = server
    req = {**CHAT, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    full = client.post("/v1/chat/completions", json={**CHAT, "temperature": 0}).json()
    with client.stream("POST", "/v1/chat/completions", json=req) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == full["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"] == full["usage"]
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finals == [full["choices"][0]["finish_reason"]]


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1000}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 2.5}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 0}, "repetition_penalty"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),  # without logprobs
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ({"messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "objectx"}}}},
     "response_format.json_schema"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"999999": 5}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"3": 101}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "user", "content": "x"}], "guided_json": {"type": "object"}}, "guided_json"),
    ({"messages": [{"role": "user", "content": "x"}], "use_beam_search": True}, "use_beam_search"),
    ({"messages": [{"role": "user", "content": "x " * 600}]}, "messages"),
])
def test_bad_chat_requests_are_400_naming_the_field(server, body, param):
    client, _ = server
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"].startswith(param), err


def test_bad_completion_requests_and_unknown_model(server):
    client, _ = server
    assert client.post("/v1/completions", json={"prompt": ""}).status_code == 400
    assert client.post("/v1/completions", json={"prompt": [1, 10**9]}).status_code == 400
    assert client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
                       ).status_code == 400
    resp = client.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


def test_concurrent_requests_share_decode_steps(server):
    client, served = server
    from concurrent.futures import ThreadPoolExecutor

    assert served.continuous  # the native engine: continuous batching
    before = dict(served.batcher.stats)
    req = {"prompt": "1+2=", "max_tokens": 12, "temperature": 0.7, "ignore_eos": True}
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda _: client.post("/v1/completions", json=req).json(), range(6)))
    assert all(r["usage"]["completion_tokens"] == 12 for r in results)
    after = served.batcher.stats
    assert after["requests"] - before["requests"] == 6 and after["tokens"] - before["tokens"] == 72
    assert after["steps"] - before["steps"] < 72  # rows of different requests shared decode steps


@pytest.mark.slow  # a fresh python process imports torch + transformers: ~10-25 s on 2 busy cores
def test_tiller_serve_cli_subprocess(tiny_model_dir):
    """`tiller serve` as a user starts it: a real process, polled (bounded) until it answers."""
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tiller.cli", "serve", str(tiny_model_dir), "--port", str(port),
                             "--dtype", "float32", "--threads", "1", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):  # bounded: 60 s
            if proc.poll() is not None:
                break
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert proc.poll() is None, proc.stdout.read().decode()
        models = httpx.get(f"{url}/v1/models", timeout=10).json()
        assert models["data"][0]["id"] == tiny_model_dir.name
        body = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).json()
        assert body["usage"]["completion_tokens"] <= 3
    finally:
        proc.terminate()
        proc.wait(20)


def test_tiller_serve_cli_bad_model_dir_exits_2(tmp_path):
    from tiller.cli import main as cli

    assert cli(["serve", str(tmp_path / "missing")]) == 2


def test_tiller_serve_cli_refuses_native_only_flags_on_other_engines(tmp_path):
    from tiller.cli import main as cli

    assert cli(["serve", str(tmp_path), "--engine", "hf", "--prompt-cache-mb", "8"]) == 2
    assert cli(["serve", str(tmp_path), "--engine", "hf", "--compile"]) == 2
    assert cli(["serve", str(tmp_path), "--engine", "hf", "--enforce-eager"]) == 2
    assert cli(["serve", str(tmp_path), "--compile", "--enforce-eager"]) == 2
    assert cli(["serve", str(tmp_path), "--prompt-cache-mb", "-1"]) == 2


def test_tool_messages_render_and_tool_calls_are_parsed():
    from tiller.serve.tool_calls import extract_tool_calls, prepare_messages

    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    history = [{"role": "user", "content": "6*7?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'}}]},
               {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    # a template without tools / tool_calls support (the tiny kit's ChatML): system prompt + inline blocks
    msgs, passed = prepare_messages(history, tools, "{% for message in messages %}...{% endfor %}")
    assert passed is None and msgs[0]["role"] == "system" and '"name": "calculator"' in msgs[0]["content"]
    assert msgs[2]["content"] == '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
    # a Qwen2.5-style template: tools= and tool_calls with arguments as objects
    msgs, passed = prepare_messages(history, tools, "{% if tools %}...{% endif %} message.tool_calls")
    assert passed == tools and msgs[1]["tool_calls"][0]["function"]["arguments"] == {"expression": "6*7"}

    content, calls = extract_tool_calls('Let me compute. <tool_call>{"name": "calculator", "arguments": '
                                        '{"expression": "1+1"}}</tool_call>')
    assert content == "Let me compute."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "calculator", {"expression": "1+1"})]
    assert extract_tool_calls("<tool_call>oops</tool_call>") == ("<tool_call>oops</tool_call>", [])


def test_chat_with_tools_returns_tool_calls(server, monkeypatch):
    """The engine is scripted to emit a tool call; the server turns it into OpenAI `tool_calls`."""
    client, served = server
    from tiller.rollout import RolloutOutput

    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    seen = []

    class Scripted:
        def generate(self, prompt_ids, sampling):
            seen.append(served.tokenizer.decode(prompt_ids[0]))
            ids = served.tokenizer(call, add_special_tokens=False)["input_ids"]
            return RolloutOutput([prompt_ids[0]], [ids], [[0.0] * len(ids)], ["stop"])

    from tiller.serve.batcher import MicroBatcher

    scripted = MicroBatcher(Scripted(), max_wait_s=0.0)
    monkeypatch.setattr(served, "batcher", scripted)
    tools = [{"type": "function", "function": {"name": "calculator", "description": "math",
                                               "parameters": {"type": "object", "properties": {}}}}]
    body = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "6*7?"}],
                                                     "tools": tools, "max_tokens": 8}).json()
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (tc,) = choice["message"]["tool_calls"]
    assert tc["function"]["name"] == "calculator" and json.loads(tc["function"]["arguments"]) == {"expression": "6*7"}
    assert "<tools>" in seen[0] and '"name": "calculator"' in seen[0]  # schemas reached the prompt
    with client.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "6*7?"}],
                                                             "tools": tools, "max_tokens": 8, "stream": True}) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    streamed = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(streamed) == 1 and streamed[0][0]["function"]["name"] == "calculator"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(d.get("content") for d in deltas)
    plain = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "6*7?"}],
                                                      "tools": tools, "tool_choice": "none", "max_tokens": 8}).json()
    assert plain["choices"][0]["message"]["content"] == call
    forced = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "tools": tools,
                                                       "tool_choice": "required"})
    assert forced.status_code == 400 and forced.json()["error"]["param"] == "tool_choice"
    scripted.close()
