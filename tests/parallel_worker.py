"""Runs in a subprocess for tests/test_parallel.py: the device count of JAX's CPU backend is fixed
when it starts (XLA_FLAGS=--xla_force_host_platform_device_count), and the pytest worker's backend
has long started with one device.

python -m tests.parallel_worker tp CHECKPOINT       (4 devices)
    greedy tokens and texts at tensor_parallel_size 1, 2 and 4, plus what tests inspect: the
    shardings of parameters, cache and block manager, kv-head copies, shard_map count; then the
    server app over two data-parallel replicas of TP=2, driven with concurrent requests (in the
    same process, so the first replica reuses the TP=2 programs); dummy weights on a mesh. With
    fewer devices (a GPU machine), the TP sizes that fit and replicas of half the devices.
python -m tests.parallel_worker tp8 CHECKPOINT_8_HEADS CHECKPOINT_4_HEADS      (8 devices)
    greedy tokens, shardings and kv-head copies at tensor_parallel_size 1 and 8 on a checkpoint
    with 8 query heads and 2 kv heads (each kv head on 4 devices), and the error TP=8 raises for
    a model with only 4 query heads.
python -m tests.parallel_worker multihost CHECKPOINT PORT PROCESS_ID NUM_PROCESSES
    one process of a jax.distributed run on loopback: TP over every process's devices.
Each mode prints one JSON line last.
"""

import json
import sys

PROMPTS = [[3, 17, 42, 99, 5], list(range(10, 40)), [7] * 12, [200, 201, 13]]
MAX_TOKENS = 10
ENGINE_OPTIONS = dict(num_kv_blocks=64, max_model_len=96, max_num_seqs=4,
                      max_num_batched_tokens=32, block_size=8, preemption_mode="recompute",
                      warmup=False)  # on a GPU warm-up would compile every bucket first
PARAMETERS = {  # parameter name -> short key in the report
    "model.embed_tokens.weight": "embed", "lm_head.weight": "lm_head",
    "model.norm.weight": "norm", "model.layers.0.self_attn.qkv_proj.weight": "qkv",
    "model.layers.0.self_attn.o_proj.weight": "o", "model.layers.0.mlp.gate_up_proj.weight":
    "gate_up", "model.layers.0.mlp.down_proj.weight": "down",
}


def _greedy(llm):
    from jpaged import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], [o.outputs[0].text for o in outputs]


def _constrained(llm) -> dict:
    """A regex-constrained request (sampled, seeded) beside a greedy one, and whether the
    engine's decode loops take constrained rows."""
    from jpaged import SamplingParams, StructuredOutputsParams

    params = [SamplingParams(temperature=1.0, seed=3, max_tokens=20, structured_outputs=
                             StructuredOutputsParams(regex="[a-z]{2,6}( [a-z]{2,6})?")),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)]
    outputs = llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=params, use_tqdm=False)
    return dict(tokens=[o.outputs[0].token_ids for o in outputs],
                text=outputs[0].outputs[0].text,
                finish_reason=outputs[0].outputs[0].finish_reason,
                loops=llm.engine.scheduler.loops_take_constraints)


def _spec(array) -> list:
    """The partition spec as a list ([] for replicated or a single device)."""
    spec = getattr(array.sharding, "spec", ())
    return [axis for axis in spec] if not array.sharding.is_fully_replicated else []


def _count_shard_maps(runner) -> int:
    """shard_map calls in one traced forward pass of the runner's model."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jpaged.models import AttentionMetadata

    model = nnx.merge(runner.graphdef, runner.params)
    tokens = jnp.zeros(4, jnp.int32)
    metadata = AttentionMetadata(
        slot_mapping=jnp.full(4, -1, jnp.int32),
        block_tables=jnp.zeros((1, runner.max_blocks_per_seq), jnp.int32),
        context_lens=jnp.zeros(1, jnp.int32), query_start_loc=jnp.array([0, 4], jnp.int32),
        backend=runner.attention_backend, interpret=runner.interpret)
    jaxpr = jax.make_jaxpr(lambda cache: model(tokens, tokens, cache, metadata))(runner.cache)
    return sum(eqn.primitive.name == "shard_map" for eqn in jaxpr.jaxpr.eqns)


def _describe(llm) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    runner = llm.engine.executor
    flat = {".".join(map(str, path)): var.get_value()
            for path, var in nnx.to_flat_state(runner.params)}
    k_pages = runner.cache.k_pages[0]
    kv_heads = llm.engine.model_config.num_key_value_heads
    # [K * copies, N, S, D] -> [K, copies, N, S, D]: each kv head's copies sit next to each other
    copies = np.asarray(jax.device_get(k_pages)).reshape(kv_heads, -1, *k_pages.shape[1:])
    return {
        "params": {key: _spec(flat[name]) for name, key in PARAMETERS.items()},
        "param_devices": len(flat["lm_head.weight"].sharding.device_set),
        "cache_shape": list(k_pages.shape), "cache_spec": _spec(k_pages),
        "cache_shard_shape": list(k_pages.addressable_shards[0].data.shape),
        "cache_devices": len(k_pages.sharding.device_set),
        "manager_replicated": all(leaf.sharding.is_fully_replicated and
                                  len(leaf.sharding.device_set) == len(k_pages.sharding.device_set)
                                  for leaf in jax.tree_util.tree_leaves(runner.manager)),
        # each kv head repeated on neighbouring devices holds the same keys (and they were written)
        "kv_copies_equal": bool((copies == copies[:, :1]).all() and copies.any())
        if copies.shape[1] > 1 else None,
        "shard_maps": _count_shard_maps(runner),
        "qkv_blocks_local": _qkv_blocks_local(llm),
        "num_layers": llm.engine.model_config.num_hidden_layers,
        "preemption_mode": llm.engine.config.preemption_mode,
    }


def _qkv_blocks_local(llm) -> bool:
    """Each device's block of the packed qkv weight ([in, out]) holds exactly the q features of
    its query heads and the k and v features of the kv head(s) it caches, so the column split
    needs no communication."""
    import numpy as np
    from flax import nnx

    from jpaged.models import checkpoint_tensors

    runner, config = llm.engine.executor, llm.engine.model_config
    model = nnx.merge(runner.graphdef, runner.params)
    hf = {name.rpartition(".")[0].rpartition(".")[2]: np.asarray(array)
          for name, array in checkpoint_tensors(model).items()
          if name.startswith("model.layers.0.self_attn.") and name.endswith("proj.weight")}
    weight = model.model.layers[0].self_attn.qkv_proj.weight[...]
    devices = len(weight.sharding.device_set)
    heads, kv_heads, dim = (config.num_attention_heads, config.num_key_value_heads,
                            config.head_dim)
    cache_heads = max(kv_heads, devices)
    rows = lambda part, head: hf[part][head * dim:(head + 1) * dim]  # noqa: E731
    for shard in weight.addressable_shards:
        block = shard.index[1].start or 0
        device = block // (weight.shape[1] // devices)
        q_heads = range(device * heads // devices, (device + 1) * heads // devices)
        kv = [c * kv_heads // cache_heads
              for c in range(device * cache_heads // devices,
                             (device + 1) * cache_heads // devices)]
        expected = np.concatenate([rows("q_proj", h) for h in q_heads]
                                  + [rows("k_proj", g) for g in kv]
                                  + [rows("v_proj", g) for g in kv])
        if not np.array_equal(np.asarray(shard.data), expected.T):
            return False
    return True


def run_tp(checkpoint: str) -> dict:
    """TP sizes 1, 2 and 4 (those the devices allow), then two data-parallel replicas over half
    the devices each."""
    import jax

    from jpaged import LLM

    report = {}
    for size in (1, 2, 4):
        if size <= jax.device_count():
            llm = LLM(checkpoint, tensor_parallel_size=size, **ENGINE_OPTIONS)
            tokens, texts = _greedy(llm)
            report[size] = dict(tokens=tokens, texts=texts, constrained=_constrained(llm),
                                **_describe(llm))
    report["dp"] = run_dp(checkpoint, max(1, jax.device_count() // 2))
    report["dummy_same_on_mesh"] = _dummy_same_on_mesh(jax.device_count())
    return report


def run_tp8(checkpoint: str, checkpoint_4_heads: str) -> dict:
    """TP=1 and TP=8 on the 8-head checkpoint; TP=8 on the 4-head one must refuse."""
    from jpaged import LLM

    report = {}
    for size in (1, 8):
        llm = LLM(checkpoint, tensor_parallel_size=size, **ENGINE_OPTIONS)
        tokens, texts = _greedy(llm)
        report[size] = dict(tokens=tokens, texts=texts, **_describe(llm))
    try:
        LLM(checkpoint_4_heads, tensor_parallel_size=8, **ENGINE_OPTIONS)
        report["too_few_heads_error"] = None
    except ValueError as error:
        report["too_few_heads_error"] = str(error)
    return report


def _dummy_same_on_mesh(size: int) -> bool:
    """Random (dummy) weights drawn on a mesh equal those drawn on one device."""
    import jax.numpy as jnp
    import numpy as np

    from jpaged import parallel
    from jpaged.config import ModelConfig
    from jpaged.models import checkpoint_tensors, random_model

    config = ModelConfig.preset("tiny")
    one, split = (checkpoint_tensors(random_model(config, dtype=jnp.float32, mesh=mesh))
                  for mesh in (None, parallel.make_mesh(size)))
    return one.keys() == split.keys() and all(
        np.array_equal(np.asarray(one[name]), np.asarray(split[name])) for name in one)


def run_multihost(checkpoint: str, port: str, process_id: str, num_processes: str) -> dict:
    import jax

    from jpaged import LLM, parallel

    parallel.initialize_multihost(f"127.0.0.1:{port}", int(num_processes), int(process_id))
    size = len(jax.devices())
    llm = LLM(checkpoint, tensor_parallel_size=size, **ENGINE_OPTIONS)
    tokens, _ = _greedy(llm)
    return dict(tokens=tokens, process_count=jax.process_count(), global_devices=size,
                local_devices=len(jax.local_devices()))


def run_dp(checkpoint: str, tensor_parallel_size: int) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.testclient import TestClient

    from jpaged import serve
    from jpaged.serve.data_parallel import DataParallelEngine

    router = DataParallelEngine.from_pretrained(checkpoint, "tiny", data_parallel_size=2,
                                                tensor_parallel_size=tensor_parallel_size,
                                                **ENGINE_OPTIONS)
    app = serve.build_app(router, serve.model_info(router.engine, checkpoint, "tiny"))
    body = dict(model="tiny", max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with TestClient(app) as client:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            replies = list(pool.map(lambda prompt: client.post(
                "/v1/completions", json=dict(body, prompt=prompt)).json(), PROMPTS))
        metrics = client.get("/metrics").text
    devices = [sorted(d.id for d in replica.engine.executor.cache.k_pages[0].sharding.device_set)
               for replica in router.replicas]
    labels = {line.split('replica="')[1][0] for line in metrics.splitlines() if 'replica="' in line}
    return dict(texts=[reply["choices"][0]["text"] for reply in replies],
                num_routed=router.num_routed, devices=devices, replica_labels=sorted(labels))


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    result = {"tp": run_tp, "tp8": run_tp8, "multihost": run_multihost}[mode](*args)
    print(json.dumps(result), flush=True)
