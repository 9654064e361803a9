"""The serving benchmark's Markdown report: one row per mode and concurrency, HiSparse's throughput ratio
over the baseline at each level (and the ceiling's, where it ran), and the workload that produced them (so a
table pasted elsewhere still says what it measured)."""

from __future__ import annotations


def _per_level(rows: list[dict], figure, mode: str = "hisparse", other: str = "baseline") -> dict[int, float | None]:
    """concurrency -> figure(`mode`'s row, `other`'s row), at each level both modes ran."""
    by = {(r["mode"], r["concurrency"]): r for r in rows}
    return {concurrency: figure(row, by[other, concurrency])
            for (name, concurrency), row in sorted(by.items())
            if name == mode and (other, concurrency) in by}


def ratios(rows: list[dict], mode: str = "hisparse", other: str = "baseline") -> dict[int, float | None]:
    """concurrency -> `mode`'s output throughput / `other`'s."""
    return _per_level(rows, lambda row, base: row["output_tok_s"] / base["output_tok_s"]
                      if base["output_tok_s"] else None, mode, other)


def prefill_bounds(rows: list[dict]) -> dict[int, float | None]:
    """concurrency -> the most HiSparse / baseline output throughput could be, given HiSparse's own steps with
    prompt chunks: its wall time is at least their time, so even with decode-only steps free the ratio is at
    most the baseline's wall time over it. (Both modes prefill the same prompts: the bound says how much of
    the comparison prefill, not the memory hierarchy, decides.)"""
    return _per_level(rows, lambda hisparse, base: base["seconds"] / hisparse["prompt_step_seconds"]
                      if hisparse.get("prompt_step_seconds") else None)


def _by_level(ratio: dict[int, float | None]) -> str:
    return ", ".join(f"c={c}: {'-' if r is None else f'{r:.2f}x'}" for c, r in ratio.items())


def _pair(a: float | None, b: float | None, scale: float, digits: int) -> str:
    if a is None or b is None:
        return "-"
    return f"{a * scale:.{digits}f} / {b * scale:.{digits}f}"


def table(rows: list[dict]) -> str:
    ratio = {mode: ratios(rows, mode) for mode in {r["mode"] for r in rows} - {"baseline"}}
    lines = ["| concurrency | mode | max running | output tok/s | vs baseline | TTFT median / p99 (s) "
             "| ITL median / p99 (ms) | engine decode step (ms) | engine time in steps with prompt chunks / "
             "decode-only (s) | hit rate | failed |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in sorted(rows, key=lambda r: (r["concurrency"], r["mode"])):
        c = row["concurrency"]
        vs = ratio.get(row["mode"], {}).get(c)
        vs = "" if vs is None else f"{vs:.2f}x"
        hit = "-" if row["hit_rate"] is None else f"{row['hit_rate']:.1%}"
        step = "-" if row.get("decode_step_s") is None else f"{row['decode_step_s'] * 1000:.0f}"
        lines.append(f"| {c} | {row['mode']} | {row['max_running']} | {row['output_tok_s']:.2f} | {vs} "
                     f"| {_pair(row['ttft_median_s'], row['ttft_p99_s'], 1, 2)} "
                     f"| {_pair(row['itl_median_s'], row['itl_p99_s'], 1000, 0)} | {step} "
                     f"| {_pair(row.get('prompt_step_seconds'), row.get('decode_seconds'), 1, 1)} | {hit} "
                     f"| {row['failed']} |")
    return "\n".join(lines)


def markdown_report(report: dict) -> str:
    w = report["workload"]
    admitted = report["admitted_at_once"]
    ratio = report["hisparse_vs_baseline"]
    load = " / ".join(f"{x:.1f}" for x in report["load_average_before"])
    ceiling = []
    if "ceiling_vs_baseline" in report:
        ceiling = [f"Ceiling (the baseline with the device memory to run every request of the highest level at "
                   f"once) / baseline: {_by_level(report['ceiling_vs_baseline'])}; HiSparse / ceiling: "
                   f"{_by_level(report['hisparse_vs_ceiling'])}", ""]
    return "\n".join([
        "# Serving benchmark: HiSparse off vs on, same device KV budget",
        "",
        f"- workload: {w['rounds']} x concurrency (at least {w.get('min_requests', 1)}) streamed completions per "
        f"level, {w['prompt_tokens']} prompt "
        f"tokens ({w['text']}) + {w['output_tokens']} output tokens each (ignore_eos); servers on "
        f"{w.get('device', 'cpu')}",
        f"- device KV budget: {report['device_kv_budget_bytes'] / 2**20:.1f} MiB for both; admitted at once: "
        f"baseline {admitted['baseline']}, HiSparse {admitted['hisparse']}"
        + (f", ceiling {admitted['ceiling']} (its own budget)" if "ceiling" in admitted else ""),
        f"- HiSparse config: `{report['hisparse_config']}`",
        f"- started {report['started']}, took {report['seconds']:.0f} s; load average before: {load}",
        "",
        table(report["results"]),
        "",
        f"HiSparse / baseline output throughput: {_by_level(ratio)}",
        "",
        "At most, with HiSparse's decode-only steps free (the baseline's wall time over HiSparse's time in steps "
        f"with prompt chunks): {_by_level(prefill_bounds(report['results']))}",
        "",
        *ceiling,
    ])
