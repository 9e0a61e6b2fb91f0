"""torch SDPA on contiguous copies of a prefill case's pages, cuDNN forced where it runs: the dense
peer of benchmarks/kernels_prefill.py.

The copies come from the very pages the Pallas kernels read (a jnp gather per group of sequences
with one (query_len, context_len), handed to torch through DLPack before timing), so the outputs
compare. Backends are tried in order, each alone under `torch.nn.attention.sdpa_kernel`: cuDNN
with enable_gqa, cuDNN with K/V repeated per query head (copied before timing), flash,
memory-efficient (K/V repeated: it has no GQA), math (only while its float32 scores [G, H, Q, C]
stay under 8 GiB); the first that runs every group of the case is timed and named. Masks: none
for a decode row, is_causal for a chunk without a cached prefix (torch's top-left causal is right
there), else lower-right causal: an explicit boolean [Q, C] mask for cuDNN and math,
`causal_lower_right` for flash and memory-efficient (their own lower-right causal, no mask read).
Timed as torch_peers.py does: a CUDA graph of the step, replayed.
"""

from benchmarks import timing, torch_peers

# (label, torch SDPBackend name, K/V repeated per query head, mask of a chunk after a prefix:
# a boolean tensor, or torch's lower-right causal bias, which flash runs natively and
# memory-efficient as its own mask type, with no mask tensor read)
ATTEMPTS = (("cudnn", "CUDNN_ATTENTION", False, "tensor"),
            ("cudnn, K/V repeated per query head", "CUDNN_ATTENTION", True, "tensor"),
            ("flash", "FLASH_ATTENTION", False, "lower_right"),
            ("efficient, K/V repeated per query head", "EFFICIENT_ATTENTION", True,
             "lower_right"),
            ("math", "MATH", False, "tensor"))
MATH_MAX_SCORE_BYTES = 8 << 30


def contiguous_kv(pages, block_tables, seqs, context_len):
    """jnp: pages [K, N, S, D], block_tables [B, M] int32 -> [G, K, C, D], the first context_len
    keys of each sequence in seqs ([G] indices), contiguous."""
    import jax.numpy as jnp
    num_kv_heads, _, block_size, head_dim = pages.shape
    num_blocks = -(-context_len // block_size)
    tables = block_tables[jnp.asarray(seqs)][:, :num_blocks]                  # [G, M']
    gathered = jnp.moveaxis(pages[:, tables], 0, 1)                          # [G, K, M', S, D]
    return gathered.reshape(len(seqs), num_kv_heads, num_blocks * block_size,
                            head_dim)[:, :, :context_len]


def _group_kv(torch, args, groups, repeats):
    """{group index: (k, v) torch [G, K * repeats, C, D]} from the case's pages."""
    import jax
    _, k_pages, v_pages, block_tables, _, _ = args
    kv = {}
    for group in groups:
        seqs = (list(range(block_tables.shape[0])) if group.seqs is None
                else group.seqs.tolist())
        pair = []
        for pages in (k_pages, v_pages):
            copy = jax.block_until_ready(contiguous_kv(pages, block_tables, seqs,
                                                       group.context_len))
            tensor = torch.from_dlpack(copy)
            pair.append(tensor.repeat_interleave(repeats, dim=1) if repeats > 1 else tensor)
        kv[group.index] = tuple(pair)
    return kv


def _masks(torch, groups, device, lower_right):
    """{(Q, C): the mask of a Q-token chunk after a cached prefix, C keys}: a [Q, C] boolean
    tensor, or torch's lower-right causal bias object (lower_right=True)."""
    from torch.nn.attention.bias import causal_lower_right
    masks = {}
    for group in groups:
        query_len, context_len = group.query_len, group.context_len
        if 1 < query_len < context_len:
            masks[query_len, context_len] = (causal_lower_right(query_len, context_len) if lower_right
                                  else torch.ones(query_len, context_len, dtype=torch.bool,
                                                  device=device).tril(context_len - query_len))
    return masks


def _step(torch, q, groups, kv, masks, backend):
    """The case's SDPA calls under one forced backend: () -> [T, H, D]."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    forced = getattr(SDPBackend, backend)

    def attend(chunk, k, v):  # chunk [G, H, Q, D]; k, v [G, H', C, D]
        query_len, context_len = chunk.shape[2], k.shape[2]
        options = {"enable_gqa": True} if k.shape[1] != chunk.shape[1] else {}
        if query_len == context_len:
            options["is_causal"] = True
        elif query_len > 1:
            options["attn_mask"] = masks[query_len, context_len]
        return sdpa(chunk, k, v, **options)

    def step():
        with sdpa_kernel([forced]):
            return torch_peers.attend_groups(q, groups, lambda g: kv[g.index], attend)
    return step


def _math_fits(groups, num_heads):
    return all(g.num_seqs * num_heads * g.query_len * g.context_len * 4 <= MATH_MAX_SCORE_BYTES
               for g in groups)


def run_case(args, query_lens, context_lens, *, repeats=5):
    """args: kernels_prefill.prefill_case's (q [T, H, D], pages, tables, ...), on the device the
    torch build sees. Returns {"seconds", "backend", "method", "out" torch [T, H, D], "failed":
    [attempts that did not run, with why]}; raises RuntimeError when no backend runs."""
    import torch
    q = torch.from_dlpack(args[0])
    device = q.device
    on_cuda = device.type == "cuda"
    groups = torch_peers.make_groups(query_lens, context_lens, device)
    group_size = q.shape[1] // args[1].shape[0]
    kv_by_repeat, failed = {}, []
    for label, backend, repeat, mask_kind in ATTEMPTS:
        if backend == "MATH" and not _math_fits(groups, q.shape[1]):
            failed.append(f"{label}: scores would pass {MATH_MAX_SCORE_BYTES >> 30} GiB")
            continue
        repeats_kv = group_size if repeat else 1
        if repeats_kv not in kv_by_repeat:
            kv_by_repeat[repeats_kv] = _group_kv(torch, args, groups, repeats_kv)
        masks = _masks(torch, groups, device, lower_right=mask_kind == "lower_right")
        step = _step(torch, q, groups, kv_by_repeat[repeats_kv], masks, backend)
        try:
            out = step()
            if on_cuda:
                torch.cuda.synchronize()  # a kernel's own failure surfaces here, not later
        except Exception as error:  # noqa: BLE001 ("No available kernel": this one refuses)
            failed.append(f"{label}: {(str(error).splitlines() or [''])[0][:100]}")
            continue
        seconds, method = _time(torch, step, on_cuda, repeats)
        return dict(seconds=seconds, backend=label, method=method, out=out, failed=failed)
    raise RuntimeError("no SDPA backend ran: " + "; ".join(failed))


def _time(torch, step, on_cuda, repeats):
    """(seconds per step, "cuda graph" | "eager")."""
    if not on_cuda:
        return timing.median_dispatch_seconds(step, [()], wait=lambda out: None,
                                              repeats=repeats), "eager"
    try:
        run, method = torch_peers._graph(torch, step), "cuda graph"
    except Exception:  # noqa: BLE001 (an op refused capture: time the same step eagerly)
        torch.cuda.synchronize()
        run, method = step, "eager"
    return timing.median_dispatch_seconds(run, [()], wait=lambda out: torch.cuda.synchronize(),
                                          repeats=repeats), method


def max_difference(ours, theirs) -> float:
    """Largest |ours - theirs| (jax and torch arrays of one shape), in float32."""
    import torch
    return float((torch.from_dlpack(ours).float() - theirs.float()).abs().max())
