"""The package's layering rules, checked statically (ARCHITECTURE.md sections 1, 3 and 7).

Imports point down the layers: entrypoints > bench > engine > runner > the packages
below it (models, attention, sample, layers, loader, platforms and the leaf modules);
nothing below runner/ imports runner/; bench never imports the CLI; only
mrv2/platforms/ names a device. Every module of the package is parsed with `ast`
(imports inside functions count), so a regression fails here, not in review.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import mrv2

ROOT = Path(mrv2.__file__).parent

# Higher ranks may import lower ones, never the reverse.
RANKS = {"mrv2.entrypoints": 4, "mrv2.bench": 3, "mrv2.eval": 3, "mrv2.engine": 2, "mrv2.distributed.executors": 1, "mrv2.runner": 1}
BELOW_RUNNER = 0
# The engine <-> runner contract: plain data types the scheduler fills and the runner reads.
UPWARD_ALLOWED = {"mrv2.engine.scheduler_output"}

LEAVES = {"mrv2.kv_spec": {"mrv2.config"}, "mrv2.config": set(), "mrv2.staged_writes": set()}  # leaf -> the mrv2 modules it may import
DEVICE_NAME = re.compile(r"(cpu|cuda|npu)(:\d+)?")
DEVICE_ATTRS = {"is_cpu", "is_cuda", "is_npu", "cuda", "npu"}


def _module_name(path: Path) -> str:
    parts = ("mrv2",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def imports_of(tree: ast.AST, module: str, is_package: bool = False) -> set[str]:
    """The mrv2 modules `tree` imports (`from pkg import submodule` counts as the submodule)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if _is_module(sub) else base)
    return {m for m in found if m == "mrv2" or m.startswith("mrv2.")}


def _rank(module: str) -> int:
    if module == "mrv2":  # the public API (LLM, SamplingParams, outputs) sits on top
        return max(RANKS.values()) + 1
    for prefix, rank in RANKS.items():
        if module == prefix or module.startswith(prefix + "."):
            return rank
    return BELOW_RUNNER


def _modules() -> list[tuple[str, Path, ast.AST]]:
    return [(_module_name(p), p, ast.parse(p.read_text(), str(p))) for p in sorted(ROOT.rglob("*.py"))]


MODULES = _modules()


def layering_violations(module: str, imported: set[str]) -> list[str]:
    out = []
    for target in sorted(imported):
        if target == "mrv2":  # the package root re-exports engine types
            if _rank(module) < RANKS["mrv2.engine"]:
                out.append(f"{module} imports the package root `mrv2` (engine re-exports)")
        elif _rank(target) > _rank(module) and target not in UPWARD_ALLOWED:
            out.append(f"{module} imports {target}, a higher layer")
    if module in LEAVES:
        out += [f"leaf {module} imports {t}" for t in sorted(imported - LEAVES[module] - {module})]
    if module.startswith("mrv2.platforms"):
        out += [f"{module} imports {t}" for t in sorted(imported)
                if t != "mrv2.config" and not t.startswith("mrv2.platforms")]
    return out


def device_names(tree: ast.AST) -> list[str]:
    """Device-name string literals and device-testing attributes in `tree`, as 'line: what'."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and DEVICE_NAME.fullmatch(node.value):
            out.append(f"{node.lineno}: {node.value!r}")
        elif isinstance(node, ast.Attribute) and node.attr in DEVICE_ATTRS:
            out.append(f"{node.lineno}: .{node.attr}")
    return out


def test_the_package_is_parsed():
    names = {m for m, _, _ in MODULES}
    assert {"mrv2.kv_spec", "mrv2.runner.model_runner", "mrv2.attention.registry", "mrv2.engine.arg_utils"} <= names
    imported = imports_of(dict((m, t) for m, _, t in MODULES)["mrv2.runner.model_runner"], "mrv2.runner.model_runner")
    assert {"mrv2.attention", "mrv2.runner.kv_cache", "mrv2.kv_spec"} <= imported


@pytest.mark.parametrize("module,path,tree", MODULES, ids=[m for m, _, _ in MODULES])
def test_imports_point_down_the_layers(module, path, tree):
    assert not layering_violations(module, imports_of(tree, module, path.name == "__init__.py"))


@pytest.mark.parametrize("module,path,tree", [m for m in MODULES if not m[0].startswith("mrv2.platforms")],
                         ids=[m for m, _, _ in MODULES if not m.startswith("mrv2.platforms")])
def test_only_platforms_name_a_device(module, path, tree):
    assert not device_names(tree), f"{path.relative_to(ROOT.parent)} names a device; ask the Platform instead"


# -- the checks themselves catch what they should --

@pytest.mark.parametrize("module,source,expected", [
    ("mrv2.attention.x", "from mrv2.runner.kv_cache import LayerKVCache", "imports mrv2.runner.kv_cache"),
    ("mrv2.models.x", "def f():\n    import mrv2.runner.states", "imports mrv2.runner.states"),
    ("mrv2.sample.x", "from mrv2 import LLM", "package root"),
    ("mrv2.bench.x", "from mrv2.entrypoints.cli import engine_kwargs", "imports mrv2.entrypoints.cli"),
    ("mrv2.bench.x", "from mrv2.entrypoints import cli", "imports mrv2.entrypoints.cli"),
    ("mrv2.runner.x", "from mrv2.engine.llm import LLM", "imports mrv2.engine.llm"),
    ("mrv2.kv_spec", "from mrv2.layers.norm import RMSNorm", "leaf mrv2.kv_spec"),
    ("mrv2.platforms.x", "from mrv2.attention import registry", "mrv2.platforms.x imports mrv2.attention.registry"),
    ("mrv2.runner.graphs.x", "from ..states import RequestStates", "imports mrv2.runner.states"),
])
def test_layering_check_catches(module, source, expected):
    found = layering_violations(module, imports_of(ast.parse(source), module))
    if module == "mrv2.runner.graphs.x":  # relative, within the layer: allowed
        assert not found
    else:
        assert any(expected in v for v in found), found


def test_upward_exception_is_only_the_contract():
    assert not layering_violations("mrv2.runner.x", {"mrv2.engine.scheduler_output"})


@pytest.mark.parametrize("source", ['device.type == "cpu"', "x.is_cpu", "t.is_cuda", "torch.cuda.synchronize()",
                                    "torch.device('npu:0')", "x.cuda()"])
def test_device_check_catches(source):
    assert device_names(ast.parse(source))


def test_device_check_allows_prose():
    assert not device_names(ast.parse('"""Runs on CPU, CUDA and NPU."""\nhelp = "cpu, cuda or npu"'))
