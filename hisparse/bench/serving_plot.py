"""The serving benchmark's figures: throughput against concurrency, one line per mode, with each mode's
admission limit marked (past it, more concurrency only queues); and TTFT / ITL against concurrency."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {"baseline": {"color": "tab:gray", "marker": "o", "label": "baseline (all KV on the device)"},
         "hisparse": {"color": "tab:blue", "marker": "s", "label": "HiSparse (hot buffer on the device)"}}


def _series(rows: list[dict], mode: str, key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
    picked = sorted((r["concurrency"], r[key]) for r in rows if r["mode"] == mode and r[key] is not None)
    return [c for c, _ in picked], [v * scale for _, v in picked]


def plot_throughput(rows: list[dict], admitted: dict[str, int], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for mode, style in STYLE.items():
        x, y = _series(rows, mode, "output_tok_s")
        if x:
            ax.plot(x, y, **style)
            ax.axvline(admitted[mode], color=style["color"], linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    levels = sorted({r["concurrency"] for r in rows})
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent requests (dotted: how many each mode admits)")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Output throughput, same device KV budget")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_latency(rows: list[dict], path: Path) -> None:
    fig, (ttft, itl) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, style in STYLE.items():
        for ax, key, scale in ((ttft, "ttft_median_s", 1.0), (itl, "itl_median_s", 1000.0)):
            x, y = _series(rows, mode, key, scale)
            if x:
                ax.plot(x, y, **style)
    levels = sorted({r["concurrency"] for r in rows})
    for ax, title, unit in ((ttft, "Time to first token (median)", "s"),
                            (itl, "Inter-token latency (median)", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    ttft.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
