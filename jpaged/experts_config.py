"""A mixture-of-experts MLP's settings (`ExpertsConfig`) and how Mixtral's and Qwen3-MoE's
config.json spell them (`read_experts`)."""

import dataclasses

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")


@dataclasses.dataclass(frozen=True)
class ExpertsConfig:
    """A mixture-of-experts MLP (Mixtral, Qwen3-MoE): each token's `num_experts_per_tok` experts
    of `num_local_experts`, picked by a softmax router, each a gated MLP of
    `moe_intermediate_size`; their outputs summed with the routing weights.

    norm_topk_prob: the chosen experts' probabilities renormalised to sum to one (Mixtral
    always; Qwen3-MoE as its config says). float32_weights: the routing weights scale the expert
    outputs in float32 (Mixtral) rather than cast to the model dtype first (Qwen3-MoE), as each
    transformers architecture does. sparse_layers[i]: layer i routes (else it has a dense MLP of
    the model's intermediate_size: Qwen3-MoE's `mlp_only_layers` and `decoder_sparse_step`).
    expert_parallel: not the checkpoint's but how a mesh splits the experts (the engine's
    enable_expert_parallel): whole experts per device, or every expert's intermediate dimension
    (`jpaged.parallel`).
    """
    num_local_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    float32_weights: bool
    sparse_layers: tuple
    expert_parallel: bool = False

    def __post_init__(self):
        for name in ("num_local_experts", "num_experts_per_tok", "moe_intermediate_size"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be at most "
                             f"num_local_experts ({self.num_local_experts})")


def canonical_expert_count(raw: dict, source: str) -> dict:
    """raw with the number of experts under `num_local_experts` (Qwen3-MoE's checkpoints call it
    `num_experts`; transformers 5 writes either name)."""
    if "num_experts" not in raw:
        return raw
    raw = dict(raw)
    count = raw.pop("num_experts")
    if raw.get("num_local_experts", count) != count:
        raise ValueError(f"{source}: fields 'num_experts' ({count}) and 'num_local_experts' "
                         f"({raw['num_local_experts']}) disagree")
    raw["num_local_experts"] = count
    return raw


def read_experts(raw: dict, arch: str) -> ExpertsConfig | None:
    """The mixture-of-experts MLP of a MoE architecture (None for the dense ones), with each
    transformers architecture's routing: Mixtral routes every layer with renormalised float32
    weights and experts of intermediate_size; Qwen3-MoE as its config says."""
    if arch not in MOE_ARCHITECTURES:
        return None
    layers = int(raw["num_hidden_layers"])
    if arch == "MixtralForCausalLM":
        return ExpertsConfig(
            num_local_experts=int(raw["num_local_experts"]),
            num_experts_per_tok=int(raw["num_experts_per_tok"]),
            moe_intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=True,
            float32_weights=True, sparse_layers=(True,) * layers)
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in raw.get("mlp_only_layers") or ()}
    return ExpertsConfig(
        num_local_experts=int(raw["num_local_experts"]),
        num_experts_per_tok=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw["moe_intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)), float32_weights=False,
        sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)))
