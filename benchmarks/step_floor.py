"""What this machine can do for one offloaded step, with no engine at all.

Runs, for a LLaMA preset on the CPU, each alone and then side by side (medians of repeats):

* ``fb``: plain PyTorch forward + backward of the bf16 model (the bench's "compute");
* ``io``: the optimizer's NVMe traffic — fp32 master, exp_avg and exp_avg_sq of every chunk read
  and written back through ``offload.aio`` (four buffers in flight), as a spilled step needs;
* ``io+adam``: the same with the native Adam run on each chunk between its read and its write;
* ``fb || io`` and ``fb || io+adam``: a thread streams while the main thread computes.

``offload bench step`` bounds a step by max(compute, NVMe, Adam), as if each had its own
hardware; on a CPU-only box they share the cores, and ``fb || io+adam`` / ``fb`` says how far
from that bound even a perfect engine must stay here.

    python benchmarks/step_floor.py [--preset small] [--path ./offload-nvme] [--repeats 6]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--path", default="./offload-nvme", help="directory on the NVMe drive")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--chunk", type=int, default=786432, help="elements per chunk")
    args = parser.parse_args()

    import torch

    from offload.aio import AsyncIO, aligned_empty, free_bytes
    from offload.bench.workload import build_model, token_batch
    from offload.config import AioConfig
    from offload.optim.kernel import adam_step

    model, cfg = build_model(args.preset, "cpu")
    ids = token_batch(cfg, 512, "cpu")
    n = -(-sum(p.numel() for p in model.parameters()) // args.chunk)
    set_bytes = args.chunk * 4 * 3            # master + exp_avg + exp_avg_sq, fp32
    try:
        os.makedirs(args.path, exist_ok=True)
    except OSError as exc:
        print(f"step_floor: --path {args.path!r}: {exc.strerror}", file=sys.stderr)
        return 1
    if n * set_bytes * 1.2 > free_bytes(args.path):
        print(f"step_floor: {args.path} lacks {n * set_bytes / 1e9:.2f} GB of free space", file=sys.stderr)
        return 1
    work = tempfile.mkdtemp(prefix=".offload-floor-", dir=args.path)
    aio = AsyncIO(AioConfig())
    try:
        path = os.path.join(work, "state.swp")
        bufs = [aligned_empty(set_bytes, torch.uint8) for _ in range(4)]
        for c in range(n):
            aio.wait([aio.write_from(bufs[0], path, c * set_bytes)])
        grad = torch.zeros(args.chunk)
        out = torch.zeros(args.chunk, dtype=torch.bfloat16)

        def stream(adam: bool) -> None:
            writes = {}
            for c in range(n):
                slot = c % len(bufs)
                if slot in writes:
                    aio.wait([writes.pop(slot)])
                aio.wait([aio.read_into(bufs[slot], path, c * set_bytes)])
                if adam:
                    v = bufs[slot].view(torch.float32)
                    k = args.chunk
                    adam_step(v[:k], grad, v[k:2 * k], v[2 * k:], lr=1e-4, beta1=0.9, beta2=0.999,
                              eps=1e-8, weight_decay=0.0, step=1, out=out)
                writes[slot] = aio.write_from(bufs[slot], path, c * set_bytes)
            aio.wait(list(writes.values()))

        def fb() -> None:
            model(ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

        def timed(fn) -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        def side_by_side(adam: bool) -> None:
            t = threading.Thread(target=stream, args=(adam,))
            t.start()
            fb()
            t.join()

        runs = {"fb": fb, "io": lambda: stream(False), "io+adam": lambda: stream(True),
                "fb || io": lambda: side_by_side(False), "fb || io+adam": lambda: side_by_side(True)}
        times = {k: [] for k in runs}
        for _ in range(args.repeats + 1):          # the first round warms up and is dropped
            for name, fn in runs.items():
                times[name].append(timed(fn))
        med = {k: statistics.median(v[1:]) for k, v in times.items()}
        print(f"{args.preset}: {n} chunks of {args.chunk} elements, {n * set_bytes / 1e6:.0f} MB of "
              f"optimizer state read and written; medians of {args.repeats}")
        for name, t in med.items():
            print(f"  {name:14s} {t * 1e3:7.1f} ms")
        print(f"  fb || io+adam over fb: {med['fb || io+adam'] / med['fb']:.2f}x")
    finally:
        aio.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
