"""benchmarks/kernels_prefill.py on a tiny shape in the Pallas interpreter: causal FLOPs by hand,
the Triton kernel and the reference equal torch SDPA on contiguous copies of the same pages, a
tiling that cannot compile and a backend that cannot run are reported, not raised."""

import math

import jax.numpy as jnp
import pytest

from benchmarks import kernels_prefill

pytest.importorskip("torch")

HEADS = dict(num_heads=4, num_kv_heads=2, head_dim=16, dtype=jnp.float32)
# two chunks after a cached prefix (partial blocks); a prompt beside decode rows
CASES = [("2 x 5 after 12", [5, 5], [17, 17]), ("chunk + 2 decodes", [6, 1, 1], [6, 30, 30])]
TILINGS = ["bq8/c32/w4/st2", "bq3/c16/w4/st2"]  # block_q 3: not a power of two


def test_causal_flops_by_hand():
    """A 2-token chunk after 3 cached tokens: its rows see 4 and 5 keys; a 3-token prompt sees
    1 + 2 + 3; 4 FLOPs per head x dim per key seen (QK^T and PV)."""
    assert kernels_prefill.causal_flops([2], [5], num_heads=1, head_dim=1) == 4 * 9
    assert kernels_prefill.causal_flops([2, 3], [5, 3], num_heads=4, head_dim=16) == \
        4 * 16 * 4 * (9 + 6)


def test_the_new_long_cases_are_there_and_the_old_ones_stay():
    by_name = {name: (q, c) for name, q, c in kernels_prefill.PREFILL_CASES}
    assert by_name["1 x 32768, no prefix"] == ([32768], [32768])
    assert by_name["8 x 2048 after 8192 cached"] == ([2048] * 8, [10240] * 8)
    assert {"1 x 512, no prefix", "1 x 2048, no prefix", "4 x 512 after 1536 cached",
            "512 chunk + 64 decodes at 2048", "1 x 8192, no prefix"} <= set(by_name)


def test_tiling_names_parse_and_bad_ones_are_refused():
    assert kernels_prefill.parse_tiling("bq32/c64/w8/st3") == dict(
        block_q=32, tokens_per_step=64, num_warps=8, num_stages=3)
    assert kernels_prefill.tilings_from_option("") == []
    assert kernels_prefill.tilings_from_option("sweep") == list(kernels_prefill.TILING_SWEEP)
    with pytest.raises(ValueError, match="bq<block_q>"):
        kernels_prefill.tilings_from_option("bq16/c64")


def test_unknown_backends_are_skipped_with_a_reason():
    kernels, skipped = kernels_prefill.resolve_kernels(
        ["triton", "no_such_kernel"], interpret=True, head_dim=16, dtype=jnp.float32)
    assert list(kernels) == ["triton"]
    assert len(skipped) == 1 and skipped[0].startswith("no_such_kernel: not a pallas_kernels "
                                                       "backend (reference, pallas_gpu")
    _, skipped = kernels_prefill.resolve_kernels(["triton"], head_dim=16, dtype=jnp.float32)
    assert skipped == ["triton: needs a GPU, this is cpu"]


@pytest.fixture(scope="module")
def rows():
    kernels, _ = kernels_prefill.resolve_kernels(["triton", "reference"], interpret=True,
                                                 head_dim=16, dtype=jnp.float32)
    return kernels_prefill.prefill_rows(math.inf, kernels, TILINGS, cases=CASES,  # no deadline
                                        repeats=1, heads=HEADS, log=lambda line: None)


def test_kernels_equal_sdpa_on_copies_of_their_pages(rows):
    assert [row["case"] for row in rows] == [name for name, _, _ in CASES]
    for row in rows:
        assert set(row["difference"]) == {"triton", "reference"}
        assert max(row["difference"].values()) < 1e-5, row
        assert isinstance(row["sdpa"]["seconds"], float) and row["sdpa"]["backend"]
        # the CPU build has no cuDNN: the attempts before the one that ran are listed
        assert row["sdpa"]["failed"][0].startswith("cudnn: ")


def test_a_tiling_that_cannot_compile_is_reported(rows):
    for row in rows:
        assert isinstance(row["tilings"]["bq8/c32/w4/st2"], float)
        assert row["tilings"]["bq3/c16/w4/st2"].startswith("error: ValueError: block_q")
    table = kernels_prefill.format_tilings(rows)
    assert table.count("bq3/c16/w4/st2: error") == len(CASES)


def test_table_rates_and_ratios_follow_the_times(rows):
    row = rows[0]
    line = kernels_prefill.format_prefill([row], ["triton", "reference"]).splitlines()[-1]
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    assert cells[:3] == ["2 x 5 after 12", "10", f"{row['flops'] / 1e9:.1f}"]
    seconds, sdpa = row["kernels"]["triton"], row["sdpa"]["seconds"]
    assert cells[3] == f"{seconds * 1e6:.1f}" and cells[5] == f"{seconds / sdpa:.2f}"
    assert cells[4] == f"{row['flops'] / seconds / 1e12:.1f}"
    assert cells[-1] == f"{row['sdpa']['backend']} (eager)"
