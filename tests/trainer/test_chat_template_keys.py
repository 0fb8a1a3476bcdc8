"""verl's chat-template keys: `data.apply_chat_template_kwargs` and `actor_rollout_ref.model.custom_chat_template`.

The prompt set (and its length filter), the RL step's rollout and validation, the checkpoint's tokenizer and
`tiller generate`'s prompts all render with them; bad values stop `tiller rl` with exit code 2 naming the key.
"""

from __future__ import annotations

import shutil

import pytest
import yaml

from tiller.config import load_config
from tiller.data.rl_dataset import build_rl_dataset, read_rows, write_rows
from tiller.evaluation.runner import load_prompt_rows
from tiller.models.loading import load_tokenizer
from tiller.models.tiny import CHAT_TEMPLATE
from tiller.tasks import arithmetic

# the tiny template, plus Qwen3's empty think block after the generation prompt when enable_thinking is False
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}")
# a template of a different shape, with a variable of its own
CUSTOM_TEMPLATE = ("{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
                   "{% if add_generation_prompt %}{% if style == 'terse' %}SHORT {% endif %}ANSWER:{% endif %}")


@pytest.fixture(scope="module")
def thinking_model(tiny_model_dir, tmp_path_factory):
    """A copy of the tiny model whose tokenizer's own template branches on enable_thinking."""
    out = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_model_dir, out)
    tok = load_tokenizer(out)
    tok.chat_template = THINKING_TEMPLATE
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("task")
    arithmetic.write_task(root, n_train=16, n_test=4, seed=0)
    return root


def _by_hand(tok, rows, template=None, **kwargs) -> list[list[int]]:
    """Each row's prompt rendered with the template (`apply_chat_template` called directly) and tokenized."""
    out = []
    for row in rows:
        messages = [dict(m) for m in row["prompt"]]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, chat_template=template,
                                       **kwargs)
        out.append(list(tok(text, add_special_tokens=False)["input_ids"]))
    return out


def test_kwargs_change_the_prompt_ids_and_what_the_length_filter_drops(thinking_model, tmp_path):
    tok = load_tokenizer(thinking_model)
    rows = [{"data_source": "x", "prompt": [{"role": "user", "content": " ".join(["7+8="] * k)}],
             "reward_model": {"ground_truth": "15"}} for k in (1, 2, 4, 8, 16, 32)]  # prompts of many lengths
    files = [str(write_rows(rows, tmp_path / "p.parquet"))]
    plain, no_think = _by_hand(tok, rows), _by_hand(tok, rows, enable_thinking=False)
    assert all(len(b) > len(a) for a, b in zip(plain, no_think))  # the kwarg changes every rendering
    limit = max(len(ids) for ids in plain)  # every plain prompt fits; the longest think-block prompts do not
    dropped = sum(len(ids) > limit for ids in no_think)
    assert 0 < dropped < len(rows)
    base = [f"data.max_prompt_length={limit}", "data.filter_overlong_prompts=true"]

    ds = build_rl_dataset(load_config(base).data, tok, files)
    assert ds.num_filtered == 0 and [it.prompt_ids for it in ds.items] == plain
    ds = build_rl_dataset(load_config([*base, "+data.apply_chat_template_kwargs.enable_thinking=False"]).data,
                          tok, files)
    assert ds.num_filtered == dropped
    assert [it.prompt_ids for it in ds.items] == [ids for ids in no_think if len(ids) <= limit]
    assert all(it.prompt_text.endswith("<think>\n\n</think>\n\n") for it in ds.items)

    # tiller generate / eval render the same way
    _, ids, _ = load_prompt_rows(files, tok, max_prompt_length=1000, chat_template_kwargs={"enable_thinking": False})
    assert ids == no_think


def _capture_generations(trainer) -> list[list[int]]:
    """Wrap the actor worker's generate_sequences: every prompt row it returns (left padding stripped)."""
    worker, seen = trainer.actor.worker, []
    inner = worker.generate_sequences

    def generate_sequences(prompts):
        batch = inner(prompts)
        P = batch["prompts"].shape[1]
        for row, mask in zip(batch["prompts"], batch["attention_mask"][:, :P]):
            seen.append(row[mask.bool()].tolist())
        return batch

    worker.generate_sequences = generate_sequences
    return seen


def test_rl_step_trains_and_validates_on_prompts_of_the_custom_template(tmp_path, tiny_model_dir, task):
    from tiller.trainer.rl import RLTrainer

    conf = tmp_path / "chat.yaml"
    conf.write_text(yaml.safe_dump({"actor_rollout_ref": {"model": {"custom_chat_template": CUSTOM_TEMPLATE}},
                                    "data": {"apply_chat_template_kwargs": {"style": "terse"}}}))
    cfg = load_config([
        f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files=[{task / 'train.parquet'}]",
        f"data.val_files=[{task / 'test.parquet'}]", "data.train_batch_size=4", "data.max_prompt_length=48",
        "data.max_response_length=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "algorithm.adv_estimator=grpo",
        "trainer.total_training_steps=1", "trainer.save_freq=1", "trainer.val_before_train=true",
        "trainer.test_freq=0", "trainer.logger=[jsonl]", "trainer.resume_mode=disable",
        f"trainer.default_local_dir={tmp_path / 'run'}"], config_file=conf)
    trainer = RLTrainer(cfg)
    seen = _capture_generations(trainer)
    trainer.fit()
    trainer.shutdown()

    tok = load_tokenizer(tiny_model_dir)
    train = _by_hand(tok, read_rows(str(task / "train.parquet")), CUSTOM_TEMPLATE, style="terse")
    val = _by_hand(tok, read_rows(str(task / "test.parquet")), CUSTOM_TEMPLATE, style="terse")
    own = _by_hand(tok, read_rows(str(task / "train.parquet")))  # the tokenizer's own template
    assert tok.decode(train[0]).endswith("SHORT ANSWER:") and train[0] != own[0]
    # validation before training (4 prompts, 1 greedy sample each), the step's 4 prompts x n=2, the last step's
    # validation
    assert len(seen) == 4 + 4 * 2 + 4
    assert seen[:4] == val and seen[-4:] == val
    assert all(ids in train for ids in seen[4:-4])
    # the checkpoint's tokenizer carries the template: the saved model renders prompts as it was trained
    saved = load_tokenizer(tmp_path / "run" / "checkpoints" / "global_step_1" / "model")
    assert saved.chat_template == CUSTOM_TEMPLATE


@pytest.mark.parametrize("override, expect", [
    ("data.apply_chat_template_kwargs=5", "data.apply_chat_template_kwargs = 5 is not a valid mapping"),
    ("+data.apply_chat_template_kwargs.tokenize=true", "data.apply_chat_template_kwargs.tokenize"),
    ("actor_rollout_ref.model.custom_chat_template='{% for m in messages %}'",
     "actor_rollout_ref.model.custom_chat_template: the chat template does not compile"),
    ("actor_rollout_ref.model.custom_chat_template='{{ raise_exception(\"no system role\") }}'",
     "actor_rollout_ref.model.custom_chat_template: the chat template does not compile or render"),
])
def test_bad_values_exit_2_naming_the_key(tmp_path, override, expect, capsys):
    from tiller.cli import main

    # refused at config validation, before any model work (no model.path is even given: a config that passed
    # would stop on that instead, and the message would not match)
    code = main(["rl", f"trainer.default_local_dir={tmp_path / 'run'}", override])
    err = capsys.readouterr().err
    assert code == 2 and expect in err and "Traceback" not in err, err


def test_set_chat_template_reaches_the_processor_and_validation_renders_the_kwargs():
    from tiller.errors import ConfigError
    from tiller.models.chat_template import check_chat_template_settings, set_chat_template

    class Proc:
        chat_template = "old"

    class Tok:
        chat_template = "old"

    tok, proc = Tok(), Proc()
    set_chat_template(tok, None, proc)
    assert tok.chat_template == proc.chat_template == "old"
    set_chat_template(tok, CUSTOM_TEMPLATE, proc)
    assert tok.chat_template == proc.chat_template == CUSTOM_TEMPLATE
    keys = dict(template_key="actor_rollout_ref.model.custom_chat_template",
                kwargs_key="data.apply_chat_template_kwargs")
    check_chat_template_settings(CUSTOM_TEMPLATE, {"style": "terse"}, **keys)
    # a render that only fails with the given kwargs is caught too (a string is not iterable as a mapping)
    with pytest.raises(ConfigError, match="custom_chat_template: the chat template does not compile or render"):
        check_chat_template_settings("{{ extra['a'] + 1 }}", {"extra": {"a": "x"}}, **keys)
    with pytest.raises(ConfigError, match=r"data.apply_chat_template_kwargs must be a mapping"):
        check_chat_template_settings(None, ["enable_thinking"], **keys)


def test_agent_endpoint_renders_chats_with_the_kwargs(thinking_model):
    """The OpenAI endpoint an agent rollout trains through (the actor worker sets its chat_template_kwargs to
    data.apply_chat_template_kwargs): a chat renders as the prompt set does."""
    from tiller.serve.app import ServedModel
    from tiller.serve.protocol import ChatCompletionRequest

    tok = load_tokenizer(thinking_model)
    served = ServedModel(object(), tok, name="policy", max_model_len=256)
    try:
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "7+8="}])
        plain, _ = served.render_chat(req)
        served.chat_template_kwargs = {"enable_thinking": False}
        no_think, _ = served.render_chat(req)
    finally:
        served.batcher.close()
    rows = [{"prompt": [{"role": "user", "content": "7+8="}]}]
    assert [plain] == _by_hand(tok, rows) and [no_think] == _by_hand(tok, rows, enable_thinking=False)
    assert no_think != plain


def test_image_prompts_render_through_the_processor_with_both_keys(tiny_vlm_dir, tmp_path):
    """A vision-language model: the processor renders image rows, so it takes the custom template and the kwargs."""
    import io

    from PIL import Image

    from tiller.data.rl_dataset import RLDataset
    from tiller.models.chat_template import set_chat_template
    from tiller.models.tiny_vlm import VL_CHAT_TEMPLATE
    from tiller.models.vision import IMAGE_PAD, load_processor

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (255, 0, 0)).save(buf, format="PNG")
    path = write_rows([{"data_source": "x", "prompt": [{"role": "user", "content": "<image>How many?"}],
                        "images": [{"bytes": buf.getvalue()}], "reward_model": {"ground_truth": "1"}}],
                      tmp_path / "img.parquet")
    processor = load_processor(tiny_vlm_dir)
    tok = processor.tokenizer
    set_chat_template(tok, "{% if mode == 'exam' %}EXAM {% endif %}" + VL_CHAT_TEMPLATE, processor)
    item = RLDataset([path], tok, processor=processor, max_prompt_length=256,
                     chat_template_kwargs={"mode": "exam"})[0]
    assert item.prompt_text.startswith("EXAM <|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>How many?")
    assert item.prompt_ids.count(tok.convert_tokens_to_ids(IMAGE_PAD)) == 16  # the image still expands (8x8 / 4)
    assert item.prompt_ids[:2] == tok("EXAM <|im_start|>", add_special_tokens=False)["input_ids"][:2]


AGENT_SRC = '''
import openai

async def run(base_url, sample):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    await client.chat.completions.create(model="policy", messages=sample["prompt"], max_tokens=2)
    await client.close()
    return 0.0
'''


def test_agent_rollout_contexts_render_with_the_kwargs(tmp_path, thinking_model, task):
    """An agent's chat through the endpoint of `rollout.agent.path`: the trained context is the prompt rendered
    with data.apply_chat_template_kwargs (as the prompt set renders it)."""
    pytest.importorskip("openai")
    from tiller.trainer.rl import RLTrainer

    (tmp_path / "agent.py").write_text(AGENT_SRC)
    cfg = load_config([
        f"actor_rollout_ref.model.path={thinking_model}", f"data.train_files=[{task / 'train.parquet'}]",
        "data.train_batch_size=2", "data.max_prompt_length=64", "data.max_response_length=4",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "algorithm.adv_estimator=grpo",
        "trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
        "trainer.resume_mode=disable", f"trainer.default_local_dir={tmp_path / 'run'}",
        f"actor_rollout_ref.rollout.agent.path={tmp_path / 'agent.py'}",
        "+data.apply_chat_template_kwargs.enable_thinking=False"])
    trainer = RLTrainer(cfg)
    try:
        trainer.global_step = 1
        batch = trainer._collect_batch({}, 1)
        contexts = [row[mask.bool()].tolist() for row, mask in
                    zip(batch["prompts"], batch["attention_mask"][:, :batch["prompts"].shape[1]])]
    finally:
        trainer.shutdown()
    tok = load_tokenizer(thinking_model)
    rows = read_rows(str(task / "train.parquet"))
    no_think = _by_hand(tok, rows, enable_thinking=False)
    assert len(contexts) == 4 and all(ids in no_think for ids in contexts)
    assert not any(ids in _by_hand(tok, rows) for ids in contexts)
