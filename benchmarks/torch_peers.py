"""Torch peers for benchmarks/kernels.py: SDPA on a contiguous cache, gather + SDPA on our pages.

Usage (GPU machine, repository root): PYTHONPATH=. python3 benchmarks/torch_peers.py --cases cases

Method, kernels.py's, so the numbers share its table. A decode step is `chain` dependent calls,
each output [B, H, D] feeding the next call's queries, each call on its own K/V set (kernels.py's
count of disjoint sets, so a chain finds little of its K/V in the 50 MB L2); a prefill step is
one ragged batch. A step is captured in a CUDA graph and replayed (eager if capture fails; the
result says which). Time per call = median over repeats of (n steps, synchronize) /
(n * calls per step), n doubled until >= 20 ms.

"sdpa contiguous" is torch's scaled_dot_product_attention (enable_gqa) on [B, K, C, D] K/V;
"gather + sdpa" first gathers each sequence's pages of a [K, N, S, D] pool into [B, K, C, D]
inside the timed step (that copy is what paging costs a dense kernel). A ragged batch is one SDPA
call per group of equal (query_len, context_len); query i of a chunk sits at position
context_len - query_len + i and sees keys up to it (lower-right causal).
"""

import argparse
import statistics
import time
from typing import NamedTuple

import numpy as np

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128  # kernels.py's (a test keeps them equal)
L2_SAFE_SET_BYTES = 2 ** 28


class Group(NamedTuple):
    """Sequences of a ragged batch with one (query_len, context_len): one SDPA call."""
    index: int
    num_seqs: int
    seqs: object  # [G] int64 tensor of sequence indices; None when the group is the whole batch
    rows: object  # [G * query_len] int64 tensor of their query rows; None likewise
    query_len: int
    context_len: int


def torch_available():
    """(True, torch version) when torch imports and sees a CUDA device, else (False, reason)."""
    try:
        import torch
    except ImportError as error:
        return False, f"torch is not importable ({error})"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} sees no CUDA device"
    return True, torch.__version__


def make_groups(query_lens, context_lens, device):
    """Groups of a ragged batch whose query chunks lie back to back in q: [T, H, D]."""
    if len(query_lens) != len(context_lens):
        raise ValueError(f"{len(query_lens)} query_lens but {len(context_lens)} context_lens")
    import torch
    starts = np.concatenate([[0], np.cumsum(query_lens)])
    seqs_by_lens = {}
    for seq, (query_len, context_len) in enumerate(zip(query_lens, context_lens)):
        if not 1 <= query_len <= context_len:
            raise ValueError(f"sequence {seq}: query_len {query_len} not in [1, {context_len}]")
        seqs_by_lens.setdefault((int(query_len), int(context_len)), []).append(seq)
    if len(seqs_by_lens) == 1:  # the whole batch: no row or table indexing in the timed step
        (lens,) = seqs_by_lens
        return [Group(0, len(query_lens), None, None, *lens)]
    groups = []
    for index, ((query_len, context_len), seqs) in enumerate(seqs_by_lens.items()):
        rows = np.concatenate([np.arange(starts[s], starts[s + 1]) for s in seqs])
        groups.append(Group(index, len(seqs), torch.tensor(seqs, device=device),
                            torch.tensor(rows, device=device), query_len, context_len))
    return groups


def gather_pages(pages, block_tables, context_len, heads):
    """pages [K, N, S, D], block_tables [G, M] -> [G, len(heads), context_len, D] in one gather;
    heads [H'] int64 names the kv head of each output head (repeats stand in for enable_gqa)."""
    num_blocks = -(-context_len // pages.shape[2])
    gathered = pages[heads[None, :, None], block_tables[:, None, :num_blocks]]  # [G, H', M', S, D]
    return gathered.flatten(2, 3)[:, :, :context_len]


def attend_groups(q, groups, kv_of, attend=None):
    """q [T, H, D] -> [T, H, D]: each group's chunks attend to kv_of(group) = k, v [G, H', C, D]
    through attend(q [G, H, Q, D], k, v) (None: lower-right causal SDPA, `_causal_sdpa`)."""
    attend = attend or _causal_sdpa
    out = None if len(groups) == 1 else q.new_empty(q.shape)
    for group in groups:
        k, v = kv_of(group)
        chunk = q if group.rows is None else q[group.rows]
        chunk = chunk.reshape(group.num_seqs, group.query_len, *q.shape[1:]).transpose(1, 2)
        result = attend(chunk, k, v).transpose(1, 2).reshape(-1, *q.shape[1:])
        if out is None:
            return result
        out[group.rows] = result
    return out


def attend_paged(q, k_pages, v_pages, block_tables, groups, heads):
    """Gather + SDPA: q [T, H, D], pages [K, N, S, D], block_tables [B, M] int32 -> [T, H, D]."""
    def kv_of(group):
        tables = block_tables if group.seqs is None else block_tables[group.seqs]
        return (gather_pages(k_pages, tables, group.context_len, heads),
                gather_pages(v_pages, tables, group.context_len, heads))
    return attend_groups(q, groups, kv_of)


def _causal_sdpa(q, k, v):
    """q [G, H, Q, D] are the last Q of C positions; k, v [G, H', C, D], grouped when H' < H."""
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    query_len, context_len = q.shape[2], k.shape[2]
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    if query_len == 1:  # a decode token sees its whole context: no mask at all
        return sdpa(q, k, v, **gqa)
    if query_len == context_len:  # torch's is_causal is top-left aligned: right only with no prefix
        return sdpa(q, k, v, is_causal=True, **gqa)
    return sdpa(q, k, v, attn_mask=causal_lower_right(query_len, context_len), **gqa)


def _gqa(torch):
    """(kv head repeats to store K/V with, note): 1 with enable_gqa, else one per query head."""
    if torch.torch_version.TorchVersion(torch.__version__) >= (2, 5):
        return 1, "enable_gqa"
    return NUM_HEADS // NUM_KV_HEADS, "torch < 2.5 lacks enable_gqa: K/V repeated per query head"


def _require_cuda():
    is_available, detail = torch_available()
    if not is_available:
        raise RuntimeError(f"torch peers need a CUDA GPU: {detail}")
    import torch
    return torch


def _randn(torch, shape, seed, device):
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16)


def _page_pool(torch, blocks_per_seq, block_size, num_sets, seed, device):
    """Random K/V pools [K, N, S, D] and num_sets disjoint shuffled tables [num_sets, B, M] int32,
    zero padded; block 0 is never used (kernels.py's layout)."""
    blocks_per_seq = np.asarray(blocks_per_seq)
    num_blocks = 1 + num_sets * int(blocks_per_seq.sum())
    tables = np.zeros((num_sets, len(blocks_per_seq), blocks_per_seq.max()), np.int32)
    is_used = np.arange(tables.shape[2]) < blocks_per_seq[:, None]  # [B, M]
    tables[np.broadcast_to(is_used, tables.shape)] = (
        np.random.default_rng(seed).permutation(np.arange(1, num_blocks)))
    shape = (NUM_KV_HEADS, num_blocks, block_size, HEAD_DIM)
    return (_randn(torch, shape, seed, device), _randn(torch, shape, seed + 1, device),
            torch.tensor(tables, device=device))


def num_kv_sets(batch, context, chain):
    """kernels.py's decode_setup count: one bf16 K/V set of >= 256 MB, else enough to leave L2."""
    set_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * 2
    return 1 if set_bytes >= L2_SAFE_SET_BYTES else chain if set_bytes >= 2 ** 25 else 4 * chain


def decode_steps(batch, context, paged, block_size=16, chain=4, device="cuda"):
    """(steps, note) for the decode peers, rotated as kernels.py does: step d applies `chain`
    dependent calls on K/V sets d*chain, d*chain + 1, ... (contiguous copies or page tables)."""
    import torch
    group_size, note = _gqa(torch)
    num_sets = num_kv_sets(batch, context, chain)
    groups = make_groups([1] * batch, [context] * batch, device)
    if paged:
        k_pages, v_pages, tables = _page_pool(torch, [-(-context // block_size)] * batch,
                                              block_size, num_sets, batch + context, device)
        heads = torch.arange(NUM_KV_HEADS * group_size, device=device) // group_size

        def call(x, s):
            return attend_paged(x, k_pages, v_pages, tables[s], groups, heads)
    else:
        shape = (batch, NUM_KV_HEADS * group_size, context, HEAD_DIM)
        sets = [(_randn(torch, shape, 2 * s, device), _randn(torch, shape, 2 * s + 1, device))
                for s in range(num_sets)]

        def call(x, s):
            return attend_groups(x, groups, lambda group: sets[s])
    q = _randn(torch, (batch, NUM_HEADS, HEAD_DIM), 99, device)

    def step_from(first):
        def step():
            x = q
            for j in range(chain):
                x = call(x, (first + j) % num_sets)
            return x
        return step
    steps = [step_from(first) for first in range(0, max(num_sets, chain), chain)]
    return steps, f"{note}; {num_sets} K/V {'page sets' if paged else 'copies'}"


def prefill_step(query_lens, context_lens, paged, block_size=16, device="cuda"):
    """(step, note): one ragged batch, its K/V contiguous per group or paged (gathered in step)."""
    import torch
    group_size, note = _gqa(torch)
    groups = make_groups(query_lens, context_lens, device)
    q = _randn(torch, (int(sum(query_lens)), NUM_HEADS, HEAD_DIM), 99, device)
    if paged:
        k_pages, v_pages, tables = _page_pool(
            torch, [-(-c // block_size) for c in context_lens], block_size, 1, 0, device)
        heads = torch.arange(NUM_KV_HEADS * group_size, device=device) // group_size

        def step():
            return attend_paged(q, k_pages, v_pages, tables[0], groups, heads)
    else:
        kv = [[_randn(torch, (g.num_seqs, NUM_KV_HEADS * group_size, g.context_len, HEAD_DIM),
                      2 * g.index + i, device) for i in range(2)] for g in groups]

        def step():
            return attend_groups(q, groups, lambda group: kv[group.index])
    return step, f"{note}; {len(groups)} SDPA calls"


def time_decode_sdpa_contiguous(batch, context, chain=4, repeats=5):
    """SDPA decode on contiguous K/V [B, K, C, D] bf16 -> {"seconds" per call, "method", "note"}."""
    torch = _require_cuda()
    return _timed(torch, *decode_steps(batch, context, False, chain=chain), chain, repeats)


def time_decode_gather_sdpa(batch, context, block_size=16, chain=4, repeats=5):
    """Gather pages [K, N, S, D] into [B, K, C, D] (timed), then SDPA; the same dict."""
    torch = _require_cuda()
    return _timed(torch, *decode_steps(batch, context, True, block_size, chain), chain, repeats)


def time_prefill_sdpa(query_lens, context_lens, block_size=16, paged=False, repeats=5):
    """One ragged prefill batch (each chunk causal after its cached prefix): seconds per batch.
    paged=True gathers each group's pages inside the timed step."""
    torch = _require_cuda()
    step, note = prefill_step(query_lens, context_lens, paged, block_size)
    return _timed(torch, [step], note, 1, repeats)


def _timed(torch, steps, note, calls_per_step, repeats, min_seconds=0.02):
    """Seconds per call of the rotated steps (kernels.py's median_seconds), graphed if possible."""
    try:
        runs, method = [_graph(torch, step) for step in steps], "cuda graph"
    except Exception as error:  # an op refused capture: time the same steps eagerly
        torch.cuda.synchronize()
        runs, method = steps, "eager"
        note += f"; graph capture failed ({type(error).__name__}: {_first_line(error)})"
    for run in runs:
        run()

    def elapsed(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(n):
            runs[i % len(runs)]()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    n = 1
    while elapsed(n) < min_seconds and n < 4096:
        n *= 2
    seconds = statistics.median(elapsed(n) / n for _ in range(repeats)) / calls_per_step
    return {"seconds": seconds, "method": method, "note": note}


def _graph(torch, step):
    """step captured as a CUDA graph; returns its replay. Warm-up runs on a side stream first, as
    torch's CUDA-graph docs require (lazy initialisation and workspaces happen outside capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def check_against_reference(atol=1e-5):
    """Gather + SDPA decode and paged prefill equal pallas_kernels.reference on CPU in float32:
    H=4, K=2, D=16, S=4, ragged lengths, shuffled tables, every unowned slot NaN and table entries
    past a sequence's blocks poisoned, K/V both grouped (enable_gqa) and repeated per query head.
    Returns the largest absolute error; raises AssertionError above atol."""
    import jax.numpy as jnp
    import torch

    from pallas_kernels import reference, testing
    worst = 0.0
    cases = [(None, [1, 3, 9]), (None, [6, 6]), ([1, 2, 5, 2], [9, 3, 5, 3]), ([3, 3], [7, 7])]
    for query_lens, context_lens in cases:  # ragged (one SDPA call per group) and uniform
        problem = testing.make_problem(0, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                                       dtype=jnp.float32, context_lens=context_lens,
                                       query_lens=query_lens)
        expected = np.asarray(reference.paged_attention_decode(*problem.decode_args)
                              if query_lens is None
                              else reference.paged_attention_prefill(*problem.prefill_args))
        poisoned = testing.poison_unused_table_entries(problem)
        q, k_pages, v_pages, tables = (torch.from_numpy(np.array(a))
                                       for a in poisoned.decode_args[:4])
        groups = make_groups(query_lens or [1] * len(context_lens), context_lens, "cpu")
        for group_size in (1, 2):
            heads = torch.arange(2 * group_size) // group_size
            got = attend_paged(q, k_pages, v_pages, tables, groups, heads).numpy()
            error = float(np.max(np.abs(got - expected)))
            if not error <= atol:  # also catches NaN
                raise AssertionError(f"lens {query_lens}/{context_lens}, K/V heads x{group_size}: "
                                     f"max error {error} > {atol}")
            worst = max(worst, error)
    return worst


def peer_table(decode_cases, prefill_cases, repeats=5):
    """Markdown tables of the peers on the cases; a failing cell shows its error, the rest go on."""
    notes = []
    lines = ["| B | context | sdpa contiguous us | gather + sdpa us |", "|---|---|---|---|"]
    for batch, context in decode_cases:
        cells = [_cell(notes, fn, batch, context, repeats=repeats)
                 for fn in (time_decode_sdpa_contiguous, time_decode_gather_sdpa)]
        lines.append(f"| {batch} | {context} | {cells[0]} | {cells[1]} |")
    lines += ["", "| prefill case | T | sdpa contiguous us | gather + sdpa us |",
              "|---|---|---|---|"]
    for name, query_lens, context_lens in prefill_cases:
        cells = [_cell(notes, time_prefill_sdpa, query_lens, context_lens, paged=paged,
                       repeats=repeats) for paged in (False, True)]
        lines.append(f"| {name} | {sum(query_lens)} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines + [""] + [f"- {note}" for note in dict.fromkeys(notes)])


def _cell(notes, fn, *args, **kwargs):
    try:
        result = fn(*args, **kwargs)
        notes.append(result["note"])
        text = f"{result['seconds'] * 1e6:.1f} ({result['method']})"
    except Exception as error:  # OOM or unsupported: the table keeps going
        text = f"error: {type(error).__name__}: {_first_line(error)}"
    if torch_available()[0]:
        import torch
        torch.cuda.empty_cache()  # the failed case's tensors are gone now; hand their memory back
    return text


def _first_line(error):
    return (str(error).splitlines() or [""])[0][:100]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", choices=["cases", "grid"], default="cases",
                        help="decode cases: kernels.py's DECODE_CASES or DECODE_GRID")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from benchmarks import kernels  # the case lists live there (imported late: kernels imports us)
    print(f"torch: {torch_available()[1]}", flush=True)
    decode_cases = kernels.DECODE_CASES if args.cases == "cases" else kernels.DECODE_GRID
    print(peer_table(decode_cases, kernels.PREFILL_CASES, args.repeats))


if __name__ == "__main__":
    main()
