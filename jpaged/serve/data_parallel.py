"""Data-parallel serving: independent engine replicas on disjoint device groups behind one
endpoint, each request routed to the replica with the most free KV blocks.

Every replica is a whole engine (its own scheduler, block manager, KV cache and model copy,
tensor-parallel over its own group when asked) on its own thread (`AsyncEngine`); they share
nothing but the process. `DataParallelEngine` has AsyncEngine's interface (add, abort, start,
stop, is_alive, dead_reason, metrics), so the server cannot tell the two apart. One dead replica
makes the whole server dead, so that it exits and its supervisor restarts every replica.

Routing reads each replica's latest stats snapshot (free blocks) less the prompt blocks of the
requests routed to it that it has not yet scheduled, so a burst arriving between two snapshots
spreads over the replicas instead of piling onto the one that looked emptiest.
"""

import threading

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from jpaged import parallel
from jpaged.serve.async_engine import AsyncEngine
from jpaged.engine.llm_engine import LLMEngine


def pick_replica(free_blocks: list[int]) -> int:
    """The replica with the most free KV blocks (the first of those tied)."""
    return max(range(len(free_blocks)), key=lambda index: (free_blocks[index], -index))


class DataParallelEngine:
    """Replicas behind one `add`/`abort` interface."""

    def __init__(self, replicas: list[AsyncEngine]):
        if not replicas:
            raise ValueError("at least one replica is needed")
        self.replicas = list(replicas)
        self.model_name = replicas[0].model_name
        self.engine = replicas[0].engine   # for the server's model information
        self.metrics = MergedMetrics(self.replicas)
        self.num_routed = [0] * len(replicas)
        self._lock = threading.Lock()
        self._owner: dict[str, int] = {}        # request id -> replica index, while in flight
        self._waiting: dict[str, int] = {}      # request id -> its prompt blocks, until scheduled
        self._unscheduled = [0] * len(replicas)  # per replica: the sum of those blocks

    @classmethod
    def from_pretrained(cls, model, model_name: str, *, data_parallel_size: int,
                        tensor_parallel_size: int = 1, **options) -> "DataParallelEngine":
        """data_parallel_size engines over disjoint groups of tensor_parallel_size devices."""
        groups = parallel.device_groups(data_parallel_size, tensor_parallel_size)
        return cls([AsyncEngine(LLMEngine.from_pretrained(
            model, tensor_parallel_size=tensor_parallel_size, devices=group, **options),
            model_name) for group in groups])

    # ---- AsyncEngine's interface ------------------------------------------------------------
    def start(self) -> "DataParallelEngine":
        for replica in self.replicas:
            replica.start()
        return self

    def stop(self, timeout: float = 10.0):
        for replica in self.replicas:
            replica.stop(timeout)

    @property
    def is_alive(self) -> bool:
        return all(replica.is_alive for replica in self.replicas)

    @property
    def dead_reason(self) -> str | None:
        """Why a replica can no longer run steps (the first such), or None."""
        for index, replica in enumerate(self.replicas):
            reason = replica.dead_reason
            if reason is not None:
                return f"replica {index}: {reason}"
        return None

    def add(self, sink, request_id: str, params, *, prompt_token_ids: list[int]):
        """Queue a request on the replica with the most free blocks (see the module docstring)."""
        with self._lock:
            free = [replica.snapshot["num_free_blocks"] - pending
                    for replica, pending in zip(self.replicas, self._unscheduled)]
            index = pick_replica(free)
            blocks = -(-len(prompt_token_ids) // self.replicas[index].engine.config.block_size)
            self._owner[request_id] = index
            self._waiting[request_id] = blocks
            self._unscheduled[index] += blocks
            self.num_routed[index] += 1
        self.replicas[index].add(_RoutedSink(self, sink, request_id), request_id, params,
                                 prompt_token_ids=prompt_token_ids)

    def abort(self, request_id: str):
        with self._lock:
            index = self._owner.get(request_id)
            self._settle(request_id, is_done=True)
        if index is not None:
            self.replicas[index].abort(request_id)

    def _settle(self, request_id: str, is_done: bool):
        """The request was scheduled (its blocks show in its replica's snapshot from now on),
        and maybe ended. Idempotent; call with the lock held."""
        blocks = self._waiting.pop(request_id, None)
        if blocks is not None:
            self._unscheduled[self._owner[request_id]] -= blocks
        if is_done:
            self._owner.pop(request_id, None)

    def _progress(self, request_id: str, is_done: bool):
        with self._lock:
            self._settle(request_id, is_done)


class _RoutedSink:
    """Forwards a replica's events to the caller's sink, telling the router when the request was
    first scheduled (its blocks now show in the replica's snapshot) and when it ended."""

    def __init__(self, router: DataParallelEngine, sink, request_id: str):
        self._router, self._sink, self._request_id = router, sink, request_id

    def put(self, event: tuple):  # called from the replica's engine thread
        kind, _, payload = event
        if kind in ("output", "error"):
            self._router._progress(self._request_id, kind == "error" or payload.finished)
        self._sink.put(event)


class MergedMetrics:
    """Every replica's Prometheus metrics in one exposition, each sample labelled `replica`."""

    def __init__(self, replicas: list[AsyncEngine]):
        self._replicas = replicas
        self._registry = CollectorRegistry()
        self._registry.register(self)

    def collect(self):
        families: dict[str, Metric] = {}
        for index, replica in enumerate(self._replicas):
            for family in replica.metrics.registry.collect():
                merged = families.setdefault(family.name, Metric(
                    family.name, family.documentation, family.type, family.unit))
                for sample in family.samples:
                    merged.add_sample(sample.name, {**sample.labels, "replica": str(index)},
                                      sample.value, sample.timestamp, sample.exemplar)
        return list(families.values())

    def render(self) -> bytes:
        return generate_latest(self._registry)
