"""torchvision's Python half beside CPU torch, for the omni test venv only.

PyPI's torchvision wheels are CUDA builds: their C++ ops (``torchvision/_C.so``) need
``libtorch_cuda``, so beside CPU torch they do not load. torchvision copes with that everywhere
but one place: ``torchvision/_meta_registrations.py`` registers fakes for ``torchvision::nms`` and
``torchvision::qnms`` unconditionally, and that raises "operator torchvision::nms does not exist".
This shim (imported by a ``.pth`` line that ``.ci/venv-omni`` writes) declares those two schemas, without a
kernel, just before that module runs, and only when the C++ ops did not load. The pure-Python
transforms (all transformers' image processors use) work; calling ``torchvision.ops.nms`` raises.
Importing this module costs nothing until torchvision is imported.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any

_TARGET = "torchvision._meta_registrations"
#: the operators torchvision 0.28's _meta_registrations registers fakes for without checking
_OPS = ("nms", "qnms")
_libs: list[Any] = []  # the Library object must outlive the import


class _DeclareNms(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        import torch
        import torchvision.extension

        if not torchvision.extension._has_ops():
            lib = torch.library.Library("torchvision", "DEF")
            for op in _OPS:
                lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _libs.append(lib)
        return None  # the ordinary finders load the module


if not any(isinstance(f, _DeclareNms) for f in sys.meta_path):
    sys.meta_path.insert(0, _DeclareNms())
