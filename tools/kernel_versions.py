"""Two versions of one of the CPU platform's C++ kernel files in one process, for the tools that time them
against each other (`gemv_ab.py`, `attention_ab.py`): its sources at a git revision or in the working tree,
built with its ops under a namespace of their own."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from torch.utils.cpp_extension import load

from mrv2.platforms.cpu_kernels import SOURCE_FILES

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "mrv2/platforms/cpu_kernels"


def kernel_files(main: str) -> list[str]:
    """`main` (a .cpp file of the kernels) and every .inc file it may include."""
    return [main] + [f.name for f in SOURCE_FILES if f.suffix == ".inc"]


def sources_at(rev: str, main: str) -> dict[str, str]:
    """`kernel_files(main)` as they are at git revision `rev` (those it has)."""
    shown = {name: subprocess.run(["git", "show", f"{rev}:{KERNELS.relative_to(ROOT) / name}"], cwd=ROOT,
                                  capture_output=True, text=True) for name in kernel_files(main)}
    return {name: run.stdout for name, run in shown.items() if run.returncode == 0}


def working_sources(main: str) -> dict[str, str]:
    """`kernel_files(main)` as they are in the working tree."""
    return {name: (KERNELS / name).read_text() for name in kernel_files(main)}


def build(name: str, main: str, files: dict[str, str], library: str, folder: Path) -> None:
    """Build `main` from `files` (name -> text) in `folder`, its ops moved from namespace `library` to `name`."""
    folder.mkdir()
    for file, text in files.items():
        if file == main:
            for macro in ("TORCH_LIBRARY", "TORCH_LIBRARY_FRAGMENT", "TORCH_LIBRARY_IMPL"):
                text = text.replace(f"{macro}({library},", f"{macro}({name},")
        (folder / file).write_text(text)
    load(name=f"{name}_ext", sources=[str(folder / main)], extra_cflags=["-O3", "-fopenmp"],
         extra_ldflags=["-fopenmp"], is_python_module=False)


def alternate(step: Callable[[str], object], rounds: int, calls: int = 1) -> dict[str, list[float]]:
    """Seconds a call of `step("old")` and of `step("new")` took in each of `rounds` rounds (the mean of `calls`
    calls), the two versions in turn, their order alternating from round to round."""
    took: dict[str, list[float]] = {"old": [], "new": []}
    for r in range(rounds):
        for name in ("old", "new") if r % 2 else ("new", "old"):
            start = time.perf_counter()
            for _ in range(calls):
                step(name)
            took[name].append((time.perf_counter() - start) / calls)
    return took
