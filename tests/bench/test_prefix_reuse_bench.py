"""`python -m hisparse.bench_serving --workload prefix-reuse`: its flags refused before any server starts, and its
report's ratios taken over the right rows (the servers themselves are what tests/server covers)."""

from __future__ import annotations

import pytest

from hisparse.bench import prefix_reuse
from hisparse.bench_serving import main as bench_serving


def test_the_workload_picks_the_command_and_a_bad_one_is_refused(capsys):
    with pytest.raises(SystemExit) as refused:
        bench_serving(["--workload", "prefix"])
    assert refused.value.code == 2 and "invalid choice: 'prefix'" in capsys.readouterr().err
    assert bench_serving(["--workload", "prefix-reuse", "--shared-tokens", "9000"]) == 2
    assert "exceeds the model's context (8192 tokens)" in capsys.readouterr().err


def row(workload: str, server: str, tok_s: float, ttft: float, alone: float | None = None, repeat: int = 0) -> dict:
    return {"workload": workload, "server": server, "repeat": repeat, "output_tok_s": tok_s, "ttft_median_s": ttft,
            "ttft_alone_s": alone, "cached_tokens": 0, "prompt_tokens": 10, "errors": []}


def test_ratios_are_taken_within_each_repeat_then_their_median():
    shared, chat = "shared prefix", "multi-turn chat"
    rows = [row(shared, "baseline, no reuse", 10, 4.0, 2.0), row(shared, "baseline, reuse", 25, 1.0, 0.4),
            row(shared, "baseline, no reuse", 20, 6.0, 2.0, 1), row(shared, "baseline, reuse", 30, 1.0, 0.2, 1),
            row(chat, "hisparse, no reuse", 8, 2.0), row(chat, "hisparse, reuse", 12, 1.0)]
    by = {(r["workload"], r["mode"]): r for r in prefix_reuse.ratios(rows)}
    assert by["shared prefix", "baseline"]["output_tok_s"] == pytest.approx((2.5 + 1.5) / 2)  # not 27.5 / 15
    assert by["shared prefix", "baseline"]["ttft_median_s"] == pytest.approx((1 / 4 + 1 / 6) / 2)
    assert by["shared prefix", "baseline"]["ttft_alone_s"] == pytest.approx((0.2 + 0.1) / 2)
    assert by["multi-turn chat", "hisparse"]["output_tok_s"] == pytest.approx(1.5)
    assert by["multi-turn chat", "hisparse"]["ttft_alone_s"] is None  # no request is sent alone there
    assert by["shared prefix", "hisparse"]["output_tok_s"] is None  # not run
    text = prefix_reuse.markdown({"workload": "toy", "results": rows, "reuse_vs_none": list(by.values())})
    assert "| shared prefix | baseline | 2.00x | 0.21x | 0.15x |" in text
