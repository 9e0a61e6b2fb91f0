"""`JpagedRollout`: jpaged as the rollout engine of Tunix's RL trainers (`RLCluster`, GRPO).

Give it to Tunix as `ClusterConfig(rollout_engine=JpagedRollout)`, or
`functools.partial(JpagedRollout, **llm_options)` to set engine options. The engine is built
from the actor Tunix passes: its config mapped to jpaged's (`tunix_weights.model_config`), its
weights converted where they live, on the device (no checkpoint on disk, no host round trip).
`model=HF_DIR` builds it from a Hugging Face checkpoint of the same network instead (checked
against the actor field by field). Either way the actor's weights are pushed into the engine at
construction and at every `sync_weights`.

Log-probabilities are what Tunix's learner computes for the same tokens: log_softmax of
`logits / temperature` over the whole vocabulary, with the rollout config's temperature (1 when
it is 0, as Tunix does). Sampled-token logprobs come straight from sampling when the engine
reports them that way (`logprobs_mode="processed_logprobs"`, no top-k/top-p/min-p filtering);
otherwise the samples are scored again with `LLM.score`.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.rl.rollout import base_rollout

from jpaged import parallel
from jpaged.config import normalize_dtype
from jpaged.engine.llm_engine import LLMEngine
from jpaged.integrations.tunix_weights import check_configs, hf_weights, model_config
from jpaged.llm import LLM
from jpaged.models.weights import model_from_weights
from jpaged.options import LOADING_OPTIONS, OptionError, check_options
from jpaged.sampling_params import RequestOutputKind, SamplingParams


# Decode steps per device loop unless the options say otherwise. A rollout hands the engine
# all its prompts at once and reads no stream, so nothing waits on a loop's end; one step per
# scheduler step left the GRPO benchmark's rollout host-bound (~1.8 ms of host time per token
# step on an H100 for a 285M model). Steps of a loop past the end of all its rows (stopped
# early by EOS) run masked: 8 amortizes the host's share with at most 7 of those per rollout.
SCHEDULER_STEPS = 8


# JAX's default matmul precision setting (`jax_default_matmul_precision`, the names it takes
# for the three precisions) -> the engine's `matmul_precision`.
_JAX_PRECISIONS = {None: "default", "default": "default", "bfloat16": "default",
                   "high": "high", "tensorfloat32": "high", "highest": "highest",
                   "float32": "highest"}


def trainer_matmul_precision() -> str:
    """The precision Tunix's models compute their matmuls at: JAX's default (they pass none),
    so the rollout samples from the function the trainer trains. On a GPU that is TF32 for
    float32 parameters unless `jax_default_matmul_precision` says otherwise; a dot algorithm
    named there has no engine equivalent and raises, naming the setting."""
    setting = jax.config.jax_default_matmul_precision
    if setting not in _JAX_PRECISIONS:
        raise OptionError("matmul_precision", f"jax_default_matmul_precision is {setting!r}, "
                          "which the engine cannot match; pass matmul_precision= "
                          f"(one of {sorted(set(_JAX_PRECISIONS.values()))})")
    return _JAX_PRECISIONS[setting]


class JpagedRollout(base_rollout.BaseRollout):
    """A Tunix rollout worker backed by a jpaged `LLM` (`self.llm`).

    Tunix passes rollout_actor, tokenizer (its TokenizerAdapter), mesh and rollout_config;
    `model` (None: build from the actor) and the `LLM` options come from the partial. The mesh
    is not used: the engine takes its devices from its own options (`devices`,
    `tensor_parallel_size`). `max_model_len` defaults to the rollout config's kv_cache_size,
    `logprobs_mode` to "processed_logprobs", `num_scheduler_steps` to SCHEDULER_STEPS,
    `matmul_precision` to the trainer's (`trainer_matmul_precision`: TF32 for a float32 model
    on a GPU, where a plain jpaged engine computes float32 in full); `dtype`, for an engine
    built from the actor, to its parameters' dtype.
    """

    def __init__(self, rollout_actor: nnx.Module, tokenizer: Any, mesh=None,
                 rollout_config: base_rollout.RolloutConfig | None = None, *,
                 model: str | None = None, **llm_options):
        self._model = _abstract_copy(rollout_actor)
        self._tokenizer = tokenizer
        self._config = rollout_config or base_rollout.RolloutConfig()
        llm_options.setdefault("logprobs_mode", "processed_logprobs")
        llm_options.setdefault("num_scheduler_steps", SCHEDULER_STEPS)
        llm_options.setdefault("max_model_len", self._config.kv_cache_size)
        if "matmul_precision" not in llm_options:
            llm_options["matmul_precision"] = trainer_matmul_precision()
        self._is_processed = llm_options["logprobs_mode"] == "processed_logprobs"
        if model is None:
            self.llm = self._llm_from_actor(rollout_actor, llm_options)
            return
        self.llm = LLM(model, **llm_options)
        check_configs(rollout_actor, self.llm.engine.model_config)
        self.update_params(nnx.state(rollout_actor, nnx.Param))

    def _llm_from_actor(self, actor: nnx.Module, options: dict) -> LLM:
        """The engine over the actor's network and weights (see the module docstring)."""
        options = check_options(options)   # every option named before anything is built
        if options["load_format"] != "auto":
            raise OptionError("load_format", "load_format applies to a checkpoint (model=); "
                              "the rollout built from the actor takes the actor's weights")
        eos = () if self._tokenizer is None else (self._tokenizer.eos_id(),)
        config = model_config(actor, max_model_len=options["max_model_len"],
                              eos_token_ids=[i for i in eos if i is not None])
        if options["enable_expert_parallel"]:
            raise OptionError("enable_expert_parallel", "the actor is a dense model")
        mesh = parallel.make_mesh(options["tensor_parallel_size"], options["devices"])
        dtype = (config.torch_dtype if options["dtype"] == "auto"
                 else normalize_dtype(options["dtype"]))
        weights = hf_weights(nnx.state(actor, nnx.Param),
                             tie_word_embeddings=config.tie_word_embeddings)
        with jax.transfer_guard_host_to_device("allow"):
            built = model_from_weights(config, weights, dtype=dtype, mesh=mesh)
        engine_options = {name: options[name] for name in options
                          if name not in LOADING_OPTIONS}
        return LLM.from_engine(LLMEngine.from_model(built, **engine_options))

    # ---- weights ------------------------------------------------------------------------------
    def update_params(self, params, filter_types=None) -> None:
        """Tunix's Param state (full model) -> jpaged's weights, converted on the device."""
        if filter_types is not None and nnx.LoRAParam in tuple(filter_types):
            raise NotImplementedError("JpagedRollout syncs full weights; merge LoRA adapters "
                                      "into the base model before syncing")
        if not any(isinstance(leaf, jax.Array) for leaf in jax.tree_util.tree_leaves(params)):
            return   # `model()`'s own shapes handed back (Tunix's offload path): nothing new
        tied = self.llm.engine.model_config.tie_word_embeddings
        weights = hf_weights(params, tie_word_embeddings=tied)
        # Tunix syncs on CPU under transfer guards that forbid every host<->device copy. The
        # weights stay on the device; the engine still sends a few block indices to it (freeing
        # the prefix cache), so host-to-device is allowed and device-to-host, the direction
        # a weights round trip would need, stays forbidden.
        with jax.transfer_guard_host_to_device("allow"):
            self.llm.update_weights(weights)

    # ---- generation ---------------------------------------------------------------------------
    def generate(self, prompts: list[str], rollout_config: base_rollout.RolloutConfig,
                 **kwargs) -> base_rollout.RolloutOutput:
        prompt_ids = [self._tokenize(prompt) for prompt in prompts]
        outputs = self.llm.generate(prompt_token_ids=prompt_ids, use_tqdm=False,
                                    sampling_params=self._sampling_params(rollout_config,
                                                                          len(prompts)))
        tokens = [np.asarray(out.outputs[0].token_ids, np.int32) for out in outputs]
        logprobs = None
        if rollout_config.return_logprobs:
            logprobs = self._sample_logprobs(rollout_config, prompt_ids, tokens, outputs)
        return base_rollout.RolloutOutput(
            text=[self._tokenizer.decode(t.tolist()) for t in tokens],
            logits=None,
            tokens=tokens,
            left_padded_prompt_tokens=self._left_padded(prompt_ids,
                                                        rollout_config.max_prompt_length),
            logprobs=logprobs,
        )

    def _tokenize(self, prompt: str) -> list[int]:
        """As Tunix's sampler does: one BOS in front (when the tokenizer has one)."""
        ids = list(self._tokenizer.encode(str(prompt)))   # Tunix hands numpy strings
        bos = self._tokenizer.bos_id()
        if bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def _sampling_params(self, config, count: int) -> list[SamplingParams]:
        eos = config.eos_tokens if config.eos_tokens is not None else [self.eos_id()]
        # Tunix's trainer reads the pad id as padding wherever it stands, and scores what
        # follows without it: a sample that went on past a sampled pad would be trained on as
        # another sequence than the one sampled (logprobs off by 1e-2 on a random model), so a
        # sampled pad ends the sample, as EOS does (a pad id past the vocabulary is never sampled).
        pad = self.pad_id()
        is_samplable = pad is not None and 0 <= pad < self.llm.engine.model_config.vocab_size
        stops = [*eos, *([pad] if is_samplable and pad not in eos else [])]
        seed = None if config.seed is None else int(np.asarray(config.seed).reshape(-1)[0])
        return [SamplingParams(
            temperature=config.temperature, top_p=1.0 if config.top_p is None else config.top_p,
            top_k=-1 if config.top_k is None else config.top_k,
            max_tokens=config.max_tokens_to_generate, stop_token_ids=stops,
            # a seed per sample: the G samples of one prompt must differ
            seed=None if seed is None else seed + i,
            logprobs=0 if config.return_logprobs else None,
            output_kind=RequestOutputKind.FINAL_ONLY,   # what LLM.generate runs with
            # the samples' text is Tunix's tokenizer's decode (`generate`), not the engine's
            detokenize=False) for i in range(count)]

    def _sample_logprobs(self, config, prompt_ids, tokens, outputs) -> list[np.ndarray]:
        is_filtered = (config.top_k not in (None, -1)) or (config.top_p not in (None, 1.0))
        if self._is_processed and config.temperature > 0 and not is_filtered:
            return [np.asarray([entry[token] for entry, token in
                                zip(out.outputs[0].logprobs, out.outputs[0].token_ids)],
                               np.float32) for out in outputs]
        return self.llm.score(prompt_ids, [t.tolist() for t in tokens],
                              temperature=_trainer_temperature(config.temperature))

    def _left_padded(self, prompt_ids: list[list[int]], width: int) -> np.ndarray:
        """[B, width] int32; width grows to the next power of two past the longest prompt, as
        Tunix's sampler does."""
        longest = max(len(ids) for ids in prompt_ids)
        if longest > width:
            width = 1 << (longest - 1).bit_length()
        padded = np.full((len(prompt_ids), width), self.pad_id(), np.int32)
        for row, ids in enumerate(prompt_ids):
            padded[row, width - len(ids):] = ids
        return padded

    # ---- scoring ------------------------------------------------------------------------------
    def get_per_token_logps(self, prompt_tokens: jax.Array,
                            completion_tokens: jax.Array) -> jax.Array:
        """[B, C] float32 from left-padded prompts [B, P] and right-padded completions [B, C]:
        each completion token's logprob at the rollout temperature, 0 at pad positions. Pads
        are dropped before scoring, as Tunix's own forward masks them and skips their
        positions."""
        prompts, completions = np.asarray(prompt_tokens), np.asarray(completion_tokens)
        pad = self.pad_id()
        is_real = completions != pad
        scored = self.llm.score([row[row != pad].tolist() for row in prompts],
                                [row[mask].tolist() for row, mask in zip(completions, is_real)],
                                temperature=_trainer_temperature(self._config.temperature))
        logps = np.zeros(completions.shape, np.float32)
        for row, values in enumerate(scored):
            logps[row, is_real[row]] = values
        return jnp.asarray(logps)

    # ---- ids and model ------------------------------------------------------------------------
    def pad_id(self) -> int:
        return self._tokenizer.pad_id()

    def eos_id(self) -> int:
        return self._tokenizer.eos_id()

    def model(self) -> nnx.Module:
        """The actor's structure with shapes for values: the weights live in the engine. It
        must not share the trainer's arrays, or Tunix decides the rollout needs no sync."""
        return self._model


def _abstract_copy(model: nnx.Module) -> nnx.Module:
    """`model` with a jax.ShapeDtypeStruct in place of every array (no memory)."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                            state))


def _trainer_temperature(temperature: float) -> float:
    """Tunix's learner divides logits by the temperature unless it is 0 (greedy) or 1."""
    return 1.0 if temperature == 0 else float(temperature)
