"""Imported by a :mod:`multiprocessing` forkserver (``set_forkserver_preload``): it then holds
what the multi-process tests' ranks import, as the warm-start server of :mod:`warm_spawn` does."""

import warm_spawn

warm_spawn.preload()
