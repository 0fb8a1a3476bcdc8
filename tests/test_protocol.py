"""Batch: round trips (split/concat, repeat/select, pad/unpad, pickle) and the errors a caller sees."""

import pickle

import numpy as np
import pytest
import torch

from tiller.protocol import Batch


def make(n=6):
    return Batch(
        tensors={"ids": torch.arange(n * 3).view(n, 3), "score": torch.linspace(0, 1, n)},
        fields={"prompt": [f"p{i}" for i in range(n)], "extra": [{"i": i, "tags": [i, i + 1]} for i in range(n)]},
        meta={"temperature": 0.7},
    )


def assert_same(a: Batch, b: Batch):
    assert a.keys() == b.keys() and len(a) == len(b)
    for k in a.tensors:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k])
    for k in a.fields:
        assert a[k].tolist() == b[k].tolist()


def test_fields_are_object_arrays_even_for_nested_lists():
    b = Batch(fields={"tokens": [[1, 2], [3, 4], [5, 6]]})
    assert b["tokens"].dtype == object and b["tokens"].shape == (3,)
    assert b["tokens"][1] == [3, 4]
    assert len(b) == 3 and len(Batch()) == 0


def test_mismatched_lengths_name_both_keys():
    with pytest.raises(ValueError, match=r"'prompt' has length 2 but 'ids' has length 3"):
        Batch({"ids": torch.zeros(3, 2)}, {"prompt": ["a", "b"]})
    b = make(4)
    with pytest.raises(ValueError, match="'new' has length 5"):
        b["new"] = torch.zeros(5)
    with pytest.raises(KeyError, match="nope"):
        b["nope"]


def test_split_then_concat_round_trip():
    b = make(7)
    parts = b.split(3)
    assert [len(p) for p in parts] == [3, 3, 1]
    assert parts[1]["prompt"].tolist() == ["p3", "p4", "p5"]
    assert_same(Batch.concat(parts), b)
    chunks = b.chunk(3)
    assert [len(c) for c in chunks] == [3, 2, 2]
    assert_same(Batch.concat(chunks), b)
    assert Batch.concat(parts).meta == {"temperature": 0.7}


def test_repeat_interleaved_and_tiled_then_select():
    b = make(3)
    r = b.repeat(2, interleave=True)
    assert r["prompt"].tolist() == ["p0", "p0", "p1", "p1", "p2", "p2"]
    assert r["ids"][:, 0].tolist() == [0, 0, 3, 3, 6, 6]
    t = b.repeat(2, interleave=False)
    assert t["prompt"].tolist() == ["p0", "p1", "p2", "p0", "p1", "p2"]
    assert t["ids"][:, 0].tolist() == [0, 3, 6, 0, 3, 6]
    # every second row of the interleaved repeat is the original batch again
    assert_same(r.index(slice(0, None, 2)), b)
    assert_same(r.index([1, 3, 5]).select(["ids", "prompt"]), b.select(["prompt", "ids"]))
    assert r.select(["score"]).keys() == ["score"]


def test_index_forms_agree():
    b = make(5)
    mask = torch.tensor([True, False, True, False, True])
    expected = ["p0", "p2", "p4"]
    for idx in (mask, mask.numpy(), [0, 2, 4], np.array([0, 2, 4]), torch.tensor([0, 2, 4]), slice(0, 5, 2)):
        assert b.index(idx)["prompt"].tolist() == expected
    assert b[[4, 0]]["ids"][:, 0].tolist() == [12, 0]
    assert len(b.index(torch.zeros(5, dtype=torch.bool))) == 0
    with pytest.raises(IndexError):
        b.index([5])
    with pytest.raises(ValueError, match="mask"):
        b.index([True, False])


def test_reorder_is_a_permutation():
    b = make(4)
    perm = [2, 0, 3, 1]
    r = b.reorder(perm)
    assert r["prompt"].tolist() == ["p2", "p0", "p3", "p1"]
    inverse = np.argsort(perm)
    assert_same(r.reorder(inverse), b)
    with pytest.raises(ValueError, match="permutation"):
        b.reorder([0, 0, 1, 2])


def test_pad_to_multiple_and_unpad():
    b = make(5)
    p, pad = b.pad_to_multiple(4)
    # 5 rows -> 8: pad = 3, the copies are rows 0, 1, 2
    assert pad == 3 and len(p) == 8
    assert p["prompt"].tolist()[5:] == ["p0", "p1", "p2"]
    assert_same(p.unpad(pad), b)
    same, zero = b.pad_to_multiple(5)
    assert zero == 0 and same is b
    # padding more than the batch cycles through it: 2 rows -> 8 needs rows 0,1,0,1,0,1
    p2, pad2 = make(2).pad_to_multiple(8)
    assert pad2 == 6 and p2["prompt"].tolist() == ["p0", "p1"] * 4


def test_union_and_conflicts():
    b = make(3)
    extra = Batch({"adv": torch.ones(3)}, {"prompt": b["prompt"].copy()})
    u = b.union(extra)
    assert set(u.keys()) == set(b.keys()) | {"adv"}
    with pytest.raises(ValueError, match="'prompt'"):
        b.union(Batch(fields={"prompt": ["x", "y", "z"]}))
    with pytest.raises(ValueError, match="lengths differ"):
        b.union(Batch({"adv": torch.ones(4)}))


def test_concat_errors_name_the_problem():
    with pytest.raises(ValueError, match="keys"):
        Batch.concat([make(2), make(2).select(["ids"])])
    a = Batch({"x": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match="'x'"):
        Batch.concat([a, Batch({"x": torch.zeros(2, 4)})])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.int32])
def test_pickle_round_trip_keeps_dtype(dtype):
    b = make(4)
    b["x"] = (torch.randn(4, 5) * 10).to(dtype)
    b["view"] = torch.arange(20).view(5, 4).t()[:, :4]  # non-contiguous [4, 4]
    state = b.__getstate__()
    assert all(isinstance(arr, np.ndarray) for _, arr in state["tensors"].values())  # numpy underneath
    r = pickle.loads(pickle.dumps(b))
    assert_same(r, b)
    assert r.meta == b.meta and r["x"].dtype == dtype
    r["ids"].add_(1)  # restored tensors are writable (no read-only numpy buffers)


def test_to_device_and_len_of_views():
    b = make(3).to("cpu")
    assert b["ids"].device.type == "cpu"
    v = b.index(slice(1, 3))
    assert len(v) == 2 and v["ids"].data_ptr() == b["ids"][1:].data_ptr()  # slices are views
    assert "Batch(len=3" in repr(b)
