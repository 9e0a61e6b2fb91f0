"""Host arrays of one step's or one decode loop's inputs, padded to shape buckets (powers of two
between a floor and a cap, so compilations stay few), and the choices that follow from the rows
alone: the loop's sampler mode and the prompt positions a step scores. No device state here: the
executor packs these arrays into one buffer per dispatch.
"""

import numpy as np

from jpaged.blocks.ops import bucket
from jpaged.engine.device_step import DecodeInputs, StepInputs
from jpaged.logprobs import SCORED_POSITIONS_PER_STEP, PositionRows
from jpaged.sampling import SamplingTensors, sampler_mode


def loop_sampler(sampling_rows, num_logprobs: int) -> str:
    """The decode loop's sampler mode. Loops with top logprobs take "sort" for any sampled row
    ("sort" is exact for rows that filter nothing), which spares compiling a "random" variant of
    every logprobs loop; logprobs requests are rare and pay their top-k anyway."""
    mode = sampler_mode(sampling_rows)
    return "sort" if num_logprobs and mode == "random" else mode


def step_arrays(rows, sampling_rows, scored, *, max_num_seqs: int,
                max_num_batched_tokens: int) -> tuple[StepInputs, bool, int, int]:
    """(StepInputs, is_decode, padded tokens T, real tokens) of one step.

    rows: [(sequence slot, token ids)]; sampling_rows: [(row index, SamplingRow)]; scored:
    `scored_positions(...)[0]`. Decode steps bucket the batch; mixed steps bucket only the
    tokens and keep every row (padded rows cost the kernels nothing)."""
    num_tokens = sum(len(tokens) for _, tokens in rows)
    is_decode = all(len(tokens) == 1 for _, tokens in rows)
    if is_decode:
        batch = size = samples = bucket(len(rows), 4, max_num_seqs)
    else:
        batch = samples = max_num_seqs
        size = bucket(num_tokens, 128, max_num_batched_tokens)
    token_ids = np.zeros(size, np.int32)
    seq_ids = np.full(batch, -1, np.int32)
    query_lens = np.zeros(batch, np.int32)
    row_start = np.zeros(len(rows), np.int32)
    offset = 0
    for index, (seq_id, tokens) in enumerate(rows):
        token_ids[offset:offset + len(tokens)] = tokens
        seq_ids[index], query_lens[index] = seq_id, len(tokens)
        row_start[index] = offset
        offset += len(tokens)
    last_token = row_start + query_lens[:len(rows)] - 1
    logits_indices = np.zeros(samples, np.int32)
    logits_indices[:len(sampling_rows)] = [last_token[row] for row, _ in sampling_rows]
    sampling = SamplingTensors.from_rows([r for _, r in sampling_rows], samples)
    positions = None
    if scored:
        positions = PositionRows.from_lists(
            [row_start[row] + at for row, at, _, _ in scored], [t for _, _, t, _ in scored],
            [temperature for _, _, _, temperature in scored],
            bucket(len(scored), 16, max(16, min(max_num_batched_tokens,
                                                SCORED_POSITIONS_PER_STEP))))
    return (StepInputs(token_ids, seq_ids, query_lens, logits_indices, sampling, positions),
            is_decode, size, num_tokens)


def loop_batch(num_rows: int, max_num_seqs: int) -> int:
    """The batch (rows, padded to a bucket) of a decode loop over num_rows sequences."""
    return bucket(num_rows, 4, max_num_seqs)


def loop_arrays(rows, sampling_rows, remaining, stop_ids, num_steps: int, *,
                max_num_seqs: int) -> tuple[DecodeInputs, int, int]:
    """(DecodeInputs, batch B, stop-id width) of a fresh decode loop: rows [(slot, last token)],
    a SamplingRow, tokens left and stop ids per row, padded to buckets."""
    batch = loop_batch(len(rows), max_num_seqs)
    width = bucket(max((len(ids) for ids in stop_ids), default=1), 16, 1 << 16)
    token_ids = np.zeros(batch, np.int32)
    seq_ids = np.full(batch, -1, np.int32)
    remaining_arr = np.zeros(batch, np.int32)
    stop_arr = np.full((batch, width), -1, np.int32)
    for index, ((seq_id, token), left, ids) in enumerate(zip(rows, remaining, stop_ids)):
        token_ids[index], seq_ids[index], remaining_arr[index] = token, seq_id, left
        stop_arr[index, :len(ids)] = ids
    sampling = SamplingTensors.from_rows([r for r in sampling_rows], batch)
    return (DecodeInputs(token_ids, seq_ids, sampling, remaining_arr, stop_arr,
                         np.int32(num_steps)), batch, width)


def scored_positions(rows):
    """The prompt positions this step's rows (`ScheduledRow`s) must score
    (`Request.scored_range`): ([(row index, token offset in the row, target, temperature)],
    [(row, first token index, (begin, end) into the first list)])."""
    scored, scored_rows = [], []
    for index, row in enumerate(rows):
        positions = row.request.scored_range(row.start, row.num_tokens)
        if not positions:
            continue
        prompt, begin = row.request.prompt_token_ids, len(scored)
        scored += [(index, j - row.start, prompt[j + 1], row.request.score_temperature)
                   for j in positions]
        scored_rows.append((row, positions.start, (begin, len(scored))))
    return scored, scored_rows
