"""Runs in a subprocess for tests/test_moe.py on 2 forced CPU devices (the pytest worker's JAX
backend started with one): a mixture of experts split by tensor and by expert parallelism.

python -m tests.moe_worker CHECKPOINT...
    per checkpoint and per split (tensor, expert): the engine's greedy tokens and stats with every
    feature of tests/families_worker.py, and the partition specs of layer 0's expert weights;
    then one SparseMoE layer, float32, on the mesh against itself on one device, for token
    counts that leave a device without rows. Prints one JSON line.
"""

import dataclasses
import json
import sys

import numpy as np

DEVICES = 2


def engine_runs(checkpoint: str) -> dict:
    from tests import families_worker

    runs = {}
    for split, expert_parallel in (("tensor", False), ("expert", True)):
        runs[split] = families_worker.run(checkpoint, DEVICES, expert_parallel)
        runs[split]["specs"] = expert_specs(checkpoint, expert_parallel)
    return runs


def expert_specs(checkpoint: str, expert_parallel: bool) -> dict:
    from jpaged import parallel
    from jpaged.models import load_model

    model, _ = load_model(checkpoint, mesh=parallel.make_mesh(DEVICES),
                          expert_parallel=expert_parallel)
    experts = model.model.layers[0].mlp.experts
    return {name: str(tuple(getattr(experts, name)[...].sharding.spec))
            for name in ("gate_up_proj", "down_proj")}


def layer_errors() -> dict:
    """{split: max |mesh - one device| / max |one device|} over 1, 3 and 40 tokens."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jpaged import parallel
    from jpaged.config import ModelConfig
    from jpaged.models.moe import SparseMoE

    errors = {}
    for split, expert_parallel in (("tensor", False), ("expert", True)):
        config = ModelConfig.from_dict(dict(
            architectures=["Qwen3MoeForCausalLM"], vocab_size=32, hidden_size=16,
            intermediate_size=8, moe_intermediate_size=8, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, head_dim=8, num_experts=8,
            num_experts_per_tok=3, norm_topk_prob=False))
        config = dataclasses.replace(config, experts=dataclasses.replace(
            config.experts, expert_parallel=expert_parallel))

        single = SparseMoE(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
        rng = np.random.default_rng(0)
        for var in (single.gate.weight, single.experts.gate_up_proj, single.experts.down_proj):
            var[...] = jnp.asarray(rng.standard_normal(var[...].shape) * 0.5, jnp.float32)
        mesh = parallel.make_mesh(DEVICES)
        sharded = SparseMoE(config, dtype=jnp.float32, rngs=nnx.Rngs(0), mesh=mesh)
        sharded.gate.weight[...] = single.gate.weight[...]
        # the tensor split packs each expert's gate/up columns in per-device blocks
        gate_up = np.asarray(single.experts.gate_up_proj[...])
        if not expert_parallel:
            gate, up = np.split(gate_up, 2, axis=-1)
            blocks = [np.concatenate([g, u], axis=-1) for g, u in
                      zip(np.split(gate, DEVICES, axis=-1), np.split(up, DEVICES, axis=-1))]
            gate_up = np.concatenate(blocks, axis=-1)
        for name, value in (("gate_up_proj", gate_up),
                            ("down_proj", np.asarray(single.experts.down_proj[...]))):
            spec = parallel.expert_spec(name, expert_parallel)
            getattr(sharded.experts, name)[...] = jax.device_put(
                value, jax.sharding.NamedSharding(mesh, spec))
        worst = 0.0
        for num_tokens in (1, 3, 40):
            x = jnp.asarray(rng.standard_normal((num_tokens, 16)), jnp.float32)
            expected = np.asarray(single(x, "highest"))
            got = np.asarray(jax.jit(lambda x: sharded(x, "highest"))(x))
            worst = max(worst, float(np.abs(got - expected).max() / np.abs(expected).max()))
        errors[split] = worst
    return errors


def main(argv) -> None:
    report = {path: engine_runs(path) for path in argv}
    report["layer_errors"] = layer_errors()
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
