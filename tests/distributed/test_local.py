"""Local backend and the non-distributed behaviour of tiller.distributed.context (the identity)."""

import pytest
import torch

from tiller.distributed import LocalWorkerGroup, context, create_worker_group
from tiller.distributed.dispatch import merge_dp, split_dp
from tiller.distributed.testing import MLPRegressionWorker
from tiller.errors import ConfigError, UserError

Batch = pytest.importorskip("tiller.protocol").Batch


def _data(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return Batch({"x": torch.randn(n, 8, generator=g), "y": torch.randn(n, 2, generator=g)})


def test_context_is_identity_without_distributed():
    assert (context.rank(), context.world_size(), context.is_distributed()) == (0, 1, False)
    t = torch.tensor([1.0, 2.0])
    assert context.all_reduce_sum(t) is t
    assert context.all_gather_object({"a": 1}) == [{"a": 1}]
    context.barrier()
    model = torch.nn.Linear(3, 2)
    for strategy in ("none", "ddp", "fsdp"):
        assert context.wrap_model(model, strategy) is model
    sd = context.full_state_dict(model)
    assert set(sd) == {"weight", "bias"} and torch.equal(sd["weight"], model.weight.detach())
    with pytest.raises(ConfigError, match="fsdp2"):
        context.wrap_model(model, "fsdp2")


def test_local_group_runs_worker_in_process():
    group = create_worker_group(MLPRegressionWorker, {"seed": 3}, name="actor")
    assert isinstance(group, LocalWorkerGroup) and group.world_size == 1
    assert group.execute("info")["rank"] == 0
    assert group.execute("info", dispatch="all")[0]["world_size"] == 1
    # in-process: the worker object is reachable (breakpoints, inspection)
    assert isinstance(group.worker, MLPRegressionWorker)
    batch = _data()
    before = group.execute("state_dict")
    metrics = group.execute("train_step", batch, dispatch="dp")
    after = group.execute("state_dict")
    assert metrics["loss"] > 0 and not torch.equal(before["out.weight"], after["out.weight"])
    pred = group.execute("predict", batch, dispatch="dp")
    assert pred["pred"].shape == (6, 2)
    group.shutdown()


def test_local_group_sgd_matches_hand_computed_step():
    # One SGD step on L = sum((f(x)-y)^2) / n equals a manual autograd step with the same init.
    group = create_worker_group(MLPRegressionWorker, {"seed": 5, "lr": 0.05})
    ref = MLPRegressionWorker(seed=5, lr=0.05)
    batch = _data(n=4)
    loss = ((ref.model(batch["x"]) - batch["y"]) ** 2).sum() / 4
    grads = torch.autograd.grad(loss, list(ref.model.parameters()))
    expected = {n: p.detach() - 0.05 * g for (n, p), g in zip(ref.model.named_parameters(), grads)}
    out = group.execute("train_step", batch, dispatch="dp")
    assert out["loss"] == pytest.approx(float(loss.detach()), rel=1e-6)
    got = group.execute("state_dict")
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value)


def test_errors_name_the_problem():
    with pytest.raises(ConfigError, match="trainer.backend=ray"):
        create_worker_group(MLPRegressionWorker, {}, world_size=2)
    with pytest.raises(ConfigError, match="trainer.backend='spark'"):
        create_worker_group(MLPRegressionWorker, {}, backend="spark")
    group = create_worker_group(MLPRegressionWorker, {})
    with pytest.raises(ConfigError, match="dispatch mode"):
        group.execute("info", dispatch="scatter")
    with pytest.raises(AttributeError, match="no method 'nope'"):
        group.execute("nope")
    with pytest.raises(TypeError, match="needs a Batch"):
        group.execute("train_step", {"x": 1}, dispatch="dp")
    assert issubclass(ConfigError, UserError)


def test_dp_split_pads_and_merge_unpads():
    # 5 rows over 2 ranks: padded with row 0 to 6, chunks [0,1,2] and [3,4,0]; merge drops the pad row.
    b = Batch({"i": torch.arange(5)}, {"tag": list("abcde")})
    per_rank, pad, padded_len = split_dp((b, "extra"), 2)
    assert pad == 1 and padded_len == 6
    assert per_rank[0][0]["i"].tolist() == [0, 1, 2] and per_rank[1][0]["i"].tolist() == [3, 4, 0]
    assert per_rank[1][1] == "extra"
    merged = merge_dp([r[0] for r in per_rank], pad, padded_len)
    assert merged["i"].tolist() == [0, 1, 2, 3, 4] and list(merged["tag"]) == list("abcde")
    # a method returning 3 rows per input row (n samples per prompt): the pad row's 3 copies are dropped
    tripled = [r[0].repeat(3) for r in per_rank]
    merged3 = merge_dp(tripled, pad, padded_len)
    assert merged3["i"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]
    # tuples merge element-wise; dicts come from rank 0
    out = merge_dp([(r[0], {"m": k}) for k, r in enumerate(per_rank)], pad, padded_len)
    assert out[0]["i"].tolist() == [0, 1, 2, 3, 4] and out[1] == {"m": 0}
