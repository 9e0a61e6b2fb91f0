"""The torch peers of benchmarks/e2e.py: Hugging Face transformers with jpaged's own weights.

- `build_hf_model`: transformers' LlamaForCausalLM from the same config JSON, every parameter
  copied from the jpaged model (`checkpoint_tensors`: Hugging Face names and layout), checked
  equal.
- `run_static`: `generate` with a static (contiguous, maximum-length) cache, batches of B in
  trace order, prompts left-padded; a batch decodes until its longest output, so tokens past a
  request's own length are thrown away.
- `run_continuous`: transformers' continuous batching (its paged cache, `paged|sdpa` attention)
  with each request's own output length, streamed, stopped after a time cap if one is given.
EOS is disabled in both, as in jpaged's run (every request produces its drawn length).
"""

import datetime
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np


def torch_device() -> str:
    """The torch device beside jax's backend: "cuda" when jax runs on a GPU, else "cpu"."""
    import jax

    return "cuda" if jax.default_backend() == "gpu" else "cpu"


def emit(text: str, out) -> str:
    """Print a results table and write it to `out` (a path; None: print only)."""
    if out:
        Path(out).write_text(text)
    print(text)
    return text


def run_lines(script: str) -> list[str]:
    """The device, date and versions of both frameworks, and the exact command: the first lines
    of a results table that compares jpaged with transformers."""
    import importlib.metadata as metadata

    import jax

    versions = {}
    for package in ("torch", "transformers"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "absent"
    return [f"device: {jax.devices()[0].device_kind}, date {datetime.date.today()}, jax "
            f"{jax.__version__}, torch {versions['torch']}, transformers "
            f"{versions['transformers']}, python {platform.python_version()}",
            f"command: python benchmarks/{script} " + " ".join(sys.argv[1:])]


def build_hf_model(config_path, jax_model, *, device, dtype_name="bfloat16",
                   attn_implementation=None):
    """transformers' model of config_path holding exactly jax_model's parameters
    (attn_implementation: e.g. "sdpa"; None: transformers' default)."""
    import torch
    import transformers

    from jpaged.models import checkpoint_tensors

    dtype = getattr(torch, dtype_name)
    raw = json.loads(Path(config_path).read_text())
    config = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    config.eos_token_id = None
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation)
    params = dict(model.named_parameters())
    tensors = checkpoint_tensors(jax_model)
    copied = 0
    for name, param in params.items():
        for target, array in _sources(name, param, tensors):
            source = torch.from_dlpack(array)     # a view of the jax buffer, no copy
            target.copy_(source)
            if not torch.equal(target, source.to(target.device)):
                raise ValueError(f"parameter {name} differs after the copy")
        copied += 1
    if copied != len(params):
        raise ValueError(f"copied {copied} of the torch model's {len(params)} parameters")
    model.generation_config.eos_token_id = None
    return model.eval()


# transformers' fused expert tensors [X, 2F, E] / [X, E, F] and the per-expert checkpoint
# tensors they stack, as (module, parts) for Qwen3-MoE and for Mixtral.
_EXPERT_SOURCES = {"gate_up_proj": (("mlp", ("gate_proj", "up_proj")),
                                    ("block_sparse_moe", ("w1", "w3"))),
                   "down_proj": (("mlp", ("down_proj",)), ("block_sparse_moe", ("w2",)))}


def _sources(name: str, param, tensors: dict):
    """[(part of param's data, the checkpoint array copied into it)]: the tensor of that name
    (Mixtral's router: under its checkpoint's module name), or for a fused expert tensor
    ('model.layers.3.mlp.experts.gate_up_proj') each expert's parts concatenated along the
    output axis, as transformers fuses them when it loads."""
    for source in (name, name.replace(".mlp.", ".block_sparse_moe.")):   # Mixtral's router
        if source in tensors:
            return [(param.data, tensors[source])]
    layer, _, kind = name.rpartition(".mlp.experts.")
    for module, parts in _EXPERT_SOURCES.get(kind, ()):
        names = [[f"{layer}.{module}.experts.{x}.{part}.weight" for part in parts]
                 for x in range(param.shape[0])]
        if all(n in tensors for n in names[0]):
            pieces = []
            for x, row in enumerate(names):
                start = 0
                for part_name in row:                # [F, E] (or [E, F]) rows, in order
                    size = tensors[part_name].shape[0]
                    pieces.append((param.data[x, start:start + size], tensors[part_name]))
                    start += size
            return pieces
    raise KeyError(f"no checkpoint tensor for transformers' parameter {name}")


def static_kv_utilisation(batch) -> float:
    """Mean over a static batch's decode steps of token states over cache slots: request i
    holds p_i + min(t, o_i - 1) real tokens at step t of max(o) in a cache of max(p) + max(o)."""
    prompt, steps = max(r.input_len for r in batch), max(r.output_len for r in batch)
    held = sum(sum(r.input_len + min(t, r.output_len - 1) for r in batch) for t in range(steps))
    return held / (steps * len(batch) * (prompt + steps))


def run_static(model, trace, prompts, *, batch_size, max_batches=None, device, compile=True):
    """generate with cache_implementation="static" over the trace in batches; returns a dict.
    compile=False turns off transformers' automatic torch.compile of the static-cache decode
    step (on by default on a GPU; its compile time then falls inside the first batch)."""
    import torch

    batches = [list(range(i, min(i + batch_size, len(trace))))
               for i in range(0, len(trace), batch_size)][:max_batches]
    useful = decoded = 0
    utilisation = []
    start = time.perf_counter()
    for indices in batches:
        longest = max(trace[i].input_len for i in indices)
        new_tokens = max(trace[i].output_len for i in indices)
        ids = torch.zeros((len(indices), longest), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(indices):             # left padding, as generate expects
            ids[row, longest - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, longest - len(prompts[i]):] = 1
        with torch.no_grad():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, cache_implementation="static",
                                 pad_token_id=0, disable_compile=not compile)
        if device != "cpu":
            torch.cuda.synchronize()
        if out.shape[1] != longest + new_tokens:
            raise RuntimeError(f"generate stopped at {out.shape[1] - longest} of {new_tokens}")
        useful += sum(trace[i].output_len for i in indices)
        decoded += len(indices) * new_tokens
        utilisation.append(static_kv_utilisation([trace[i] for i in indices]))
    wall = time.perf_counter() - start
    requests = sum(len(b) for b in batches)
    return dict(wall=wall, requests=requests, output_tokens=useful, decoded_tokens=decoded,
                max_concurrent=batch_size, kv_utilisation=float(np.mean(utilisation)),
                capped=len(batches) * batch_size < len(trace),
                note=f"{len(batches)} batch(es) of {batch_size}: requests 0-{requests - 1}, "
                     + ("transformers' automatic torch.compile allowed (its time, if any, "
                        "included)" if compile else "eager (compile off)"))


def run_continuous(model, trace, prompts, *, num_blocks, block_size, max_batch_tokens,
                   time_cap=None, warmup=True):
    """transformers' continuous batching over the whole trace (all arriving at once), streamed;
    stops after time_cap seconds of generation (tokens produced by then are counted)."""
    import transformers

    generation = transformers.GenerationConfig(do_sample=False, max_new_tokens=max(
        r.output_len for r in trace), eos_token_id=-1, pad_token_id=0)
    cb_config = transformers.ContinuousBatchingConfig(
        block_size=block_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens)
    manager = model.init_continuous_batching(generation_config=generation,
                                             continuous_batching_config=cb_config)
    warm_start = time.perf_counter()
    if warmup:
        manager.warmup()
    warmup_seconds = time.perf_counter() - warm_start
    manager.start()
    produced, finished, samples = {}, set(), []
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        manager.add_request(prompt, request_id=str(index), max_new_tokens=trace[index].output_len,
                            streaming=True, eos_token_id=-1)
    while len(finished) < len(trace):
        if time_cap is not None and time.perf_counter() - start > time_cap:
            break
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' generation thread stopped")
            continue
        if result.error is not None:
            raise RuntimeError(f"request {result.request_id} failed: {result.error}")
        produced[result.request_id] = len(result.generated_tokens)
        if result.is_finished():
            finished.add(result.request_id)
        samples.append(_cb_sample(manager, produced, finished, trace))
    wall = time.perf_counter() - start
    manager.stop(block=True, timeout=30, hard_stop=True)
    manager.destroy()
    samples = [s for s in samples if s is not None]
    return dict(wall=wall, requests=len(finished), output_tokens=sum(produced.values()),
                decoded_tokens=sum(produced.values()), warmup_seconds=warmup_seconds,
                max_concurrent=max((s[0] for s in samples), default=None),
                kv_utilisation=float(np.mean([s[1] for s in samples])) if samples else None,
                capped=len(finished) < len(trace),
                note=(f"stopped after {time_cap:.0f} s: {len(finished)} of {len(trace)} "
                      f"requests finished, tokens of unfinished ones counted"
                      if len(finished) < len(trace) else "whole trace"))


def _cb_sample(manager, produced, finished, trace):
    """(active requests, token states / KV held) read from transformers' batch processor now, or
    None if its internals differ from 5.17's."""
    try:
        processor = manager.batch_processor
        active = len(processor.scheduler.active_requests)
        cache = processor.cache
        held = (cache.num_blocks - cache.get_num_free_blocks()) * cache.block_size
    except AttributeError:
        return None
    states = sum(trace[int(i)].input_len + n for i, n in produced.items() if i not in finished)
    return active, min(1.0, states / held) if held else 0.0
