"""Tokens out: sampled tokens appended to their sequences up to the first stop, detokenized
(stop strings included), the n - 1 siblings of a request created at its prompt's end, and each
request's `RequestOutput` built as its params ask (CUMULATIVE, DELTA or FINAL_ONLY).

The processor touches no block state: it returns what the step finished and which siblings were
born (`StepOutcome`), and the engine applies the block side (forks, frees) through the ledger.
"""

import dataclasses

from jpaged.detokenizer import IncrementalDetokenizer
from jpaged.request import (CompletionOutput, Logprob, Request, RequestOutput, Samples,
                            Sequence)
from jpaged.sampling_params import RequestOutputKind


@dataclasses.dataclass
class StepOutcome:
    """What processing one step's samples decided."""
    outputs: list[RequestOutput]                      # one per request that made progress
    forks: list[tuple[Request, list[Sequence]]]       # siblings born unfinished, per request
    finished: list[Sequence]                          # sequences that ended in this step
    finished_requests: list[Request]                  # requests whose every sequence ended
    failed: list[tuple[Request, Exception]] = dataclasses.field(default_factory=list)


class OutputProcessor:
    """Appends samples, stops sequences, detokenizes, and builds outputs."""

    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self._token_texts: dict[int, str] = {}
        self.max_model_len = max_model_len
        self.num_generated_tokens = 0

    def add(self, request: Request):
        """A request joins: its first sequence gets its detokenizer."""
        request.sequences[0].detokenizer = self._detokenizer(request)

    def _detokenizer(self, request: Request) -> IncrementalDetokenizer:
        """The sequence's detokenizer; with detokenize=False one with no tokenizer, which
        only counts tokens."""
        tokenizer = self.tokenizer if request.params.detokenize else None
        return IncrementalDetokenizer(tokenizer, request.prompt_token_ids,
                                      request.params.stop,
                                      skip_special_tokens=request.params.skip_special_tokens)

    def process(self, results, scored=()) -> StepOutcome:
        """results: [(ScheduledRow, sample index, Samples)] of one step or decode loop; scored:
        [(ScheduledRow, first token index, Samples)], the prompt positions it scored. An
        exception while appending one request's samples (detokenizing, stop checks) fails that
        request only: it is left out of the outcome and listed in `failed`."""
        for row, first, samples in scored:
            self._append_prompt_logprobs(row.request, first, samples)
        touched: dict[int, Request] = {}
        children: dict[int, list[Sequence]] = {}
        finished: list[Sequence] = []
        failed: dict[int, tuple[Request, Exception]] = {}
        for row, sample_index, samples in results:
            request, seq = row.request, row.seq
            if id(request) in failed:
                continue
            try:
                if sample_index != seq.index:  # the n-1 siblings come to life at prompt's end
                    seq = self._new_child(request, row.seq, sample_index)
                    children.setdefault(id(request), []).append(seq)
                self._append_samples(request, seq, samples)
            except Exception as err:  # this request's fault alone: the engine fails just it
                failed[id(request)] = (request, err)
                continue
            touched[id(request)] = request
            if seq.is_finished:
                finished.append(seq)
        if failed:
            for key in failed:
                touched.pop(key, None)
                children.pop(key, None)
            lost = {id(seq) for request, _ in failed.values() for seq in request.sequences}
            finished = [seq for seq in finished if id(seq) not in lost]
        forks = [(touched[key], [seq for seq in new if not seq.is_finished])
                 for key, new in children.items()]
        outputs, done = [], []
        for request in touched.values():
            if request.is_finished:
                done.append(request)
            if request.is_finished or request.params.output_kind != RequestOutputKind.FINAL_ONLY:
                outputs.append(self.output(request))
        return StepOutcome(outputs, [(r, live) for r, live in forks if live], finished, done,
                           list(failed.values()))

    def _new_child(self, request: Request, parent: Sequence, sample_index: int) -> Sequence:
        child = Sequence(sample_index, list(parent.token_ids[:parent.num_computed]),
                         parent.num_prompt_tokens, constraint=request.new_constraint())
        child.detokenizer = self._detokenizer(request)
        request.sequences.append(child)
        request.sequences.sort(key=lambda s: s.index)
        return child

    def _append_samples(self, request: Request, seq: Sequence, samples: Samples):
        """Append a step's or a loop's tokens to seq, up to the first that ends it: a stop
        string (the detokenizer's match), a stop id or EOS, a complete structured output,
        max_tokens or max_model_len. A stop id or EOS that ends it is one of its tokens but not
        part of its text (vLLM's rule: it would show with skip_special_tokens=False)."""
        params = request.params
        tokens = samples.token_ids
        room = max(1, min(params.max_tokens - (len(seq.token_ids) - seq.num_prompt_tokens),
                          self.max_model_len - len(seq.token_ids)))
        stop_ids = request.stop_id_set
        end = next((i + 1 for i, token in enumerate(tokens[:room]) if token in stop_ids),
                   min(room, len(tokens)))
        is_complete = False
        if seq.constraint is not None:
            end, is_complete = seq.constraint.consume(tokens[:end])
        consumed = seq.detokenizer.num_tokens
        text_end = end - 1 if end > 0 and tokens[end - 1] in stop_ids else end
        delta, hit_stop_string = seq.detokenizer.append(tokens[:text_end])
        is_delta = params.output_kind == RequestOutputKind.DELTA
        if is_delta:
            seq.unsent_text += delta
        if hit_stop_string:
            end = seq.detokenizer.num_tokens - consumed
        taken = tokens[:end]
        seq.token_ids.extend(taken)
        seq.cumulative_logprob += sum(samples.logprobs[:end])
        if params.logprobs:   # the top k first, then the token's own (if not among them)
            top_ids = samples.top_ids[:end, :params.logprobs].tolist()
            top_logprobs = samples.top_logprobs[:end, :params.logprobs].tolist()
            for ids, values, token, logprob in zip(top_ids, top_logprobs, taken,
                                                   samples.logprobs):
                entry = dict(zip(ids, values))
                entry[token] = logprob
                seq.logprobs.append(entry)
        elif params.logprobs == 0:
            seq.logprobs.extend({token: logprob}
                                for token, logprob in zip(taken, samples.logprobs))
        self.num_generated_tokens += end
        if hit_stop_string or is_complete or (taken and taken[-1] in stop_ids):
            seq.finish_reason = "stop"
        elif end == room:
            seq.finish_reason = "length"
        if seq.is_finished and not hit_stop_string:
            rest = seq.detokenizer.flush()
            if is_delta:
                seq.unsent_text += rest

    def _append_prompt_logprobs(self, request: Request, first: int, samples: Samples):
        """Entries for prompt tokens first + 1, ...: `Logprob`s of the token and the top k (ranks
        1 .. k, the token's own from the device). A token that already has one (a chunk run
        again after preemption) keeps it."""
        k, entries = request.params.prompt_logprobs, request.prompt_logprobs
        text_of = self._token_text if request.params.detokenize else lambda token_id: None
        for offset, token in enumerate(samples.token_ids):
            index = first + 1 + offset
            entries.extend([None] * (index - len(entries)))
            if index == len(entries):
                top = zip(samples.top_ids[offset, :k].tolist(),
                          samples.top_logprobs[offset, :k].tolist())
                entry = {token_id: Logprob(logprob, rank, text_of(token_id))
                         for rank, (token_id, logprob) in enumerate(top, 1)}
                entry[token] = Logprob(samples.logprobs[offset], samples.ranks[offset],
                                       text_of(token))
                entries.append(entry)

    def _token_text(self, token_id: int) -> str | None:
        """One token's text (memoised: scoring asks for the same few tokens many times)."""
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    @staticmethod
    def output(request: Request) -> RequestOutput:
        """The request's output now, as its params' output_kind asks: everything so far, or
        (DELTA) the tokens, logprobs and text new since its previous output."""
        want_logprobs = request.params.logprobs is not None
        is_delta = request.params.output_kind == RequestOutputKind.DELTA
        prompt_logprobs = None
        if request.params.prompt_logprobs is not None and not (
                is_delta and any(seq.num_sent for seq in request.sequences)):
            count = len(request.prompt_token_ids)  # a DELTA stream sends them once, first
            prompt_logprobs = (request.prompt_logprobs + [None] * count)[:count]
        completions = []
        for seq in request.sequences:
            if is_delta:
                start, text = seq.num_prompt_tokens + seq.num_sent, seq.unsent_text
                logprobs = seq.logprobs[seq.num_sent:] if want_logprobs else None
                seq.num_sent, seq.unsent_text = len(seq.token_ids) - seq.num_prompt_tokens, ""
            else:
                start, text = seq.num_prompt_tokens, seq.detokenizer.text
                logprobs = list(seq.logprobs) if want_logprobs else None
            completions.append(CompletionOutput(
                index=seq.index, text=text, token_ids=seq.token_ids[start:],
                cumulative_logprob=seq.cumulative_logprob if want_logprobs else None,
                logprobs=logprobs, finish_reason=seq.finish_reason))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             completions, request.is_finished, request.num_preemptions,
                             request.num_recomputed_tokens, request.num_cached_tokens,
                             prompt_logprobs=prompt_logprobs)
