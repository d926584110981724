"""Imported by a :mod:`multiprocessing` forkserver (``set_forkserver_preload``): it then holds
what the multi-process tests' ranks import, as the warm-start server of :mod:`warm_spawn` does."""

import os

import warm_spawn

warm_spawn.preload()

if len(os.listdir("/proc/self/task")) != 1:  # a preloaded library started a thread: forking is unsafe
    raise RuntimeError(f"warm_preload: {len(os.listdir('/proc/self/task'))} threads after the preload")
