"""Tensor parallelism, data-parallel replicas and the multi-host path (jpaged.parallel,
jpaged.serve.data_parallel) on forced CPU devices.

The checks that need several devices run in subprocesses (tests/parallel_worker.py) started with
XLA_FLAGS=--xla_force_host_platform_device_count: this pytest worker's JAX backend started long
ago with one device. The checkpoint is the GQA Llama of tests/hf_fixtures.py (4 query heads, 2 kv
heads), so TP=4 repeats each kv head on two devices; TP=8 runs on a second one with 8 query heads
and 2 kv heads (each kv head on four devices), which every axis split over 8 devices divides.
"""

import json
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import jax
import pytest
from jax.sharding import PartitionSpec as P

from jpaged import parallel
from jpaged.config import ModelConfig
from jpaged.serve.data_parallel import DataParallelEngine, pick_replica
from jpaged.engine.builder import EngineConfig, build_engine_config
from tests import child_process

ROOT = Path(__file__).resolve().parent.parent
WORKER_TIMEOUT = 600


def _worker(*args, devices: int) -> subprocess.Popen:
    """The worker on `devices` CPU devices. XLA's optimisations are off there: these tests check
    sharding and parity, not speed, and compiling takes half the time."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu", JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    return child_process.popen([sys.executable, "-m", "tests.parallel_worker", *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(process: subprocess.Popen) -> dict:
    out, err = child_process.communicate(process, WORKER_TIMEOUT)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def report(hf_checkpoints) -> dict:
    """The `tp` worker's report on 4 devices: {"1": ..., "2": ..., "4": ..., "dp": ...}."""
    return _result(_worker("tp", hf_checkpoints["llama_gqa"], devices=4))


@pytest.fixture(scope="module")
def report8(hf_checkpoints, tmp_path_factory) -> dict:
    """The `tp8` worker's report on 8 devices: {"1": ..., "8": ..., "too_few_heads_error": ...}."""
    from tests import hf_fixtures

    checkpoint = tmp_path_factory.mktemp("llama_tp8")
    hf_fixtures.build_llama_tp8(checkpoint)
    return _result(_worker("tp8", str(checkpoint), hf_checkpoints["llama_gqa"], devices=8))


# ---- tensor parallelism ------------------------------------------------------------------------
def test_greedy_tokens_identical_at_tp_1_2_4(report):
    assert report["1"]["tokens"] and all(len(t) == 10 for t in report["1"]["tokens"])
    assert report["2"]["tokens"] == report["1"]["tokens"]
    assert report["4"]["tokens"] == report["1"]["tokens"]


def test_constrained_rows_loop_and_match_at_tp_1_2_4(report):
    """Under tensor parallelism too, a structured output's rows decode in the loop (one host
    callback per iteration, not one per device) and write what they write on one device."""
    one = report["1"]["constrained"]
    assert re.fullmatch("[a-z]{2,6}( [a-z]{2,6})?", one["text"]) and one["finish_reason"] == "stop"
    for size in ("2", "4"):
        assert report[size]["constrained"] == one


def test_weights_split_megatron_style(report):
    # projection weights are [in, out]: column-parallel splits axis 1, row-parallel axis 0;
    # the embedding [V, E] splits E, the LM head [V, E] splits V
    column, row = [None, "tp"], ["tp", None]
    for size in ("2", "4"):
        params = report[size]["params"]
        assert report[size]["param_devices"] == int(size)
        assert params["qkv"] == params["gate_up"] == column
        assert params["o"] == params["down"] == row
        assert params["embed"] == column and params["lm_head"] == row
        assert params["norm"] == []
        # 2 kv heads on 4 devices: each device's qkv block holds its kv head's features
        assert report[size]["qkv_blocks_local"]
    assert report["1"]["param_devices"] == 1 and report["1"]["params"]["qkv"] == []
    assert report["dummy_same_on_mesh"]   # random weights: the same model at every TP size


def test_cache_split_along_kv_heads(report):
    one, two, four = report["1"], report["2"], report["4"]
    assert one["cache_shape"][0] == two["cache_shape"][0] == 2 and one["cache_devices"] == 1
    assert two["cache_spec"] == four["cache_spec"] == ["tp"]
    assert four["cache_shape"][0] == 4     # each of the 2 kv heads held twice
    assert two["cache_shard_shape"][0] == four["cache_shard_shape"][0] == 1
    assert two["cache_devices"] == 2 and four["cache_devices"] == 4
    assert four["kv_copies_equal"] is True  # the model wrote both copies of every head


def test_block_manager_replicated_and_kernels_per_shard(report):
    for size in ("1", "2", "4"):
        assert report[size]["manager_replicated"]
    layers = report["1"]["num_layers"]
    assert report["1"]["shard_maps"] == 0   # the single-device program has no shard_map
    assert report["2"]["shard_maps"] == report["4"]["shard_maps"] == 2 * layers  # write, attend
    assert report["2"]["preemption_mode"] == "recompute"


def test_tp8_greedy_tokens_identical_to_tp1(report8):
    one, eight = report8["1"], report8["8"]
    assert one["tokens"] and all(len(t) == 10 for t in one["tokens"])
    assert eight["tokens"] == one["tokens"] and eight["texts"] == one["texts"]


def test_tp8_splits_weights_and_repeats_each_kv_head_on_four_devices(report8):
    one, eight = report8["1"], report8["8"]
    params, column, row = eight["params"], [None, "tp"], ["tp", None]   # [in, out] weights
    assert eight["param_devices"] == 8 and one["param_devices"] == 1
    assert params["qkv"] == params["gate_up"] == params["embed"] == column
    assert params["o"] == params["down"] == params["lm_head"] == row and params["norm"] == []
    assert eight["qkv_blocks_local"]   # 2 kv heads: each device's block holds its head's k/v
    assert one["cache_shape"][0] == 2 and eight["cache_shape"][0] == 8
    assert eight["cache_spec"] == ["tp"] and eight["cache_shard_shape"][0] == 1
    assert eight["cache_devices"] == 8 and eight["manager_replicated"]
    assert eight["kv_copies_equal"] is True   # the model wrote all four copies of both heads
    assert eight["shard_maps"] == 2 * eight["num_layers"]


def test_tp8_refuses_a_model_with_four_query_heads(report8):
    assert "tensor_parallel_size=8 must divide num_attention_heads=4" \
        in report8["too_few_heads_error"]


def test_param_spec_rules():
    config = ModelConfig.preset("llama3-8b")   # 32 heads, 8 kv heads, vocab 128256
    spec = lambda name, shape, size: parallel.param_spec(name, shape, config, size)
    # projection weights are [in, out]
    assert spec("model.layers.3.self_attn.qkv_proj.weight", (4096, 6144), 2) == P(None, "tp")
    assert spec("model.layers.3.self_attn.qkv_proj.weight", (4096, 8192), 16) == P(None, "tp")
    assert spec("model.layers.3.self_attn.qkv_proj.bias", (6144,), 2) == P("tp")
    assert spec("model.layers.3.mlp.gate_up_proj.weight", (4096, 28672), 8) == P(None, "tp")
    assert spec("model.layers.3.mlp.gate_up_proj.weight", (4096, 28672), 3) == P()
    assert spec("model.layers.3.self_attn.o_proj.weight", (4096, 4096), 2) == P("tp", None)
    assert spec("model.layers.3.self_attn.o_proj.bias", (4096,), 2) == P()
    assert spec("model.layers.3.mlp.down_proj.weight", (14336, 4096), 4) == P("tp", None)
    assert spec("model.embed_tokens.weight", (128256, 4096), 2) == P(None, "tp")
    assert spec("lm_head.weight", (128256, 4096), 8) == P("tp", None)
    assert spec("lm_head.weight", (128255, 4096), 2) == P()   # uneven: stays whole
    assert spec("model.layers.0.input_layernorm.weight", (4096,), 2) == P()


def test_heads_must_split_evenly():
    config = ModelConfig.preset("llama3-8b")

    class Sized:
        shape = {parallel.AXIS: 3}

    with pytest.raises(ValueError, match="num_attention_heads"):
        parallel.check_config(config, Sized())
    Sized.shape = {parallel.AXIS: 16}
    parallel.check_config(config, Sized())   # 16 is a multiple of 8 kv heads
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        parallel.make_mesh(0)
    with pytest.raises(ValueError, match="devices are visible"):
        parallel.make_mesh(len(jax.devices()) + 1)
    assert parallel.make_mesh(1) is None
    assert parallel.num_cache_kv_heads(2, None) == 2


def test_engine_config_checks_tensor_parallel_settings():
    with pytest.raises(ValueError, match="recompute"):
        EngineConfig(num_kv_blocks=8, tensor_parallel_size=2)
    EngineConfig(num_kv_blocks=8, tensor_parallel_size=2, preemption_mode="recompute")

    class Model:
        mesh = None

    with pytest.raises(ValueError, match="split over 1 device"):
        build_engine_config(Model(), tensor_parallel_size=2)


# ---- data-parallel replicas --------------------------------------------------------------------
def test_data_parallel_server_spreads_requests_over_disjoint_replicas(report):
    dp = report["dp"]
    assert dp["texts"] == report["1"]["texts"]   # greedy, whichever replica served it
    assert dp["devices"] == [[0, 1], [2, 3]]
    assert all(count > 0 for count in dp["num_routed"]) and sum(dp["num_routed"]) == 4
    assert dp["replica_labels"] == ["0", "1"]


class _FakeReplica:
    """What the router reads of an AsyncEngine: its stats snapshot, block size, add/abort."""

    def __init__(self, free_blocks: int):
        self.snapshot = {"num_free_blocks": free_blocks}
        self.engine = type("E", (), {"config": type("C", (), {"block_size": 16})})()
        self.model_name = "m"
        self.metrics = None
        self.added, self.aborted = [], []

    def add(self, sink, request_id, params, *, prompt_token_ids):
        self.added.append((request_id, sink))

    def abort(self, request_id):
        self.aborted.append(request_id)


class _Sink:
    def __init__(self):
        self.events = []

    def put(self, event):
        self.events.append(event)


def test_router_picks_most_free_blocks_counting_unscheduled_prompts():
    assert pick_replica([10, 50, 30]) == 1 and pick_replica([5, 5]) == 0
    replicas = [_FakeReplica(10), _FakeReplica(50), _FakeReplica(30)]
    router = DataParallelEngine(replicas)
    router.add(_Sink(), "a", None, prompt_token_ids=[1] * (16 * 25))   # 25 blocks -> replica 1
    router.add(_Sink(), "b", None, prompt_token_ids=[1] * 16)          # 50 - 25 < 30 -> replica 2
    assert [len(r.added) for r in replicas] == [0, 1, 1]
    # replica 1 schedules "a": its snapshot now shows the blocks, the router stops counting them
    replicas[1].snapshot = {"num_free_blocks": 25}
    sink_a = replicas[1].added[0][1]
    output = type("O", (), {"finished": False})()
    sink_a.put(("output", "a", output))
    sink_a.put(("output", "a", output))        # settling twice changes nothing
    assert router._unscheduled == [0, 0, 1]
    router.add(_Sink(), "c", None, prompt_token_ids=[1] * 16)          # 25 - 0 < 30 - 1 -> 2
    assert [len(r.added) for r in replicas] == [0, 1, 2]
    router.abort("b")
    assert replicas[2].aborted == ["b"] and router._unscheduled == [0, 0, 1]
    router.abort("unknown")                    # ignored
    assert router.num_routed == [0, 1, 2]


def test_router_is_thread_safe_under_concurrent_adds():
    replicas = [_FakeReplica(1000), _FakeReplica(1000)]
    router = DataParallelEngine(replicas)
    threads = [threading.Thread(target=lambda i=i: router.add(
        _Sink(), f"r{i}", None, prompt_token_ids=[1] * 16)) for i in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [len(r.added) for r in replicas] == [20, 20]   # 1 block each, alternating


# ---- multi-host ----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_multihost_two_processes_on_loopback(hf_checkpoints, report):
    """Two processes with two CPU devices each join through jax.distributed; TP=4 spans both
    (gloo collectives between them) and generates what one device does."""
    port = str(_free_port())
    processes = [_worker("multihost", hf_checkpoints["llama_gqa"], port, str(rank), "2",
                         devices=2) for rank in range(2)]
    try:
        results = [_result(process) for process in processes]
    finally:  # one failed process leaves the other waiting for its peer
        for process in processes:
            if process.poll() is None:
                process.kill()
    for result in results:
        assert (result["process_count"], result["global_devices"], result["local_devices"]) \
            == (2, 4, 2)
        assert result["tokens"] == report["1"]["tokens"]


def test_server_flags(capsys):
    from jpaged import serve

    args = serve.parse_args(["--tensor-parallel-size", "2", "--data-parallel-size", "3"])
    assert serve.engine_options(args)["tensor_parallel_size"] == 2
    assert args.data_parallel_size == 3
    assert serve.engine_options(serve.parse_args([]))["tensor_parallel_size"] == 1
    with pytest.raises(SystemExit):
        serve.parse_args(["--data-parallel-size", "0"])
    assert "--data-parallel-size" in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs 6 devices"):
        parallel.device_groups(3, 2, devices=["d0", "d1", "d2", "d3"])
    assert parallel.device_groups(2, 2, devices="abcd") == [["a", "b"], ["c", "d"]]
