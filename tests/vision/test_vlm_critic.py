"""PPO with GAE on a vision-language model: the critic is the VLM with a scalar head whose forward takes the
pixels (values depend on the image, equal a plain forward of each row), token-budget micro-batches count the
image tokens and give the same values, a PPO step trains and checkpoints the critic, a text critic and LoRA on the
critic are refused."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from tiller.config import load_config
from tiller.errors import ConfigError
from tiller.protocol import Batch
from tiller.rollout.base import left_pad
from tiller.tasks import shapes
from tests.vision.slots import for_model

TEXT = "<|vision_start|><|image_pad|><|vision_end|>how many?"


def _ppo_cfg(model_dir, train, run_dir, *overrides):
    return load_config([
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files=[{train}]", "data.image_key=images",
        "data.train_batch_size=2", "data.max_prompt_length=64", "data.max_response_length=4",
        "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.dtype=float32", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=2",
        "critic.forward_micro_batch_size_per_gpu=4", "critic.optim.lr=1e-2", "algorithm.adv_estimator=gae",
        "trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
        "trainer.resume_mode=disable", f"trainer.default_local_dir={run_dir}", *overrides])


@pytest.fixture(scope="module")
def shapes_data(tmp_path_factory):
    return shapes.write_task(tmp_path_factory.mktemp("ppo_shapes"), n_train=4, n_test=2, seed=0)


@pytest.fixture(scope="module")
def critic(any_vlm_dir, shapes_data, tmp_path_factory):
    from tiller.workers.critic import CriticWorker

    cfg = _ppo_cfg(any_vlm_dir, shapes_data["train"], tmp_path_factory.mktemp("critic"))
    return CriticWorker(cfg, total_training_steps=1)


def _image_batch(model_dir) -> tuple[Batch, list]:
    """4 rows: same question over a red, a blue, a red and a green image (responses of 3 / 4 tokens)."""
    from tiller.models.vision import encode_image_prompt, load_processor

    proc = load_processor(model_dir)
    colours = [(255, 0, 0), (0, 0, 255), (255, 0, 0), (0, 200, 0)]
    prompts = [encode_image_prompt(proc, for_model(proc, TEXT), [Image.new("RGB", (64, 64), c)]) for c in colours]
    responses = [[5, 6, 7], [5, 6, 7], [9, 8, 7, 6], [5, 6, 7]]
    prompt, pmask = left_pad([p.prompt_ids for p in prompts], 0)
    T = 4
    resp = torch.zeros(4, T, dtype=torch.long)
    rmask = torch.zeros(4, T, dtype=torch.long)
    for i, r in enumerate(responses):
        resp[i, :len(r)], rmask[i, :len(r)] = torch.tensor(r), 1
    batch = Batch({"prompts": prompt, "responses": resp, "input_ids": torch.cat([prompt, resp], 1),
                   "attention_mask": torch.cat([pmask, rmask], 1), "response_mask": rmask,
                   "multi_modal_inputs": [{"pixel_values": p.pixel_values, "image_grid_thw": p.image_grid_thw}
                                          for p in prompts]})
    return batch, list(zip(prompts, responses))


@pytest.mark.parametrize("share", [True, False])
def test_critic_values_read_the_image_and_equal_a_plain_forward(critic, any_vlm_dir, share):
    from tiller.models.layer_masks import has_recurrent_layers

    batch, rows = _image_batch(any_vlm_dir)
    # the default; rows 0 and 2 (same text, same image) share, but for Qwen3.5, whose Gated DeltaNet state the
    # response forward would overwrite in place (autograd cannot differentiate through it)
    recurrent = has_recurrent_layers(critic.module.config)
    assert critic._forward_opts["share_prompts"] is not recurrent
    if share and recurrent:
        return
    before, critic._forward_opts["share_prompts"] = critic._forward_opts["share_prompts"], share
    try:
        values = critic.compute_values(batch)["values"]
    finally:
        critic._forward_opts["share_prompts"] = before
    # rows 0 and 1: same tokens, red vs blue image -> different values at every response position
    assert torch.equal(batch["input_ids"][0], batch["input_ids"][1])
    assert (values[0, :3] - values[1, :3]).abs().min() > 1e-5
    # each row's values are those of one unpadded forward of the row with its pixels (the state before token t)
    model = critic.module.eval()
    for i, (p, r) in enumerate(rows):
        ids = torch.tensor([p.prompt_ids + r])
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=p.pixel_values,
                        image_grid_thw=p.image_grid_thw,
                        mm_token_type_ids=(ids == model.config.image_token_id).int()).logits[0, :, 0]
        torch.testing.assert_close(values[i, :len(r)], out[len(p.prompt_ids) - 1:-1], atol=2e-5, rtol=0)
        assert torch.all(values[i, len(r):] == 0)
    model.train()


def test_dynamic_bsz_counts_image_tokens(critic, any_vlm_dir):
    from tiller.workers.micro_batches import token_budget_indices

    batch, rows = _image_batch(any_vlm_dir)
    P = batch["prompts"].shape[1]
    # a 64 x 64 image is 16 tokens of the prompt's sequence (8 x 8 patches merged 2 x 2; Qwen3-VL: resized to 128 px,
    # patch 16)
    assert int(batch["attention_mask"][0, :P].sum()) == len(rows[0][0].prompt_ids) >= 16 + 3
    per_row = P + 4
    parts = token_budget_indices(batch, max_tokens=2 * per_row)
    assert sorted(len(p) for p in parts) == [2, 2]
    text_only = P - 15  # had the 16 image tokens been counted as one, 3 rows would fit this budget
    assert 3 * (text_only + 4) <= 2 * per_row
    # the values with token-budget micro-batches equal the row-count ones
    whole = critic.compute_values(batch)["values"]
    critic.ccfg.use_dynamic_bsz, critic.ccfg.forward_max_token_len_per_gpu = True, 2 * per_row
    try:
        split = critic.compute_values(batch)["values"]
    finally:
        critic.ccfg.use_dynamic_bsz = False
    torch.testing.assert_close(split, whole, atol=2e-5, rtol=0)


def test_ppo_step_with_a_vlm_critic(tiny_vlm_dir, shapes_data, tmp_path):
    from tiller.trainer.rl import RLTrainer

    run = tmp_path / "run"
    cfg = _ppo_cfg(tiny_vlm_dir, shapes_data["train"], run, "trainer.save_freq=1", "critic.use_dynamic_bsz=true",
                   "critic.ppo_max_token_len_per_gpu=80", "actor_rollout_ref.actor.use_dynamic_bsz=true",
                   "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=80")
    trainer = RLTrainer(cfg)
    try:
        critic = trainer.critic.worker.module
        before = {k: v.detach().clone() for k, v in critic.state_dict().items()}
        actor_before = trainer.actor.execute("state_dict")
        trainer.fit()
        after = critic.state_dict()
        actor_after = trainer.actor.execute("state_dict")
    finally:
        trainer.shutdown()
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = metrics[-1]
    assert "critic/vf_loss" in last and "critic/values/mean" in last and "critic/vf_explained_var" in last
    assert not torch.equal(before["lm_head.weight"], after["lm_head.weight"])
    # the vision towers learn too: the updates' forwards take the pixels (the update batch keeps them)
    assert any(not torch.equal(before[k], after[k]) for k in before if ".visual." in k)
    assert any(not torch.equal(actor_before[k], actor_after[k]) for k in actor_before if ".visual." in k)
    from safetensors.torch import load_file

    saved = load_file(str(run / "checkpoints" / "critic" / "global_step_1" / "model" / "model.safetensors"))
    assert saved["lm_head.weight"].shape == (1, 128) and saved["lm_head.bias"].shape == (1,)
    torch.testing.assert_close(saved["lm_head.weight"], after["lm_head.weight"])
    # the actor's checkpoint carries the processor: its model dir loads back as a VLM (tiller rl can start from it)
    from tiller.models.loading import is_vision_checkpoint
    from tiller.models.vision import load_processor

    actor_dir = run / "checkpoints" / "global_step_1" / "model"
    assert is_vision_checkpoint(actor_dir) and load_processor(actor_dir).image_processor.merge_size == 2


def test_text_critic_for_an_image_actor_is_refused(tiny_vlm_dir, tiny_model_dir, shapes_data, tmp_path):
    from tiller.trainer.rl import RLTrainer

    with pytest.raises(ConfigError, match=r"critic.model.path=.*: the prompts have images but this is a text-only "
                                          r"model \(it would ignore the pixels\)"):
        RLTrainer(_ppo_cfg(tiny_vlm_dir, shapes_data["train"], tmp_path / "r", f"critic.model.path={tiny_model_dir}"))


def test_lora_on_a_vlm_critic_is_refused(tiny_vlm_dir, shapes_data, tmp_path):
    # its value head replaces the LM head, which a peft adapter of the base could not be merged back into
    from tiller.workers.critic import CriticWorker

    with pytest.raises(ConfigError, match=r"critic\.model\.lora_rank / critic\.model\.lora_adapter_path: LoRA on a "
                                          r"vision-language critic \(Qwen2"):
        CriticWorker(_ppo_cfg(tiny_vlm_dir, shapes_data["train"], tmp_path / "r", "critic.model.lora_rank=4"),
                     total_training_steps=1)


def test_prime_on_image_prompts_is_refused(tiny_vlm_dir, shapes_data, tmp_path):
    from tiller.trainer.rl import RLTrainer

    with pytest.raises(ConfigError, match="adv_estimator=prime: the prompts have images"):
        RLTrainer(_ppo_cfg(tiny_vlm_dir, shapes_data["train"], tmp_path / "r", "algorithm.adv_estimator=prime"))


@pytest.mark.parametrize("job", ["dpo", "rm", "kto"])
def test_text_jobs_refuse_image_rows(tiny_model_dir, tmp_path, capsys, job):
    from tiller.cli import main
    from tiller.data.files import write_rows

    row = {"prompt": "how many?", "chosen": "2", "rejected": "3", "completion": "2", "label": True,
           "images": [{"bytes": b"png"}]}
    path = write_rows([row], tmp_path / "pairs.parquet")
    code = main([job, f"model.partial_pretrain={tiny_model_dir}", f"data.train_files=[{path}]",
                 f"trainer.default_local_dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err
    assert code == 2 and "pairs.parquet row 0: the row has images (column 'images')" in err, err
