"""Checkpoints: exact round trip and resume, atomicity (failure and kill -9), pruning, export, PEFT."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tiller.cli import main as cli_main
from tiller.errors import UserError
from tiller.models.checkpoint import (
    MARKER, export_hf, latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint,
)


def make_training(model_dir, seed=0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return model, opt, sched


def train_step(model, opt, sched):
    # random data from the global RNG, so resuming must restore RNG state to reproduce it
    ids = torch.randint(4, 200, (2, 8))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    return loss.detach()


def test_resume_is_bitwise_identical(tiny_model_dir, tmp_path):
    model, opt, sched = make_training(tiny_model_dir)
    losses = [train_step(model, opt, sched) for _ in range(4)]
    straight = {k: v.clone() for k, v in model.state_dict().items()}

    model, opt, sched = make_training(tiny_model_dir)
    for _ in range(2):
        train_step(model, opt, sched)
    save_checkpoint(tmp_path, 2, model=model, optimizer=opt, scheduler=sched, extra_state={"sampler": {"pos": 5}})
    train_step(model, opt, sched)  # diverge after the save: the load must undo this

    model, opt, sched = make_training(tiny_model_dir, seed=99)  # a fresh process would start elsewhere
    state = load_checkpoint(tmp_path, model=model, optimizer=opt, scheduler=sched)
    assert state == {"step": 2, "sampler": {"pos": 5}}
    assert sched.last_epoch == 2
    resumed = [train_step(model, opt, sched) for _ in range(2)]
    assert torch.equal(torch.stack(resumed), torch.stack(losses[2:]))
    assert all(torch.equal(straight[k], v) for k, v in model.state_dict().items())


def test_rng_states_restored(tmp_path):
    save_checkpoint(tmp_path, 1, extra_state={})
    expected = (random.random(), np.random.rand(), torch.rand(1))
    load_checkpoint(tmp_path / "global_step_1")
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected
    load_checkpoint(tmp_path, restore_rng=False)
    assert random.random() != expected[0]


def test_keep_prunes_and_marker(tmp_path):
    lin = torch.nn.Linear(2, 2)
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, model=lin, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["global_step_4", "global_step_5"]
    assert (tmp_path / MARKER).read_text().strip() == "5"
    assert latest_checkpoint(tmp_path) == tmp_path / "global_step_5"
    # marker pointing at a removed dir falls back to the highest complete step
    (tmp_path / MARKER).write_text("9\n")
    assert latest_checkpoint(tmp_path) == tmp_path / "global_step_5"
    assert latest_checkpoint(tmp_path / "nothing_here") is None
    # saving the same step again replaces it
    save_checkpoint(tmp_path, 5, model=lin, extra_state={"again": True})
    assert load_checkpoint(tmp_path)["again"] is True


def test_failed_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    lin = torch.nn.Linear(2, 2)
    save_checkpoint(tmp_path, 1, model=lin)
    real_save = torch.save

    def failing(obj, f, *a, **k):
        if str(getattr(f, "name", f)).endswith("state.pt"):  # a path, or the file object checkpoints write through
            raise OSError("disk full")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", failing)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 2, model=lin)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1", MARKER]
    assert latest_checkpoint(tmp_path).name == "global_step_1"


def test_kill_9_during_saves_leaves_loadable_checkpoint(tmp_path):
    script = textwrap.dedent(f"""
        import torch
        from tiller.models.checkpoint import save_checkpoint
        torch.set_num_threads(1)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
        opt = torch.optim.AdamW(model.parameters())
        step = 0
        while True:
            step += 1
            model(torch.ones(1, 256)).sum().backward()
            opt.step()
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(step)
            save_checkpoint({str(tmp_path)!r}, step, model=model, optimizer=opt, extra_state={{"s": step}}, keep=3)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.time() + 60
    while time.time() < deadline and len(list_checkpoints(tmp_path)) < 3:
        time.sleep(0.05)
    time.sleep(0.13)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    opt = torch.optim.AdamW(model.parameters())
    state = load_checkpoint(ckpt, model=model, optimizer=opt)
    assert state["s"] == int(ckpt.name.split("_")[-1])
    assert torch.all(model[0].bias == state["s"])  # the weights of that very step
    for p in list_checkpoints(tmp_path):  # every visible checkpoint is complete
        assert (p / "state.pt").exists() and (p / "model" / "model.safetensors").exists()
    # the killed process may have left a temp or trash dir; the next save cleans it up
    save_checkpoint(tmp_path, 10_000, model=model)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".del-" in p.name]


def test_extra_models_and_states_with_tied_weights(tmp_path):
    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(3, 3, bias=False)
            self.b = torch.nn.Linear(3, 3, bias=False)
            self.b.weight = self.a.weight  # tied

    critic = Head()
    copt = torch.optim.SGD(critic.parameters(), lr=0.1, momentum=0.9)
    critic.b(critic.a(torch.ones(1, 3))).sum().backward()
    copt.step()
    save_checkpoint(tmp_path, 1, extra_models={"critic": critic}, extra_states={"critic_optimizer": copt})
    fresh = Head()
    fopt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    load_checkpoint(tmp_path, extra_models={"critic": fresh}, extra_states={"critic_optimizer": fopt})
    assert torch.equal(fresh.a.weight, critic.a.weight) and fresh.b.weight is fresh.a.weight
    assert torch.equal(fopt.state_dict()["state"][0]["momentum_buffer"], copt.state_dict()["state"][0]["momentum_buffer"])


def test_export_cli_writes_loadable_hf_dir(tiny_model_dir, tmp_path, capsys):
    from transformers import AutoTokenizer

    model, opt, sched = make_training(tiny_model_dir)
    train_step(model, opt, sched)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    run = tmp_path / "run"
    save_checkpoint(run / "checkpoints", 1, model=model, optimizer=opt, tokenizer=tok)
    out = tmp_path / "exported"
    assert cli_main(["export", str(run), "--to", str(out)]) == 0  # a run dir resolves to its latest checkpoint
    loaded = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert AutoTokenizer.from_pretrained(out).eos_token == "<|im_end|>"
    # user errors: exit 2 with the path named
    assert cli_main(["export", str(run), "--to", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert cli_main(["export", str(tmp_path / "missing"), "--to", str(tmp_path / "o2")]) == 2
    assert "missing" in capsys.readouterr().err
    assert cli_main(["export", str(run), "--to", str(out), "--force", "--dtype", "bfloat16"]) == 0
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_saved_and_exported_files_honour_the_umask(tiny_model_dir, tmp_path, umask):
    """Weights, like every other file, get 0o666 less the umask (transformers writes them through a temp file
    that is owner-only), dirs 0o777 less it: in the checkpoint, in an export and in save_pretrained_atomic."""
    import stat

    from transformers import AutoTokenizer

    from tiller.models.checkpoint import save_pretrained_atomic

    old = os.umask(umask)
    try:
        model, opt, _ = make_training(tiny_model_dir)
        tok = AutoTokenizer.from_pretrained(tiny_model_dir)
        ckpt = save_checkpoint(tmp_path / "run" / "checkpoints", 1, model=model, optimizer=opt, tokenizer=tok)
        assert cli_main(["export", str(tmp_path / "run"), "--to", str(tmp_path / "exported")]) == 0
        save_pretrained_atomic(tmp_path / "direct", model, tok)
    finally:
        os.umask(old)
    for root in (ckpt, tmp_path / "exported", tmp_path / "direct"):
        files = [p for p in root.rglob("*") if p.is_file()]
        assert any(p.name == "model.safetensors" for p in files), root
        modes = {p.relative_to(root).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in files}
        assert set(modes.values()) == {0o666 & ~umask}, modes
        for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
            assert stat.S_IMODE(d.stat().st_mode) == 0o777 & ~umask, d


def test_peft_adapter_saved_loaded_and_merged_on_export(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))
    ckpt = save_checkpoint(tmp_path / "ck", 3, model=model)
    assert (ckpt / "model" / "adapter_model.safetensors").exists()
    assert not (ckpt / "model" / "model.safetensors").exists()  # adapter only

    fresh = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    load_checkpoint(ckpt, model=fresh)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        expected = model(ids).logits
        assert torch.allclose(fresh(ids).logits, expected, atol=1e-6)
    out = export_hf(ckpt, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in k for k in merged.state_dict())
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, expected, atol=1e-5)


def test_load_missing_path_is_user_error(tmp_path):
    with pytest.raises(UserError, match="nowhere"):
        load_checkpoint(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no checkpoint"):
        load_checkpoint(tmp_path / "empty")


def test_wrapped_model_saves_plain_keys(tmp_path):
    # torch.compile returns an OptimizedModule holding the model as `_orig_mod` (its state_dict keys get a
    # "_orig_mod." prefix); DDP holds it as `.module`. Building either costs seconds, so mimic the layout.
    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self._orig_mod = inner

    wrapped = Wrapper(torch.nn.Linear(3, 2))
    assert list(wrapped.state_dict())[0].startswith("_orig_mod.")
    save_checkpoint(tmp_path, 1, model=wrapped)
    plain = torch.nn.Linear(3, 2)
    load_checkpoint(tmp_path, model=plain)
    assert torch.equal(plain.weight, wrapped._orig_mod.weight)
    fresh = Wrapper(torch.nn.Linear(3, 2))
    load_checkpoint(tmp_path, model=fresh)
    assert torch.equal(fresh._orig_mod.bias, wrapped._orig_mod.bias)
