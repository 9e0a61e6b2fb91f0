"""`LLM`: the offline API, mirroring vLLM's (`LLM(model, ...)`, `generate`, `stats`)."""

import dataclasses
import itertools
import time

import numpy as np
from tqdm.auto import tqdm

from jpaged.engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from jpaged.engine.llm_engine import LLMEngine, completion_logprobs
from jpaged.options import options_doc
from jpaged.request import RequestOutput
from jpaged.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    __doc__ = f"""Offline batched generation over the continuous-batching engine.

    LLM(model=None, **options): `model` is a Hugging Face directory; None loads the built-in
    model. The options (vLLM's names; `jpaged.options.OPTIONS`, which the server's flags share)
    are checked before anything loads; a bad one raises ValueError naming it:

{options_doc()}"""

    def __init__(self, model=None, **options):
        self._ids = itertools.count()
        self.engine = LLMEngine.from_pretrained(model, **options)

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """The offline API over an engine already built (e.g. `LLMEngine.from_model` on a model
        in memory)."""
        llm = cls.__new__(cls)
        llm._ids, llm.engine = itertools.count(), engine
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts=None, sampling_params=None, *, prompt_token_ids=None,
                 use_tqdm=True) -> list[RequestOutput]:
        """Generate for every prompt (strings, or lists of token ids via prompt_token_ids).

        sampling_params: one SamplingParams for all, or a list with one per prompt. Every input is
        validated before anything runs; results come back in input order.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompt_token_ids is not None and prompt_token_ids and isinstance(
                prompt_token_ids[0], int):
            prompt_token_ids = [prompt_token_ids]
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompts and prompt_token_ids")
        inputs = ([dict(prompt=p) for p in prompts] if prompts is not None
                  else [dict(prompt_token_ids=ids) for ids in prompt_token_ids])
        params = self._params_list(sampling_params, len(inputs))
        # generate returns only finished outputs: no per-step output is built (vLLM does too);
        # each distinct params object is replaced once (replacing validates every field again)
        final_only = {}
        for param in params:
            if isinstance(param, SamplingParams) and id(param) not in final_only:
                final_only[id(param)] = (
                    param if param.output_kind == RequestOutputKind.FINAL_ONLY
                    else dataclasses.replace(param, output_kind=RequestOutputKind.FINAL_ONLY))
        params = [final_only.get(id(param), param) for param in params]
        request_ids = [f"gen-{next(self._ids)}" for _ in inputs]
        # All checked (each prompt tokenized once) before any is queued: a bad prompt must not
        # leave the others running.
        self.engine.add_requests([dict(request_id=request_id, params=param, **item)
                                  for request_id, param, item in zip(request_ids, params, inputs)])
        return self._run(request_ids, use_tqdm)

    def score(self, prompt_token_ids: list[list[int]], completion_token_ids: list[list[int]], *,
              temperature: float = 1.0, use_tqdm: bool = False) -> list[np.ndarray]:
        """For each (prompt, completion) pair, float32 [len(completion)]: log p(completion[i] |
        prompt + completion[:i]) under log_softmax(logits / temperature).

        Each pair runs as a request through the engine's batched, chunked prefill; only the
        completion's positions are scored, so prompt blocks shared by several completions
        come from the prefix cache. All pairs are checked before any runs.
        """
        request_ids = [f"score-{next(self._ids)}" for _ in prompt_token_ids]
        self.engine.add_score_requests(request_ids, prompt_token_ids, completion_token_ids,
                                       temperature=temperature)
        outputs = self._run(request_ids, use_tqdm)
        return [completion_logprobs(output, len(completion))
                for output, completion in zip(outputs, completion_token_ids)]

    def beam_search(self, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search with transformers' semantics (see `jpaged.engine.beam_search`); beams share
        KV blocks. prompts: one prompt or a list, each a str, a list of token ids, or a dict with
        "prompt" or "prompt_token_ids". Needs an idle engine; results come back in input order,
        each with beam_width sequences, best first."""
        return beam_search(self.engine, prompts, params)

    @staticmethod
    def _params_list(sampling_params, count):
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        sampling_params = list(sampling_params)
        if len(sampling_params) != count:
            raise ValueError(f"got {len(sampling_params)} sampling_params for {count} prompts")
        return sampling_params

    def _run(self, request_ids, use_tqdm) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        bar = tqdm(total=len(request_ids), desc="generate", disable=not use_tqdm, unit="req")
        start, generated_before = time.perf_counter(), self.engine.num_generated_tokens
        while self.engine.has_unfinished() and not wanted <= finished.keys():
            for output in self.engine.step():
                if output.finished and output.request_id in wanted:
                    finished[output.request_id] = output
                    bar.update(1)
            rate = (self.engine.num_generated_tokens - generated_before) / max(
                time.perf_counter() - start, 1e-9)
            bar.set_postfix(tokens_per_s=f"{rate:.0f}")
        while self.engine.has_unfinished() and not self.engine.num_unfinished_requests:
            self.engine.step()   # a chained decode loop still in flight: settle it
        bar.close()
        return [finished[request_id] for request_id in request_ids]

    def update_weights(self, weights) -> None:
        """Replace the model's weights in place between generate calls, with no new compilation
        (reinforcement-learning rollouts): a Mapping {Hugging Face tensor name: numpy or jax
        array, in the checkpoint's layout} or a checkpoint directory. A bad tensor raises
        ValueError naming it and changes nothing. The prefix cache is emptied; see
        `LLMEngine.update_weights` for requests in flight."""
        self.engine.update_weights(weights)

    def get_weights(self) -> dict:
        """{Hugging Face tensor name: jax array}: the weights as `update_weights` takes them."""
        return self.engine.get_weights()

    def stats(self) -> dict:
        """num_kv_blocks, num_free_blocks, num_compilations, num_preemptions, and more."""
        return self.engine.stats()
