"""Weight sync for reinforcement-learning rollouts: seconds of `LLMEngine.update_weights` for a
preset's shape with dummy weights, from (a) jax arrays already on the device(s) with the engine's
sharding (what `get_weights` returns, as a trainer on the same devices would hand them over) and
(b) host numpy arrays (a trainer elsewhere); and, in the same run, the host-to-device bandwidth
that bounds (b): one large buffer from pinned host memory and from ordinary (pageable) numpy
memory, `device_put` then `block_until_ready`. Prints a markdown table.

Usage: python benchmarks/weight_sync.py --preset llama3-8b --repeats 5
       python benchmarks/weight_sync.py --preset tiny --repeats 2        (seconds, on the CPU)
"""

import argparse
import datetime
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.timing import median_seconds  # noqa: E402
from jpaged import LLMEngine, parallel  # noqa: E402
from jpaged.config import ModelConfig  # noqa: E402
from jpaged.models import random_model  # noqa: E402

PROBE_BYTES = 1 << 30   # host-to-device probe size, capped at the model's bytes


def build_engine(config: ModelConfig, dtype: str, tensor_parallel_size: int) -> LLMEngine:
    """An engine over dummy weights (load_format "dummy"'s draw) with a small KV pool; nothing
    runs a step (recompute preemption: no start-up swap measurement)."""
    mesh = parallel.make_mesh(tensor_parallel_size)
    model = random_model(config, dtype=jnp.dtype(dtype), mesh=mesh)
    return LLMEngine.from_model(model, None, num_kv_blocks=64, max_num_seqs=4,
                                max_model_len=min(1024, config.max_model_len),
                                max_num_batched_tokens=128, preemption_mode="recompute",
                                tensor_parallel_size=tensor_parallel_size, warmup=False)


def time_update(engine: LLMEngine, weights, repeats: int) -> float:
    """Median seconds of one update_weights until every new parameter is on the device."""
    def update():
        engine.update_weights(weights)
        jax.block_until_ready(engine.executor.param_leaves)
    return median_seconds(update, repeats)


def host_to_device(num_bytes: int, repeats: int) -> dict[str, float]:
    """{"pinned": bytes/s, "pageable": bytes/s} of one buffer onto the first device; pinned is
    NaN where the backend has no pinned host memory."""
    device = jax.devices()[0]
    host = np.ones(num_bytes // 2, jnp.bfloat16)
    rates = {"pageable": num_bytes / median_seconds(
        lambda: jax.block_until_ready(jax.device_put(host, device)), repeats)}
    try:
        pinned = jax.device_put(host, jax.sharding.SingleDeviceSharding(
            device, memory_kind="pinned_host"))
    except (ValueError, RuntimeError, jax.errors.JaxRuntimeError):
        return {"pinned": float("nan"), **rates}
    on_device = jax.sharding.SingleDeviceSharding(device)
    rates["pinned"] = num_bytes / median_seconds(
        lambda: jax.block_until_ready(jax.device_put(pinned, on_device)), repeats)
    return rates


def weight_sync(preset: str, *, repeats: int = 5, dtype: str = "bfloat16",
                tensor_parallel_size: int = 1) -> dict:
    """Seconds per update from device and host arrays, the model's bytes, and host-to-device
    bandwidth, for one preset."""
    engine = build_engine(ModelConfig.preset(preset), dtype, tensor_parallel_size)
    on_device = engine.get_weights()
    model_bytes = sum(array.nbytes for array in on_device.values())
    device_seconds = time_update(engine, on_device, repeats)
    print(f"from device arrays: {device_seconds:.4f} s", flush=True)   # kept if a later part
    on_host = {name: np.asarray(array) for name, array in on_device.items()}  # runs out of time
    del on_device
    host_seconds = time_update(engine, on_host, repeats)
    print(f"from host numpy: {host_seconds:.4f} s", flush=True)
    return {"preset": preset, "dtype": dtype, "tensor_parallel_size": tensor_parallel_size,
            "model_bytes": model_bytes, "device_seconds": device_seconds,
            "host_seconds": host_seconds,
            "bandwidth": host_to_device(min(PROBE_BYTES, model_bytes), repeats),
            "num_compilations": engine.stats()["num_compilations"]}


def table(result: dict) -> str:
    gigabytes = result["model_bytes"] / 1e9
    bandwidth = result["bandwidth"]
    rows = [f"{result['preset']} ({result['dtype']}, TP={result['tensor_parallel_size']}, "
            f"{result['model_bytes'] / 1e6:.1f} MB of weights); {jax.devices()[0].device_kind}, "
            f"jax {jax.__version__}, {datetime.date.today()}; "
            f"`python benchmarks/weight_sync.py {' '.join(sys.argv[1:])}`", "",
            "| what | seconds | GB/s |", "|---|---|---|",
            f"| update_weights from device arrays (get_weights) | {result['device_seconds']:.4f} "
            f"| {gigabytes / result['device_seconds']:.3f} |",
            f"| update_weights from host numpy | {result['host_seconds']:.4f} "
            f"| {gigabytes / result['host_seconds']:.3f} |"]
    for kind in ("pinned", "pageable"):
        rows.append(f"| device_put of a {min(PROBE_BYTES, result['model_bytes']) / 1e6:.1f} MB "
                    f"{kind} host buffer | | {bandwidth[kind] / 1e9:.3f} |")
    return "\n".join(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    args = parser.parse_args(argv)
    print(table(weight_sync(args.preset, repeats=args.repeats, dtype=args.dtype,
                            tensor_parallel_size=args.tensor_parallel_size)))


if __name__ == "__main__":
    main()
