"""A pytest plugin that runs the reference's own unit tests against compat: a module-name
mapping and nothing else. Loaded with ``-p reference_alias`` in the reference venv (the rest of
the reference, e.g. its request classes, stays the reference's own).
"""

import importlib
import sys

#: the reference's module -> the compat module with the same public names
ALIASES = {
    "vllm_omni.distributed.omni_connectors.kv_transfer_manager": "kvferry.app.compat.manager",
    "vllm_omni.distributed.omni_connectors.utils.kv_utils": "kvferry.app.compat.kv_utils",
    "vllm_omni.distributed.omni_connectors.utils.initialization": "kvferry.app.compat.initialization",
}

for name, target in ALIASES.items():
    parent, _, leaf = name.rpartition(".")
    module = importlib.import_module(target)
    sys.modules[name] = module
    setattr(importlib.import_module(parent), leaf, module)
