"""Beam search over the paged engine: beams fork and share KV blocks (refcounts, copy-on-write),
and choose their tokens exactly as Hugging Face transformers' beam search does.

Semantics (transformers 5.x `GenerationMixin._beam_search`, `early_stopping=False`, the default):
- Each step keeps the K = max(2, 1 + number of EOS ids) * W best continuations over all beams by
  cumulative logprob (log_softmax of the raw logits, summed). The top K of one beam's vocabulary
  are enough to find the top K over all beams, so the sampler's top-logprob list serves (K must not
  exceed `sampling_params.MAX_LOGPROBS`).
- A continuation that ends (an EOS token, or the length limit) becomes a finished hypothesis only
  if its rank among the K is below W; its score is cum_logprob / generated_length ** length_penalty,
  the generated length counting the EOS token. The W best hypotheses are kept.
- The W best continuations that did not end are the next step's beams.
- A prompt stops when its W hypotheses are all filled and the best beam's cum_logprob divided by
  its current length ** length_penalty cannot beat the worst of them, or at the length limit.
- Results: the W hypotheses, best score first.
- beam_width 1 is greedy search, because `generate(num_beams=1)` is greedy search: one beam that
  ends at its first EOS (K = 1).

KV memory: a prompt is prefilled once into one block-manager row, then its beams fork from it. A
parent chosen by c beams is forked c - 1 times and reused once; unchosen parents are freed. Beams
share every block up to their divergence; the first write into a shared partial block copies it.
"""

import collections
import dataclasses
import math
import numbers
from typing import NamedTuple

from jpaged.detokenizer import IncrementalDetokenizer
from jpaged.sampling import SamplingRow
from jpaged.sampling_params import MAX_LOGPROBS, SamplingParams


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """How to beam-search one batch of prompts; every invalid value raises ValueError.

    beam_width W: beams kept per step and sequences returned per prompt (1: greedy search).
    max_tokens: generated tokens at most (fewer where max_model_len comes first).
    length_penalty: a hypothesis scores cum_logprob / length ** length_penalty (0: raw sum; above
        0 favours longer ones), as in transformers.
    ignore_eos: keep going past EOS; every hypothesis then has max_tokens tokens.
    """
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self):
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if 2 * self.beam_width > MAX_LOGPROBS:
            raise ValueError(f"beam_width={self.beam_width} needs the top {2 * self.beam_width} "
                             f"logprobs per beam; the sampler gives at most {MAX_LOGPROBS}, so "
                             f"beam_width must be at most {MAX_LOGPROBS // 2}")
        penalty = self.length_penalty
        if isinstance(penalty, bool) or not isinstance(penalty, numbers.Real) or not math.isfinite(
                penalty):
            raise ValueError(f"length_penalty must be a finite number, got {penalty!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        object.__setattr__(self, "beam_width", int(self.beam_width))
        object.__setattr__(self, "max_tokens", int(self.max_tokens))
        object.__setattr__(self, "length_penalty", float(penalty))


@dataclasses.dataclass
class BeamSearchSequence:
    """One finished hypothesis."""
    token_ids: list[int]      # generated tokens only; ends with the EOS that finished it, if any
    text: str                 # their text ("" without a tokenizer); special tokens skipped
    cum_logprob: float        # sum of the tokens' logprobs
    score: float              # cum_logprob / len(token_ids) ** length_penalty
    finish_reason: str        # "stop" (EOS) or "length"


@dataclasses.dataclass
class BeamSearchOutput:
    """One prompt's result: `sequences` holds beam_width hypotheses, best score first."""
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]


# ---- the selection rule (pure: no engine) -----------------------------------------------------
class Candidate(NamedTuple):
    parent: int          # index of the beam it extends
    token_id: int
    cum_logprob: float


@dataclasses.dataclass(eq=False)
class Beam:
    token_ids: list[int]  # generated so far (the last one is not in the cache yet)
    cum_logprob: float
    slot: int = -1        # block-manager row; -1 for a finished hypothesis


def num_candidates(beam_width: int, num_eos: int) -> int:
    """K, the continuations kept per step (transformers' `beams_to_keep`; 1 for greedy)."""
    return 1 if beam_width == 1 else max(2, 1 + num_eos) * beam_width


def top_candidates(beams: list[Beam], top_ids, top_logprobs, keep: int) -> list[Candidate]:
    """The `keep` best continuations of all beams, best first; row b of top_ids / top_logprobs
    holds beam b's most likely next tokens, descending. Ties keep beam-major order."""
    candidates = [Candidate(index, int(token), beam.cum_logprob + float(logprob))
                  for index, beam in enumerate(beams)
                  for token, logprob in zip(top_ids[index][:keep], top_logprobs[index][:keep])]
    candidates.sort(key=lambda c: -c.cum_logprob)
    return candidates[:keep]


@dataclasses.dataclass
class SelectionRule:
    """transformers' per-step choice for one prompt (see the module docstring): which
    continuations become hypotheses, which become the next beams, and when to stop."""
    beam_width: int
    length_penalty: float
    eos_token_ids: frozenset
    max_new_tokens: int

    def score(self, cum_logprob: float, length: int) -> float:
        return cum_logprob / length ** self.length_penalty

    def select(self, beams: list[Beam], candidates: list[Candidate],
               finished: list[tuple[float, Beam]]):
        """One step: returns (next beams' candidates, finished hypotheses best first, is_done).

        `beams` all have the same length; candidates come from `top_candidates`.
        """
        length = len(beams[0].token_ids) + 1
        running, merged = [], list(finished)
        for rank, candidate in enumerate(candidates):
            if candidate.token_id in self.eos_token_ids or length >= self.max_new_tokens:
                if rank < self.beam_width:
                    tokens = beams[candidate.parent].token_ids + [candidate.token_id]
                    merged.append((self.score(candidate.cum_logprob, length),
                                   Beam(tokens, candidate.cum_logprob)))
            elif len(running) < self.beam_width:
                running.append(candidate)
        merged.sort(key=lambda item: -item[0])
        finished = merged[:self.beam_width]
        is_done = not running or (len(finished) == self.beam_width and self.score(
            running[0].cum_logprob, length) <= finished[-1][0])
        return running, finished, is_done


# ---- one prompt's search ----------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class _Search:
    prompt: str | None
    prompt_token_ids: list[int]
    rule: SelectionRule
    max_blocks: int                    # upper bound on the distinct KV blocks it ever holds
    beams: list[Beam] = dataclasses.field(default_factory=list)
    finished: list[tuple[float, Beam]] = dataclasses.field(default_factory=list)
    spare_slots: list[int] = dataclasses.field(default_factory=list)
    num_prefilled: int = 0

    @property
    def is_prefilled(self) -> bool:
        return self.num_prefilled == len(self.prompt_token_ids)

    def output(self, tokenizer) -> BeamSearchOutput:
        eos = self.rule.eos_token_ids
        sequences = []
        for score, beam in self.finished:
            detokenizer = IncrementalDetokenizer(tokenizer, self.prompt_token_ids, ())
            detokenizer.append(beam.token_ids)
            detokenizer.flush()
            sequences.append(BeamSearchSequence(
                list(beam.token_ids), detokenizer.text, beam.cum_logprob, score,
                "stop" if beam.token_ids[-1] in eos else "length"))
        return BeamSearchOutput(self.prompt, list(self.prompt_token_ids), sequences)


def max_blocks(prompt_len: int, max_new_tokens: int, beam_width: int, block_size: int) -> int:
    """Distinct blocks one search can hold: the full prompt blocks once (never written again),
    the rest per beam. A beam caches at most prompt_len + max_new_tokens - 1 tokens (its last
    token is never fed)."""
    shared = prompt_len // block_size
    per_beam = -(-(prompt_len + max_new_tokens - 1) // block_size)
    return shared + beam_width * (per_beam - shared)


# ---- the driver -------------------------------------------------------------------------------
class _Driver:
    """Runs the searches through the engine's ledger and executor, batching all beams of all
    admitted prompts into one step; every fork and free goes through the ledger, which queues it
    for the device in the same order."""

    def __init__(self, engine, params: BeamSearchParams, keep: int):
        self.ledger, self.executor = engine.ledger, engine.executor
        self.apply_block_ops = engine.apply_block_ops
        self.max_num_batched_tokens = engine.config.max_num_batched_tokens
        self.params = params
        self.keep = keep
        self.sampling = SamplingParams(temperature=0.0, max_tokens=1, logprobs=keep)
        self.ledger.evict_all()   # idle engine: cached blocks nobody holds go back
        self.apply_block_ops()
        self.pool = self.ledger.num_free
        self.active: list[_Search] = []

    def run(self, searches: list[_Search]):
        waiting = collections.deque(searches)
        try:
            while waiting or self.active:
                while waiting and self._can_admit(waiting[0]):
                    self._admit(waiting.popleft())
                if not self.active:
                    raise RuntimeError("beam search cannot admit a prompt into an idle engine: "
                                       "its slots or blocks are held elsewhere")
                self._step()
        finally:
            for search in list(self.active):
                self._retire(search)
            self.apply_block_ops()

    def _can_admit(self, search: _Search) -> bool:
        reserved = sum(s.max_blocks for s in self.active)
        return (self.ledger.num_free_slots >= self.params.beam_width
                and reserved + search.max_blocks <= self.pool)

    def _admit(self, search: _Search):
        search.spare_slots = self.ledger.take_slots(self.params.beam_width)
        search.beams = [Beam([], 0.0, search.spare_slots.pop())]
        self.active.append(search)

    def _step(self):
        rows, sampled = self._plan()
        if not self.ledger.append([(slot, len(tokens)) for slot, tokens in rows]):
            raise RuntimeError("beam search ran out of KV blocks its reservation promised")
        self.apply_block_ops()
        sampling_rows = [(row, SamplingRow(self.sampling, 0, 0, position))
                         for row, (_, position) in enumerate(sampled) if position is not None]
        _, _, top_ids, top_logprobs = self.executor.execute(rows, sampling_rows, self.keep)
        results = iter(zip(top_ids, top_logprobs))
        by_search: dict[int, list] = collections.defaultdict(list)
        for search, position in sampled:
            if position is not None:
                by_search[id(search)].append(next(results))
        for search in list(self.active):
            if id(search) in by_search:
                self._advance(search, by_search[id(search)])

    def _plan(self):
        """This step's rows [(slot, tokens fed)] and, per row, (search, sampled position or
        None): every beam of a prefilled search, then prompt chunks within the token budget."""
        rows, sampled = [], []
        for search in self.active:
            if search.is_prefilled:
                for beam in search.beams:
                    rows.append((beam.slot, beam.token_ids[-1:]))
                    sampled.append((search, len(search.prompt_token_ids) + len(beam.token_ids)))
        budget = self.max_num_batched_tokens - len(rows)
        for search in self.active:
            if search.is_prefilled or budget <= 0:
                continue
            start = search.num_prefilled
            chunk = search.prompt_token_ids[start:start + budget]
            search.num_prefilled += len(chunk)
            budget -= len(chunk)
            rows.append((search.beams[0].slot, chunk))
            sampled.append((search, search.num_prefilled if search.is_prefilled else None))
        return rows, sampled

    def _advance(self, search: _Search, tops: list):
        """Pick the next beams, move the KV rows to them, retire the search when it is done."""
        beams = search.beams
        candidates = top_candidates(beams, [ids for ids, _ in tops], [lps for _, lps in tops],
                                    self.keep)
        chosen, search.finished, is_done = search.rule.select(beams, candidates, search.finished)
        if is_done:
            self._retire(search)
            return
        children = collections.Counter(c.parent for c in chosen)
        self._free(search, [beam.slot for index, beam in enumerate(beams)
                            if children[index] == 0])
        pairs, reused, search.beams = [], set(), []
        for candidate in chosen:
            parent = beams[candidate.parent]
            if candidate.parent in reused:
                slot = search.spare_slots.pop()
                pairs.append((parent.slot, slot))
            else:
                slot = parent.slot
                reused.add(candidate.parent)
            search.beams.append(Beam(parent.token_ids + [candidate.token_id],
                                     candidate.cum_logprob, slot))
        self.ledger.fork(pairs)

    def _free(self, search: _Search, slots: list[int]):
        if slots:
            self.ledger.free(slots)
            search.spare_slots.extend(slots)

    def _retire(self, search: _Search):
        self._free(search, [beam.slot for beam in search.beams])
        search.beams = []
        self.ledger.return_slots(search.spare_slots)
        search.spare_slots = []
        self.active.remove(search)


# ---- entry point ------------------------------------------------------------------------------
def beam_search(engine, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Beam-search every prompt on an idle `LLMEngine`; results in input order.

    `prompts`: one prompt or a list of them; a prompt is a str, a list of token ids, or a dict
    with "prompt" (str) or "prompt_token_ids". Everything is validated before anything runs.
    """
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    if engine.has_unfinished():
        raise ValueError("beam_search needs an idle engine: finish or abort its requests first")
    eos = frozenset() if params.ignore_eos else frozenset(engine.eos_token_ids)
    keep = num_candidates(params.beam_width, len(eos))
    if keep > MAX_LOGPROBS:
        raise ValueError(f"beam_width={params.beam_width} with {len(eos)} EOS ids keeps {keep} "
                         f"candidates per step; the sampler gives at most {MAX_LOGPROBS}")
    if params.beam_width > engine.config.max_num_seqs:
        raise ValueError(f"beam_width={params.beam_width} exceeds max_num_seqs="
                         f"{engine.config.max_num_seqs}")
    searches = []
    for index, prompt in enumerate(_as_prompt_list(prompts)):
        try:
            searches.append(_new_search(engine, prompt, params, eos))
        except ValueError as err:
            raise ValueError(f"prompt {index}: {err}") from err
    _Driver(engine, params, keep).run(searches)
    return [search.output(engine.tokenizer) for search in searches]


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and isinstance(prompts[0], numbers.Integral)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a prompt or a non-empty list of prompts")
    return list(prompts)


def _new_search(engine, prompt, params: BeamSearchParams, eos: frozenset) -> _Search:
    text, token_ids = _prompt_tokens(engine, prompt)
    config = engine.config
    if len(token_ids) >= config.max_model_len:
        raise ValueError(f"prompt has {len(token_ids)} tokens; max_model_len is "
                         f"{config.max_model_len} (the prompt plus one generated token must fit)")
    max_new = min(params.max_tokens, config.max_model_len - len(token_ids))
    blocks = max_blocks(len(token_ids), max_new, params.beam_width, config.block_size)
    if blocks > engine.num_free_blocks:
        raise ValueError(f"its {params.beam_width} beams need up to {blocks} KV blocks but only "
                         f"{engine.num_free_blocks} are free")
    rule = SelectionRule(params.beam_width, params.length_penalty, eos, max_new)
    return _Search(text, token_ids, rule, blocks)


def _prompt_tokens(engine, prompt) -> tuple[str | None, list[int]]:
    if isinstance(prompt, dict):
        if set(prompt) not in ({"prompt"}, {"prompt_token_ids"}):
            raise ValueError(f"a dict prompt needs exactly one key, 'prompt' or "
                             f"'prompt_token_ids'; got {sorted(prompt)}")
        prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
    if isinstance(prompt, str):   # the engine's own validation of prompts
        return prompt, engine.inputs.prompt_tokens(prompt, None)
    if isinstance(prompt, (list, tuple)) and all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
        return None, engine.inputs.prompt_tokens(None, prompt)
    raise ValueError(f"a prompt is a str or a list of token ids, got {type(prompt).__name__}")
