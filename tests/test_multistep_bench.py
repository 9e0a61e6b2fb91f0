"""benchmarks/multistep.py's trace arithmetic and model shapes, on hand-made trace lines (the
GPU trace itself only exists on a GPU)."""
from types import SimpleNamespace

import pytest

from benchmarks import multistep


def _line(name, *events):
    return SimpleNamespace(name=name, events=[SimpleNamespace(name=n, start_ns=a, end_ns=b)
                                              for n, a, b in events])


LINES = [_line("Stream #1", ("gemm", 0, 100), ("attention", 100, 130), ("gemm", 150, 250)),
         _line("Stream #2", ("copy", 120, 160))]


def test_busy_time_is_the_union_of_the_streams_intervals():
    # 0-160 (gemm, attention and the overlapping copy) and 150-250 merge into 0-250
    assert multistep.busy_seconds(LINES) == pytest.approx(250e-9)


def test_kernels_are_summed_by_name_most_time_first():
    totals = multistep.kernel_totals(LINES)
    assert [(name, count) for name, _, count in totals] == [
        ("gemm", 2), ("copy", 1), ("attention", 1)]
    assert totals[0][1] == pytest.approx(200e-9)


def test_the_kernel_table_shows_the_top_kernels_per_iteration_and_the_rest():
    rows = multistep.kernel_table(multistep.kernel_totals(LINES), iterations=2,
                                  busy=250e-9, top=1)
    assert rows[2] == "| `gemm` | 0.1 | 1.0 | 80.0% |"
    assert rows[3] == "| `(all others)` | 0.0 | 1.0 | 28.0% |"   # copy and attention
    assert len(rows) == 4


def test_overrides_change_a_presets_fields():
    config = multistep.model_config(
        "llama3.2-1b", "hidden_size=1024,intermediate_size=4096,num_attention_heads=16,"
        "head_dim=64,vocab_size=16384")
    assert (config.hidden_size, config.num_attention_heads, config.vocab_size,
            config.num_hidden_layers) == (1024, 16, 16384, 16)
    assert multistep.model_config("llama3.2-1b", "").hidden_size == 2048
    with pytest.raises(ValueError, match="expected field=value"):
        multistep.model_config("llama3.2-1b", "hidden_size")
    with pytest.raises(ValueError, match="unknown model preset"):
        multistep.model_config("no-such-model", "hidden_size=8")
