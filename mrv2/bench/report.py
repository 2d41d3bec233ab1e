"""The throughput benchmark's summary: a table of tok/s and ratios per batch size, and a PNG plot."""

from __future__ import annotations

import textwrap
from pathlib import Path


def engines_of(results: dict[str, dict]) -> list[str]:
    """Engine names in first-seen order (the entries of each batch that hold a throughput)."""
    names: list[str] = []
    for result in results.values():
        names += [k for k, v in result.items() if isinstance(v, dict) and "output_tok_s" in v and k not in names]
    return names


def table(results: dict[str, dict], baseline: str) -> str:
    """Markdown table: one row per batch size, tok/s of each engine and `baseline`'s ratio over each other
    (for mrv2 over a peer timed in turn with it, the median of the per-pair ratios)."""
    engines = engines_of(results)
    peers = [e for e in engines if e != baseline]
    head = ["batch", *(f"{e} tok/s" for e in engines), *(f"{baseline}/{p}" for p in peers)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b, result in results.items():
        tok = {e: result[e]["output_tok_s"] if e in result else None for e in engines}
        cells = [b, *(f"{t:.1f}" if t else "-" for t in tok.values())]
        cells += [_ratio(result, baseline, p, tok) for p in peers]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio(result: dict, baseline: str, peer: str, tok: dict) -> str:
    paired = result[peer].get("ratio_mrv2_over_peer") if baseline == "mrv2" and peer in result else None
    if paired is not None:
        return f"{paired:.2f}x"
    return f"{tok[baseline] / tok[peer]:.2f}x" if tok.get(baseline) and tok[peer] else "-"


def plot(results: dict[str, dict], path: str | Path, title: str) -> None:
    """PNG of output tok/s against batch size, one line per engine."""
    fig = figure(results, title)
    fig.savefig(path, dpi=120)


def figure(results: dict[str, dict], title: str):
    """The plot's matplotlib figure (headless: not attached to pyplot or any display)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    for engine in engines_of(results):
        points = [(int(b), r[engine]["output_tok_s"]) for b, r in results.items() if engine in r]
        ax.plot(*zip(*points), marker="o", label=engine)
    ax.set_xscale("log", base=2)
    ax.set_xticks([int(b) for b in results], labels=list(results))
    ax.set_xlabel("batch size (concurrent requests)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(textwrap.fill(title, 80), fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig
