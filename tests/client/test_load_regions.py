"""Load fetches only the byte ranges a rank's regions cover, verified, in any layout."""

from __future__ import annotations

import pytest
import torch

from ckptd_client import CheckpointClient, FlatShard, StateDictMismatch

MiB = 1 << 20


@pytest.fixture
def client(server):
    c = CheckpointClient(server.url)
    yield c
    c.close()


def test_quarter_of_a_big_tensor_reads_about_a_quarter(client):
    big = torch.randn(1024, 4096)  # 16 MiB
    client.save({"w": big, "b": torch.arange(10)}, "regions/1").wait()
    flat = torch.zeros(big.numel() // 4)
    start = big.numel() // 4  # "rank 1 of 4" of a ZeRO-style flat partition
    sd = {"w": FlatShard(flat, big.shape, start), "b": torch.zeros(10, dtype=torch.int64)}
    report = client.load(sd, "regions/1")
    assert torch.equal(flat, big.reshape(-1)[start:start + flat.numel()])
    assert torch.equal(sd["b"], torch.arange(10))
    assert 4 * MiB <= report.bytes_read <= 4 * MiB + 2 * MiB + 4096  # at most one block of slack per side


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.bool,
                                   torch.float64, torch.complex64])
def test_dtypes_and_codecs_round_trip_bit_for_bit(server, dtype, compression):
    c = CheckpointClient(server.url, compression=compression)
    g = torch.Generator().manual_seed(7)
    src = (torch.randn(33, 17, generator=g) * 100).to(dtype) if dtype != torch.bool else torch.rand(33, 17) > 0.5
    if dtype.is_floating_point:
        src[0, 0], src[0, 1], src[0, 2] = float("nan"), float("inf"), float("-inf")
    ref = f"codecs/{str(dtype).split('.')[1]}-{compression or 'raw'}"
    c.save({"x": src, "scalar": torch.tensor(3, dtype=torch.int64)}, ref, step=1).wait()
    dst = {"x": torch.zeros_like(src), "scalar": torch.tensor(0)}
    c.load(dst, ref)
    assert torch.equal(dst["x"].view(torch.uint8), src.view(torch.uint8))  # bit for bit, NaN included
    assert int(dst["scalar"]) == 3
    c.close()


def test_strict_load_names_missing_and_mismatched_keys(client):
    client.save({"a": torch.ones(3), "b": torch.ones(2, 2)}, "strict/1").wait()
    with pytest.raises(StateDictMismatch, match="'c'"):
        client.load({"a": torch.zeros(3), "b": torch.zeros(2, 2), "c": torch.zeros(1)}, "strict/1")
    with pytest.raises(StateDictMismatch, match="'b'"):
        client.load({"a": torch.zeros(3)}, "strict/1", cover=True)
    only_a = {"a": torch.zeros(3)}  # a subset loads by default, as with DCP, and says what it left
    report = client.load(only_a, "strict/1")
    assert torch.equal(only_a["a"], torch.ones(3)) and report.uncovered == ["b"] and report.coverage_ranks == 1
    with pytest.raises(StateDictMismatch, match=r"'b'.*shape"):
        client.load({"a": torch.zeros(3), "b": torch.zeros(4)}, "strict/1")
    with pytest.raises(StateDictMismatch, match=r"'a'.*dtype"):
        client.load({"a": torch.zeros(3, dtype=torch.float64), "b": torch.zeros(2, 2)}, "strict/1")
    partial = {"a": torch.zeros(3), "c": torch.zeros(1)}
    report = client.load(partial, "strict/1", strict=False)
    assert torch.equal(partial["a"], torch.ones(3))
    assert report.missing == ["c"] and report.unexpected == ["b"]


def test_snapshot_is_taken_before_save_returns(client):
    w = torch.zeros(256, 256)
    handle = client.save({"w": w}, "snap/1")
    w.fill_(1.0)  # training mutates the tensor right after save() returns
    handle.wait()
    out = {"w": torch.full((256, 256), 5.0)}
    client.load(out, "snap/1")
    assert torch.count_nonzero(out["w"]) == 0


def test_latest_is_the_highest_step_compared_as_numbers(client):
    for step in (9, 10, 100, 20):
        client.save({"s": torch.tensor(step)}, f"order/{step}").wait()
    out = {"s": torch.tensor(0)}
    assert client.load(out, "order/latest").ref == "order/100"
    assert int(out["s"]) == 100
