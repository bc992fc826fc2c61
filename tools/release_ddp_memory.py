"""What gradient release saves under DDP: the peak resident memory over a few steps of a model with 128 MiB of
fp32 grads, on one gloo rank (DDP runs its reducer, buckets and comm hooks as on many), with and without
``opt.release_with(ddp_model)``, for both ``gradient_as_bucket_view`` settings. Each run in its own process.

    python tools/release_ddp_memory.py

The number is the peak above the memory between steps (sampled every 0.5 ms), glibc told to hand freed tensors
back at once (``MALLOC_MMAP_THRESHOLD_``) so that a freed grad shows as freed. docs/gradient-release.md quotes it.
"""

import os
import subprocess
import sys
import tempfile
import threading
import time

LAYERS, WIDTH = 32, 1024  # 32 M params: 128 MiB of fp32 grads; DDP's default 25 MiB buckets


def run(release: bool, view: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import fastoptim
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
        opt = fastoptim.AdamW(net.parameters(), lr=1e-4, gradient_release=release)
        ddp = DistributedDataParallel(net, gradient_as_bucket_view=view)
        if release:
            opt.release_with(ddp)
        x = torch.randn(8, WIDTH)
        page = os.sysconf("SC_PAGE_SIZE")

        def rss() -> float:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * page / 2**20

        def step():
            ddp(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

        for _ in range(2):  # states made, DDP's buckets rebuilt
            step()
        base, peak, running = rss(), [0.0], [True]

        def sample():
            while running[0]:
                peak[0] = max(peak[0], rss())
                time.sleep(0.0005)

        sampler = threading.Thread(target=sample)
        sampler.start()
        for _ in range(4):
            step()
        running[0] = False
        sampler.join()
        print(f"| {'on' if release else 'off'} | {view} | +{peak[0] - base:.0f} |")
        dist.destroy_process_group()


def main() -> None:
    if len(sys.argv) == 3:
        run(sys.argv[1] == "1", sys.argv[2] == "1")
        return
    print(f"grads: {LAYERS * WIDTH * WIDTH * 4 / 2**20:.0f} MiB\n\n| release | gradient_as_bucket_view | "
          "peak above the memory between steps (MiB) |\n|---|---|---|", flush=True)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    for release in ("0", "1"):
        for view in ("0", "1"):
            subprocess.run([sys.executable, __file__, release, view], env=env, check=True)


if __name__ == "__main__":
    main()
