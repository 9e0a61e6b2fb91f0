"""Requests in: prompts tokenized once and checked against the engine's limits, sampling
parameters checked, seeds drawn, stop ids resolved. Nothing here touches the device or a queue:
a bad request raises ValueError naming the problem and leaves the engine as it was."""

import itertools

import numpy as np

from jpaged.request import Request
from jpaged.sampling_params import (MAX_LOGPROBS, MAX_TEMPERATURE, RequestOutputKind,
                                    SamplingParams, request_seed)
from jpaged.structured_outputs import ConstraintCompiler

# A scoring request (`InputProcessor.score_item`): one greedy token, the prompt's logprobs, no
# text (its caller reads arrays).
SCORE_PARAMS = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0,
                              output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False)


class InputProcessor:
    """Turns (prompt or prompt_token_ids, SamplingParams) into a `Request` ready to queue."""

    def __init__(self, tokenizer, model_config, config):
        self.tokenizer = tokenizer
        self.vocab_size = model_config.vocab_size
        self.eos_token_ids = tuple(model_config.eos_token_ids)
        self.config = config
        self.window = model_config.window_of_every_layer   # blocks behind it are let go
        self._rng = np.random.default_rng(config.seed)
        self._arrivals = itertools.count()
        self.constraints = ConstraintCompiler(tokenizer, model_config.vocab_size,
                                              self.eos_token_ids)

    def prompt_tokens(self, prompt=None, prompt_token_ids=None) -> list[int]:
        """The prompt's token ids: exactly one of a str (tokenized here) and a list of ids."""
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompt and prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a str, got {type(prompt).__name__}")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: pass prompt_token_ids")
            token_ids = self.tokenizer.encode(prompt).ids
        else:
            token_ids = [int(t) for t in prompt_token_ids]
        if not token_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids contains ids outside [0, {self.vocab_size}): "
                             f"{bad[:5]}")
        return token_ids

    def check_fits(self, token_ids: list[int], params: SamplingParams):
        """Could this request ever run on this engine (length, n, KV blocks, logprobs, stop ids and
        biased ids in the vocabulary)?"""
        config = self.config
        if len(token_ids) >= config.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; max_model_len is "
                             f"{config.max_model_len} (the prompt plus at least one generated "
                             "token must fit)")
        if params.n > config.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={config.max_num_seqs}")
        total = min(len(token_ids) + params.max_tokens, config.max_model_len)
        blocks = params.n * self.blocks_per_sequence(total)
        usable = config.num_kv_blocks - 1
        if blocks > usable:
            raise ValueError(f"request needs up to {blocks} KV blocks ({params.n} x {total} "
                             f"tokens) but the pool has only {usable}: it could never run")
        if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
            raise ValueError(f"logprobs={params.logprobs} exceeds {MAX_LOGPROBS}")
        if params.prompt_logprobs is not None and config.strict_compilation:
            # Scoring steps are program variants warm-up does not compile (one per count of
            # scored positions): refused here rather than failing a step later.
            raise ValueError("prompt_logprobs (and score) compile their own step programs on "
                             "first use, which strict_compilation forbids")
        for name, ids in (("stop_token_ids", params.stop_token_ids),
                          ("logit_bias", [t for t, _ in params.logit_bias])):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} contains ids outside [0, {self.vocab_size}) (the "
                                 f"vocabulary): {bad[:5]}")
        for name in ("logit_bias", "structured_outputs"):
            if getattr(params, name) and config.strict_compilation:
                # A batch with such a row runs a program variant warm-up does not compile.
                raise ValueError(f"{name} compiles its own step programs on first use, which "
                                 "strict_compilation forbids")
        if params.structured_outputs is not None:
            self.constraints.constraint(params.structured_outputs)   # compiled (or cached) now

    def blocks_per_sequence(self, total: int) -> int:
        """Most blocks one sequence of `total` tokens holds at once. Where every layer slides a
        window W, the blocks wholly behind it go back to the pool before each step
        (`BlockLedger.trim_window`), so a sequence holds at most the window, what one step
        (or the decode loops chained before the next trim) adds, and a partial block at each
        end: (W + step tokens) / S + 2."""
        config = self.config
        blocks = -(-total // config.block_size)
        if self.window is None:
            return blocks
        step = max(config.max_num_batched_tokens,
                   config.num_scheduler_steps * (config.async_depth + 1))
        return min(blocks, (self.window + step) // config.block_size + 2)

    def stop_ids(self, params: SamplingParams) -> tuple[int, ...]:
        """Token ids that end a sequence on the device: stop_token_ids, and EOS unless ignored."""
        ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            ids += [t for t in self.eos_token_ids if t not in ids]
        return tuple(ids)

    def check(self, prompt=None, params: SamplingParams | None = None, *,
              prompt_token_ids=None) -> tuple[list[int], SamplingParams]:
        """(token ids, params) of a request that can run here; ValueError otherwise. A str prompt
        is tokenized here (once)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params)}")
        token_ids = self.prompt_tokens(prompt, prompt_token_ids)
        self.check_fits(token_ids, params)
        return token_ids, params

    def build(self, request_id: str, prompt: str | None, token_ids: list[int],
              params: SamplingParams, priority: int = 0, score_from: int = 1,
              score_temperature: float = 1.0) -> Request:
        """The Request of a checked prompt: its seed drawn and its arrival counted now.
        score_from, score_temperature: which prompt logprobs it owes, and under what
        temperature (see `Request`)."""
        stop_ids = self.stop_ids(params)
        constraint = (None if params.structured_outputs is None
                      else self.constraints.constraint(params.structured_outputs))
        return Request(request_id=request_id, prompt=prompt, prompt_token_ids=token_ids,
                       params=params, seed=request_seed(params, self._rng),
                       arrival_index=next(self._arrivals), priority=priority,
                       stop_ids=stop_ids, stop_id_set=frozenset(stop_ids),
                       score_from=score_from, score_temperature=score_temperature,
                       constraint=constraint)

    def score_item(self, request_id: str, prompt_token_ids, completion_token_ids,
                   temperature: float) -> dict:
        """The add_requests item that scores completion after prompt: a request whose prompt
        is both, owing the logprobs of the completion's tokens only, sampling one greedy token
        (the least a request can generate). ValueError on an empty prompt or a temperature
        outside (0, MAX_TEMPERATURE]."""
        prompt, completion = list(prompt_token_ids), list(completion_token_ids)
        if not prompt:
            raise ValueError("score needs a non-empty prompt (the first completion token's "
                             "logprob needs something before it)")
        if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                or not 0 < temperature <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be in (0, {MAX_TEMPERATURE:g}], "
                             f"got {temperature!r}")
        return dict(request_id=request_id, prompt_token_ids=prompt + completion,
                    params=SCORE_PARAMS,
                    score_from=len(prompt), score_temperature=float(temperature))
