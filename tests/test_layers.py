"""The layering rule: core is pure, adapters never import app, and __all__ is honest."""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORE_ALLOWED_THIRD_PARTY = {"attrs", "attr"}
FORBIDDEN_IN_CORE = {
    "torch",
    "zmq",
    "numpy",
    "msgpack",
    "threading",
    "socket",
    "subprocess",
    "multiprocessing",
    "os",
    "time",
    "random",
    "logging",
    "asyncio",
    "mmap",
    "select",
    "signal",
    "pickle",
}


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _layer_files(layer: str) -> list[pathlib.Path]:
    return sorted((ROOT / layer).rglob("*.py"))


def test_core_imports_only_stdlib_and_attrs() -> None:
    stdlib = set(sys.stdlib_module_names)
    for path in _layer_files("core"):
        for name in _imports(path):
            top = name.split(".")[0]
            if name.startswith("kvferry."):
                assert name.startswith("kvferry.core"), f"{path.name} imports {name}"
                continue
            assert top not in FORBIDDEN_IN_CORE, f"{path.name} imports {name}"
            assert top in stdlib or top in CORE_ALLOWED_THIRD_PARTY, f"{path.name} imports {name}"


def test_adapters_never_import_app() -> None:
    for path in _layer_files("adapters"):
        for name in _imports(path):
            assert not name.startswith("kvferry.app"), f"{path} imports {name}"


def test_importing_core_loads_no_heavy_module() -> None:
    code = (
        "import sys, kvferry.core, pkgutil, importlib\n"
        "import kvferry.core as c\n"
        "for m in pkgutil.iter_modules(c.__path__):\n"
        "    importlib.import_module('kvferry.core.' + m.name)\n"
        "bad = [m for m in ('torch', 'zmq', 'numpy', 'msgpack') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing kvferry.core loaded {out.stdout.strip()}"


@pytest.mark.parametrize("layer", ["kvferry.core", "kvferry.adapters", "kvferry.app"])
def test_public_api_is_listed_and_importable(layer: str) -> None:
    module = importlib.import_module(layer)
    exported = getattr(module, "__all__", None)
    assert isinstance(exported, list), f"{layer} has no __all__ list"
    for name in exported:
        assert hasattr(module, name), f"{layer}.__all__ names {name} which does not exist"


def test_no_pickle_or_eval_on_any_wire() -> None:
    for layer in ("core", "adapters", "app"):
        for path in _layer_files(layer):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                    assert not any(n.split(".")[0] in {"pickle", "cPickle", "dill", "marshal"} for n in names), path
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                    assert node.func.id not in {"eval", "exec"}, f"{path}: {node.func.id}()"
                if isinstance(node, ast.Attribute):
                    assert node.attr not in {
                        "broadcast_object_list",
                        "send_object_list",
                        "recv_object_list",
                        "all_gather_object",
                        "gather_object",
                        "scatter_object_list",
                    }, f"{path}: torch.distributed.{node.attr} pickles; use the data-only codec"


TOOL_PACKAGES = ("bench", "cli", "compat", "demo", "inspect", "plan")


def test_the_library_never_imports_the_tools() -> None:
    # app/'s top level is what an engine embeds; tools and compat sit on top of it
    for path in sorted((ROOT / "app").glob("*.py")):
        for name in _imports(path):
            for tool in TOOL_PACKAGES:
                assert not name.startswith(f"kvferry.app.{tool}"), f"{path.name} imports {name}"


def _source_dirs() -> list[pathlib.Path]:
    return sorted({p.parent for layer in ("core", "adapters", "app") for p in _layer_files(layer)})


def _test_dirs() -> list[pathlib.Path]:
    return sorted({p.parent for p in (ROOT / "tests").rglob("*.py") if ".venv" not in p.parts})


def test_no_folder_keeps_a_family_of_modules_sharing_a_prefix() -> None:
    # three or more modules named <prefix>_* belong in a package <prefix>/ (test folders too;
    # there the test_*.py modules are the one family pytest expects)
    for folder in _source_dirs() + _test_dirs():
        prefixes: dict[str, list[str]] = {}
        for path in folder.glob("*.py"):
            if path.stem.startswith(("_", "test_")):
                continue
            prefixes.setdefault(path.stem.split("_")[0], []).append(path.stem)
        families = {k: v for k, v in prefixes.items() if len(v) >= 3}
        assert not families, f"{folder.relative_to(ROOT)}: {families}"


def test_every_package_is_installed() -> None:
    # a folder with an __init__.py that pyproject does not list is missing from a wheel install
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    found = {
        "kvferry." + ".".join(init.parent.relative_to(ROOT).parts)
        for layer in ("core", "adapters", "app")
        for init in (ROOT / layer).rglob("__init__.py")
    }
    assert found == listed
    for name in listed:
        assert setup["package-dir"][name] == name[len("kvferry.") :].replace(".", "/")
