"""Imported by a :mod:`multiprocessing` forkserver (``set_forkserver_preload``): it then holds
what the multi-process tests' ranks import, as the warm-start server of :mod:`warm_spawn` does.

The forkserver found this module through a PYTHONPATH set for its start only; the variables
named in ``KVFERRY_TEST_RESTORE_ENV`` are put back first, so that the ranks forked from it see
the test process's environment."""

import json
import os

for _name, _value in json.loads(os.environ.pop("KVFERRY_TEST_RESTORE_ENV", "{}")).items():
    if _value is None:
        os.environ.pop(_name, None)
    else:
        os.environ[_name] = _value

import warm_spawn  # noqa: E402 (after the environment is put back)

warm_spawn.preload()

if len(os.listdir("/proc/self/task")) != 1:  # a preloaded library started a thread: forking is unsafe
    raise RuntimeError(f"warm_preload: {len(os.listdir('/proc/self/task'))} threads after the preload")
