"""`tiller serve` on a tiny VLM: the official `openai` client sends a chat with a data-URL image and gets the
engine's greedy answer for the same prompt and pixels; remote URLs, bad data URLs and images sent to a text
model are 400s naming the part."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from PIL import Image

from tests.serving import served_model, serving

openai = pytest.importorskip("openai")


def _data_url(color, size=(64, 48)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _chat(url, text="how many red squares?"):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def _served(model_dir, *flags):
    return served_model(model_dir, "--max-model-len", "512", *flags)


@pytest.fixture(scope="module", params=["tiny_vlm_dir", "tiny_glm4v_dir", "tiny_glm4v_moe_dir"],
                ids=["qwen2_vl", "glm4v", "glm4v_moe"])
def live(request):
    """(openai client, served, model dir) of a uvicorn server on 127.0.0.1 serving the tiny Qwen2-VL, GLM-4.1V or
    GLM-4.5V (native engine)."""
    model_dir = request.getfixturevalue(request.param)
    served = _served(model_dir)
    with serving(served) as port, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                                max_retries=0, timeout=60) as client:
        yield client, served, model_dir


def _engine_greedy(served, messages, color, steps):
    """The same chat through the processor and the engine directly: (token ids, logprobs, prompt length)."""
    from tiller.models.vision import encode_image_prompt
    from tiller.rollout import SamplingParams

    parts = [{"type": "image"}, {"type": "text", "text": messages[0]["content"][1]["text"]}]
    text = served.tokenizer.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                                tokenize=False)
    enc = encode_image_prompt(served.processor, text, [Image.new("RGB", (64, 48), color)])
    out = served.batcher.engine.generate([enc.prompt_ids], SamplingParams(max_new_tokens=steps, do_sample=False),
                                         multi_modal=[{"pixel_values": enc.pixel_values,
                                                       "image_grid_thw": enc.image_grid_thw}])
    return out.response_ids[0], out.logprobs[0], len(enc.prompt_ids)


def test_a_data_url_image_gets_the_engines_greedy_answer(live):
    client, served, model_dir = live
    messages = _chat(_data_url((255, 0, 0)))
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                           logprobs=True, extra_body={"return_tokens_as_token_ids": True})
    ids, logprobs, prompt_len = _engine_greedy(served, messages, (255, 0, 0), 6)
    (choice,) = reply.choices
    assert [int(e.token.split(":")[1]) for e in choice.logprobs.content] == ids
    assert choice.message.content == served.tokenizer.decode(ids, skip_special_tokens=True)
    torch.testing.assert_close(torch.tensor([e.logprob for e in choice.logprobs.content]), torch.tensor(logprobs),
                               atol=1e-5, rtol=0)
    assert reply.usage.prompt_tokens == prompt_len
    if model_dir.name == "qwen2vl":
        assert prompt_len == 42  # 20 image tokens (8 x 10 patches, 2 x 2 merged) + 22 text
    blue = client.chat.completions.create(model="tiny", messages=_chat(_data_url((0, 0, 255))), max_tokens=1,
                                          temperature=0, logprobs=True)
    assert abs(blue.choices[0].logprobs.content[0].logprob - logprobs[0]) > 1e-4  # the pixels reached the model


def test_remote_and_bad_image_urls_are_400s_naming_the_part(live):
    client, _, _ = live
    cases = [("https://example.com/cat.png", "messages[0].content[0].image_url: remote image URLs are not fetched: "
                                             "send a data: URL"),
             ("data:image/png;base64,@@@not-base64", "messages[0].content[0].image_url: the data: URL's payload is "
                                                     "not valid base64"),
             ("data:image/png;base64," + base64.b64encode(b"not an image").decode(),
              "messages[0].content[0].image_url: unreadable image"),
             ("data:text/plain,hello", "messages[0].content[0].image_url: not a base64 data: URL")]
    for url, message in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", messages=_chat(url), max_tokens=2)
        assert message in err.value.body["message"], url
        assert err.value.body["param"] == "messages[0].content[0].image_url"


def test_the_hf_engine_serves_images_too(live):
    """The micro-batcher passes the pixels to the hf engine: the same greedy tokens as the native server."""
    from fastapi.testclient import TestClient

    from tiller.serve.app import create_app

    _, native, model_dir = live
    messages = _chat(_data_url((0, 200, 0)))
    with TestClient(create_app(_served(model_dir, "--engine", "hf"))) as http:
        body = http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 5,
                                                        "temperature": 0, "logprobs": True,
                                                        "return_tokens_as_token_ids": True}).json()
    ids, _, _ = _engine_greedy(native, messages, (0, 200, 0), 5)
    assert [int(e["token"].split(":")[1]) for e in body["choices"][0]["logprobs"]["content"]] == ids


def test_an_image_sent_to_a_text_model_is_a_400(tiny_model_dir):
    from fastapi.testclient import TestClient

    from tiller.serve.app import create_app

    with TestClient(create_app(_served(tiny_model_dir))) as http:
        reply = http.post("/v1/chat/completions", json={"model": "tiny", "messages": _chat(_data_url((1, 2, 3))),
                                                         "max_tokens": 2})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["message"] == ("messages[0].content[0]: image_url parts need a vision-language model; this model "
                                "takes text only")
    assert error["param"] == "messages[0].content[0]"
