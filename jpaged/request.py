"""Host-side requests: a request is a group of n sequences sharing one prompt; results types."""

import dataclasses
import enum
from typing import NamedTuple

import numpy as np

from jpaged.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # not in the cache (new, or preempted by recompute)
    RUNNING = "running"
    SWAPPED = "swapped"      # preempted by swap: its KV blocks wait in host memory
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)  # identity: sequences are compared by who they are
class Sequence:
    """One output stream: the prompt plus its generated tokens, and what the cache holds of them."""
    index: int                       # sample index within the request (0 .. n-1)
    token_ids: list[int]             # prompt + generated
    num_prompt_tokens: int
    slot: int = -1                   # row in the block manager (-1: none)
    num_computed: int = 0            # tokens whose K/V are in the cache
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    detokenizer: object = None
    stop_reason: object = None
    block_keys: list[int] = dataclasses.field(default_factory=list)  # prefix-cache keys (memo)
    num_indexed: int = 0             # leading full blocks already offered to the prefix cache
    num_trimmed: int = 0             # leading blocks a sliding window let go (sink in its table)
    num_sent: int = 0                # output tokens (and logprobs) already in a DELTA output
    unsent_text: str = ""            # streamed text not yet in a DELTA output
    constraint: object = None        # its structured output's matcher (a Constraint), or None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(eq=False)  # identity, so queue membership tests stay O(1) per item
class Request:
    """A prompt and its n sequences. Only sequence 0 exists until the prompt is prefilled; then
    the others fork from it and share its prompt blocks."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_index: int
    priority: int = 0
    stop_ids: tuple = ()                   # ids that end a sequence: stop ids, EOS unless ignored
    stop_id_set: frozenset = frozenset()   # the same, for membership tests
    status: SequenceStatus = SequenceStatus.WAITING
    sequences: list[Sequence] = dataclasses.field(default_factory=list)
    reserved_slots: list[int] = dataclasses.field(default_factory=list)  # for the n-1 forks
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    num_cached_tokens: int = 0         # prefix-cache hit tokens at its latest admission
    swap: "SwapRecord | None" = None   # where its blocks are while SWAPPED
    # Prompt logprobs (params.prompt_logprobs set): prompt tokens from score_from on get an
    # entry, under log_softmax(logits / score_temperature); `LLM.score` asks for a suffix.
    score_from: int = 1
    score_temperature: float = 1.0
    prompt_logprobs: list = dataclasses.field(default_factory=list)  # entry i: prompt token i
    # The structured output's matcher before any output token (a Constraint), or None: every
    # sequence starts from a copy of it.
    constraint: object = None

    def __post_init__(self):
        if not self.sequences:
            self.sequences = [Sequence(0, list(self.prompt_token_ids), len(self.prompt_token_ids),
                                       constraint=self.new_constraint())]

    def new_constraint(self):
        """A matcher for a new sequence of this request (None: unconstrained)."""
        return None if self.constraint is None else self.constraint.fork()

    @property
    def is_forked(self) -> bool:
        return len(self.sequences) == self.params.n

    @property
    def live_sequences(self) -> list[Sequence]:
        return [seq for seq in self.sequences if not seq.is_finished]

    @property
    def is_finished(self) -> bool:
        return self.is_forked and all(seq.finish_reason is not None for seq in self.sequences)

    @property
    def next_scored(self) -> int:
        """The first prompt token whose logprob is still owed (the prompt's length: none).
        Entries already made are never computed again (chunks, preemption, recompute)."""
        if self.params.prompt_logprobs is None:
            return len(self.prompt_token_ids)
        return max(self.score_from, len(self.prompt_logprobs))

    def scored_range(self, start: int, num_tokens: int) -> range:
        """Token indices in [start, start + num_tokens) whose logits give an owed prompt
        token's logprob (index j predicts prompt token j + 1)."""
        return range(max(start, self.next_scored - 1),
                     min(start + num_tokens, len(self.prompt_token_ids) - 1))

    @property
    def num_cacheable_tokens(self) -> int | None:
        """At most this many leading tokens may come from the prefix cache (None: any): the
        logits of the position before the first owed prompt token must be computed."""
        if self.next_scored >= len(self.prompt_token_ids):
            return None
        return self.next_scored - 1


class Samples(NamedTuple):
    """One sequence's tokens sampled in one step or loop, in order: token_ids [n], logprobs [n],
    and the top alternatives top_ids, top_logprobs: [n, L] arrays (L = 0 when none asked); for
    scored prompt positions also ranks [n], each token's 1-based rank in its distribution."""
    token_ids: list[int]
    logprobs: list[float]
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    ranks: list[int] | None = None


@dataclasses.dataclass(frozen=True)
class Logprob:
    """vLLM's entry of `RequestOutput.prompt_logprobs`: a token's logprob, its 1-based rank in
    the distribution (1: the most likely) and its text."""
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclasses.dataclass
class SwapRecord:
    """A swapped-out request: its distinct blocks went to host blocks `host_ids` in one transfer
    (`handle` names it for the swap store); each sequence's table lists indices into host_ids."""
    handle: int
    host_ids: list[int]
    tables: dict[int, list[int]]      # sequence index -> positions in host_ids
    lengths: dict[int, int]           # sequence index -> tokens in its blocks


@dataclasses.dataclass
class CompletionOutput:
    """One of a request's n outputs (vLLM's fields)."""
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None


@dataclasses.dataclass
class RequestOutput:
    """A request's state as returned by generate/step (vLLM's fields)."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None  # why the engine failed this request (its finish_reason: "error")
    # params.prompt_logprobs set: one entry per prompt token, None for the first (and, for
    # `LLM.score`, for the given prompt), else {token id: logprob} with the token and the top k.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
