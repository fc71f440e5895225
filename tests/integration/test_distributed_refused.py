"""Under a process group of several ranks, ``offload.wrap`` refuses (each rank would otherwise
train its own copy with no gradient exchange); a group of one rank is a single process and works.
Real gloo process groups in spawned processes."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import offload


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = torch.nn.Linear(8, 8)
        try:
            wrapped = offload.wrap(model, offload.OffloadConfig(device="cpu", dtype="fp32", cpu_budget="1MiB"))
            wrapped.offload_engine.close()
            results[rank] = "wrapped"
        except offload.UnsupportedError as exc:
            results[rank] = str(exc)
    finally:
        dist.destroy_process_group()


def _run(world: int) -> dict:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(world, _free_port(), results), nprocs=world, join=True)
        return dict(results)


def test_two_ranks_are_refused_with_a_clear_error():
    results = _run(2)
    assert len(results) == 2
    for message in results.values():
        assert "2 ranks" in message and "not supported yet" in message


def test_a_group_of_one_rank_wraps():
    assert _run(1) == {0: "wrapped"}
