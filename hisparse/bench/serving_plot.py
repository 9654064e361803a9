"""The serving benchmark's figures: throughput against concurrency, one line per mode, with each mode's
admission limit marked (past it, more concurrency only queues); and TTFT / ITL against concurrency."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {"baseline": {"color": "tab:gray", "marker": "o", "label": "baseline (all KV on the device)"},
         "hisparse": {"color": "tab:blue", "marker": "s", "label": "HiSparse (hot buffer on the device)"},
         "ceiling": {"color": "tab:green", "marker": "^", "linestyle": "--",
                     "label": "ceiling (baseline with memory for every request)"}}


def _series(rows: list[dict], mode: str, key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
    picked = sorted((r["concurrency"], r[key]) for r in rows if r["mode"] == mode and r[key] is not None)
    return [c for c, _ in picked], [v * scale for _, v in picked]


def _concurrency_axes(ax, levels: list[int], xlabel: str, ylabel: str, title: str) -> None:
    """Concurrency on a log2 axis with a tick per measured level; the value axis from zero."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_throughput(rows: list[dict], admitted: dict[str, int], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for mode, style in STYLE.items():
        x, y = _series(rows, mode, "output_tok_s")
        if x:
            ax.plot(x, y, **style)
            ax.axvline(admitted[mode], color=style["color"], linestyle=":", linewidth=1)
    _concurrency_axes(ax, sorted({r["concurrency"] for r in rows}),
                      "concurrent requests (dotted: how many each mode admits)", "output tokens / s",
                      "Output throughput, same device KV budget")
    ax.legend()
    _save(fig, path)


def plot_latency(rows: list[dict], path: Path) -> None:
    fig, (ttft, itl) = plt.subplots(1, 2, figsize=(10, 4))
    levels = sorted({r["concurrency"] for r in rows})
    for ax, key, scale, title, unit in ((ttft, "ttft_median_s", 1.0, "Time to first token (median)", "s"),
                                        (itl, "itl_median_s", 1000.0, "Inter-token latency (median)", "ms")):
        for mode, style in STYLE.items():
            x, y = _series(rows, mode, key, scale)
            if x:
                ax.plot(x, y, **style)
        _concurrency_axes(ax, levels, "concurrent requests", unit, title)
    ttft.legend()
    _save(fig, path)
