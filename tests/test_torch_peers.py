"""The torch peers of benchmarks/kernels.py compute paged attention right (checked on CPU against
pallas_kernels.reference), build the steps they time, and refuse to time without a GPU."""

import numpy as np
import pytest

from benchmarks import kernels, torch_peers

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402


def test_gather_sdpa_equals_reference():
    assert torch_peers.check_against_reference() <= 1e-5


def test_reference_check_catches_top_left_causal_mask(monkeypatch):
    """torch's is_causal aligns a chunk to the top left, ignoring its cached prefix: wrong."""
    def top_left(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1,
                                              enable_gqa=k.shape[1] != q.shape[1])
    monkeypatch.setattr(torch_peers, "_causal_sdpa", top_left)
    with pytest.raises(AssertionError, match="max error"):
        torch_peers.check_against_reference()


def test_shapes_match_kernels_benchmark():
    assert (torch_peers.NUM_HEADS, torch_peers.NUM_KV_HEADS, torch_peers.HEAD_DIM) == (
        kernels.NUM_HEADS, kernels.NUM_KV_HEADS, kernels.HEAD_DIM)


def test_make_groups_splits_ragged_batch_by_lengths():
    groups = torch_peers.make_groups([1, 2, 5, 2], [9, 3, 5, 3], "cpu")
    assert [(g.query_len, g.context_len, g.num_seqs) for g in groups] == [(1, 9, 1), (2, 3, 2),
                                                                          (5, 5, 1)]
    assert groups[1].seqs.tolist() == [1, 3] and groups[1].rows.tolist() == [1, 2, 8, 9]
    (whole,) = torch_peers.make_groups([1] * 3, [7] * 3, "cpu")
    assert whole.seqs is None and whole.rows is None and whole.num_seqs == 3
    with pytest.raises(ValueError, match="query_len 4"):
        torch_peers.make_groups([4], [3], "cpu")


@pytest.mark.parametrize("paged", [False, True])
def test_decode_steps_chain_on_cpu(paged):
    batch, context, chain = 2, 40, 4  # 40 tokens: a partial last block of 16
    steps, note = torch_peers.decode_steps(batch, context, paged, chain=chain, device="cpu")
    num_sets = torch_peers.num_kv_sets(batch, context, chain)
    assert num_sets == 4 * chain and len(steps) == num_sets // chain
    assert "enable_gqa" in note and f"{num_sets} K/V" in note
    outs = [step() for step in steps]
    for out in outs:
        assert out.shape == (batch, 32, 128) and out.dtype == torch.bfloat16
        assert torch.isfinite(out).all()
    assert not torch.equal(outs[0], outs[1])  # each step reads its own K/V sets


def test_decode_page_sets_are_disjoint_and_skip_block_zero():
    k_pages, _, tables = torch_peers._page_pool(torch, [3, 1, 2], 16, 4, 0, "cpu")
    used = tables.numpy()[np.broadcast_to(np.arange(3) < np.array([3, 1, 2])[:, None],
                                          tables.shape)]
    assert sorted(used.tolist()) == list(range(1, k_pages.shape[1]))
    assert tables.shape == (4, 3, 3) and tables[:, 1, 1:].eq(0).all()


@pytest.mark.parametrize("paged", [False, True])
def test_prefill_step_on_cpu(paged):
    query_lens, context_lens = [8, 1, 1], [24, 20, 20]
    step, note = torch_peers.prefill_step(query_lens, context_lens, paged, device="cpu")
    out = step()
    assert out.shape == (10, 32, 128) and torch.isfinite(out).all()
    assert note.endswith("2 SDPA calls")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_timing_needs_cuda():
    is_available, reason = torch_peers.torch_available()
    assert not is_available and reason == f"torch {torch.__version__} sees no CUDA device"
    for time_peer, args in [(torch_peers.time_decode_sdpa_contiguous, (8, 1024)),
                            (torch_peers.time_decode_gather_sdpa, (8, 1024)),
                            (torch_peers.time_prefill_sdpa, ([512], [512]))]:
        with pytest.raises(RuntimeError, match="need a CUDA GPU"):
            time_peer(*args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU table")
def test_table_shows_errors_and_keeps_going():
    table = torch_peers.peer_table(kernels.DECODE_CASES, kernels.PREFILL_CASES)
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 2 + len(kernels.DECODE_CASES) + len(kernels.PREFILL_CASES)
    assert table.count("error: RuntimeError: torch peers need a CUDA GPU") == 2 * (len(rows) - 2)
