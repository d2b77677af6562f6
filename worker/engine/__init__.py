"""The engine: cases run on one build in a kernel host.

    host/               the kernel host: child (the subprocess: one build, JSON lines over pipes),
                        client (KernelHost, its parent), protocol (the lines)
    fast.py             the fast battery runner (waves of padded arenas, CUDA graphs)
    trajectory.py       one case the straightforward way (and the co-run's kernels-only path)
    gradients.py        deterministic gradient streams
    digest.py           the per-step od2 digest
    environment.py      the environment fingerprint
    corun.py            a battery on one build, or commit and baseline builds side by side
    kernels_only.py     the fast engine without references (the co-run's waves, the cache's first pass)
    params_file.py      the co-run's parameter file: layout, checked reader, per-step diffs
    reference_cache.py  references computed once: metric series of known trajectories
"""
