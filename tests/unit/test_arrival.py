"""A whole-model collective (state_dict, load_state_dict) checks first that every rank called it
(offload/distributed/arrival.py): a call on rank 0 alone -- HF Trainer.save_model -- is an error
naming the missing rank instead of a broadcast no peer pairs with. Ranks as threads over one
in-memory store (the rendezvous uses only the process group's store, never a collective)."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from offload.distributed.arrival import MissingRank, wait_for
from offload.errors import DistributedError


def _ranks(store, calls, namespace, timeout=5.0, gone=None):
    errors, threads = {}, []

    def run(rank, what, delay):
        time.sleep(delay)
        try:
            wait_for(store, rank, len(calls), what, timeout, namespace=namespace, gone=gone)
        except DistributedError as exc:
            errors[rank] = exc

    for rank, (what, delay) in enumerate(calls):
        threads.append(threading.Thread(target=run, args=(rank, what, delay)))
        threads[-1].start()
    for t in threads:
        t.join(30)
    return errors


def test_every_rank_calling_passes_and_keeps_passing():
    store = dist.HashStore()
    for _ in range(3):          # sequence numbers advance alike on every rank
        assert _ranks(store, [("state_dict", 0.0), ("state_dict", 0.2)], "ns-ok") == {}


def test_a_call_on_one_rank_alone_names_the_missing_rank():
    store = dist.HashStore()
    t0 = time.monotonic()
    with pytest.raises(MissingRank) as info:
        wait_for(store, 0, 2, "state_dict", 0.5, namespace="ns-alone")
    assert time.monotonic() - t0 < 5
    message = str(info.value)
    assert "rank 1 did not call it" in message and "save_strategy" in message, message
    assert info.value.failed_rank == 1
    # withdrawn: the ranks stay aligned, so a later call on both passes
    assert _ranks(store, [("state_dict", 0.0), ("state_dict", 0.0)], "ns-alone") == {}


def test_an_exited_peer_ends_the_wait_at_once():
    store = dist.HashStore()
    t0 = time.monotonic()
    with pytest.raises(MissingRank, match="its process .* has exited"):
        wait_for(store, 0, 2, "state_dict", 60, namespace="ns-gone",
                 gone=lambda: (1, "its process (pid 7) has exited"))
    assert time.monotonic() - t0 < 10


def test_ranks_in_different_whole_model_calls_both_stop():
    store = dist.HashStore()
    errors = _ranks(store, [("state_dict", 0.0), ("load_state_dict", 0.0)], "ns-mixed")
    assert sorted(errors) == [0, 1]
    assert "rank 1 called load_state_dict instead" in str(errors[0])


def test_a_long_wait_is_said_once_naming_the_missing_rank(capsys):
    """A whole-model call on rank 0 alone waits out a long timeout: after note_after seconds it
    says once, on stderr, whom it waits for and why (review of issue 27, R8)."""
    store = dist.HashStore()
    with pytest.raises(MissingRank):
        wait_for(store, 0, 2, "state_dict", 0.6, namespace="ns-note", note_after=0.1)
    err = capsys.readouterr().err
    assert err.count("offload: rank 0 waits in state_dict for rank 1") == 1, err
    assert "call it on every rank" in err and "OFFLOAD_ARRIVAL_TIMEOUT_S" in err
