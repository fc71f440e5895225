"""The statistics of each optimizer step (``model.offload_stats()``), gathered from the components."""

from __future__ import annotations


class StepStats:
    """Reads, and resets, the per-step counters of the tracer, prefetcher, store, loss scaler,
    activation store and (under several ranks) collectives and gather."""

    def __init__(self, tracer, prefetcher, store, *, scaler=None, activations=None, timeline=None, comms=None,
                 gather=None, sharding=None):
        self.tracer = tracer
        self.prefetcher = prefetcher
        self.store = store
        self.scaler = scaler
        self.activations = activations
        self.timeline = timeline
        self.comms = comms
        self.gather = gather
        self.sharding = sharding

    def finish_step(self, step: int, applied: bool) -> dict:
        """The counters since the last step, as ``last_stats``; the trace is written out."""
        if self.timeline is not None:
            self.timeline.resolve()
        totals = self.tracer.take_totals()
        hits, misses = self.prefetcher.hits, self.prefetcher.misses
        stats = {
            "step": step,
            "applied": applied,
            "moved_bytes": self.store.moved_by_direction(),
            "prefetch_hit_rate": hits / (hits + misses) if hits + misses else None,
            "chunk_fetches": hits + misses,
            "wait_s": totals.get("wait", 0.0),
            "optimizer_s": totals.get("adam", 0.0),
            "optimizer_wait_s": totals.get("optimizer_wait", 0.0),
            "retraces": self.prefetcher.retraces,
            "loss_scale": self.scaler.scale if self.scaler is not None else None,
            "activations": self.activations.take_stats() if self.activations is not None else None,
        }
        if self.comms is not None:
            stats["collectives"] = {**self.comms.take_stats(), **self.gather.take_stats()}
            stats["rank"] = self.sharding.rank
            stats["world_size"] = self.sharding.world
        self.prefetcher.hits = self.prefetcher.misses = 0
        self.store.reset_counters()
        self.tracer.dump()
        return stats

    def report(self, last: dict, layout) -> dict:
        """``last`` plus the current memory report and the layout's shape."""
        return {**last, "memory": self.store.memory_report(),
                "layout": {"chunks": layout.num_chunks, "chunk_size": layout.chunk_size,
                           "params": layout.total_params, "trainable_chunks": len(layout.trainable_chunks),
                           "largest_chunk": layout.largest_chunk}}
