"""`python -m hisparse.bench_serving` end to end at toy size: both real servers as subprocesses, streamed
completions over HTTP, and the files it writes checked against what the workload must produce."""

from __future__ import annotations

import json

import pytest

from hisparse.bench.serving import main, rounds_of, turn_order
from hisparse.layers.indexer import SHIPPED_WEIGHTS

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not SHIPPED_WEIGHTS.exists(),
                                                 reason="the default model's indexer is not trained yet")]

OUTPUT_TOKENS = 4
# 100-token requests; the budget holds one of them with all K/V on the device. HiSparse's 24-slot hot
# buffers (prompts are 4x longer, so decode swaps in) fit 3 of them in the same budget: with bfloat16 K/V
# 80 device slots of 25, and 320 host slots of 100 (float32: 88 and 352).
ARGS = ["--prompt-tokens", "96", "--output-tokens", str(OUTPUT_TOKENS), "--concurrency", "1,3",
        "--poll-interval", "0.02",  # levels of a fraction of a second
        "--baseline-admits", "1", "--hisparse-config",
        '{"top_k": 16, "device_buffer_size": 24, "host_to_device_ratio": 4}']


def test_tiny_sweep_writes_consistent_results(tmp_path, capsys):
    assert main([*ARGS, "--ceiling", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    admitted = report["admitted_at_once"]
    assert admitted == {"baseline": 1, "hisparse": 3, "ceiling": 3}  # the ceiling's budget holds the highest level
    rows = {(r["mode"], r["concurrency"]): r for r in report["results"]}
    assert set(rows) == {(m, c) for m in ("baseline", "hisparse", "ceiling") for c in (1, 3)}
    for (mode, concurrency), row in rows.items():
        assert row["failed"] == 0, row["errors"]
        assert row["requests"] == max(concurrency, 3)  # --min-requests 3 by default
        assert row["output_tokens"] == row["requests"] * OUTPUT_TOKENS  # ignore_eos: every request runs to length
        assert 1 <= row["max_running"] <= min(admitted[mode], concurrency)
        assert row["output_tok_s"] == pytest.approx(row["output_tokens"] / row["seconds"])
        assert 0 < row["ttft_median_s"] <= row["ttft_p99_s"] < row["seconds"]
        assert 0 < row["itl_median_s"] <= row["itl_p99_s"]
        assert 0 < row["decode_step_s"] < row["seconds"]  # every request decodes after its prefill step
        # every request's prompt is prefilled in the level; the engine's time fits in the level's wall time
        assert 0 < row["prompt_step_seconds"] and 0 < row["decode_seconds"]
        assert row["prompt_step_seconds"] + row["decode_seconds"] <= row["seconds"]
        if mode == "hisparse":
            assert row["hits"] + row["misses"] > 0 and 0 < row["hit_rate"] < 1
        else:
            assert row["hit_rate"] is None
    # The point of the comparison: at 3 concurrent requests only HiSparse (and the ceiling) runs them all at once.
    assert rows["baseline", 3]["max_running"] == 1 and rows["hisparse", 3]["max_running"] == 3
    assert rows["ceiling", 3]["max_running"] == 3
    for key, mode, other in (("ceiling_vs_baseline", "ceiling", "baseline"), ("hisparse_vs_ceiling", "hisparse",
                                                                             "ceiling")):
        assert report[key]["3"] == pytest.approx(rows[mode, 3]["output_tok_s"] / rows[other, 3]["output_tok_s"])
    ratio = report["hisparse_vs_baseline"]
    assert set(ratio) == {"1", "3"}
    assert ratio["3"] == pytest.approx(rows["hisparse", 3]["output_tok_s"] / rows["baseline", 3]["output_tok_s"])
    bound = report["hisparse_vs_baseline_at_most"]
    assert bound["3"] == pytest.approx(rows["baseline", 3]["seconds"] / rows["hisparse", 3]["prompt_step_seconds"])
    assert bound["3"] >= ratio["3"]  # a bound the measured ratio obeys

    markdown = (tmp_path / "results.md").read_text()
    assert "| 3 | hisparse | 3 |" in markdown and "| 3 | baseline | 1 |" in markdown
    assert "| 3 | ceiling | 3 |" in markdown and "HiSparse / ceiling: c=1: " in markdown
    assert markdown in capsys.readouterr().out  # the table is printed too
    for name in ("throughput.png", "latency.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["workload"]["device"] == "cpu" and "servers on cpu" in markdown
    for mode in ("baseline", "hisparse", "ceiling"):
        flags = report["server_flags"][mode]
        assert flags[flags.index("--device") + 1] == "cpu"
        assert "--device cpu" in (tmp_path / f"server-{mode}.log").read_text()


def test_bad_flags_fail_in_one_line_without_starting_servers(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--concurrency", "4,x", "--out-dir", str(tmp_path)])
    assert "--concurrency" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--poll-interval", "0", "--out-dir", str(tmp_path)])
    assert "--poll-interval: must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--hisparse-config", '{"top_k": 64, "device_buffer_size": 32}', "--out-dir", str(tmp_path)])
    assert "--hisparse-config" in capsys.readouterr().err
    big_buffer = '{"top_k": 256, "device_buffer_size": 8191, "host_to_device_ratio": 1}'  # never swaps in
    assert main(["--hisparse-config", big_buffer, "--device-kv-budget", "1GiB", "--out-dir", str(tmp_path)]) == 2
    assert "device_buffer_size (8191) must be at most 8190" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing started, nothing written


def test_rounds_keep_the_level_concurrency():
    prompts = [[i] for i in range(7)]
    assert rounds_of(prompts[:3], 1) == [[[0]], [[1]], [[2]]]  # concurrency 1: each request a round of its own
    assert rounds_of(prompts[:3], 2) == [prompts[:3]]  # a remainder joins the last round: never a round below c
    assert rounds_of(prompts, 3) == [prompts[:3], prompts[3:]]
    assert rounds_of(prompts[:2], 4) == [prompts[:2]]  # fewer requests than c: one round
    for c in range(1, 8):
        rounds = rounds_of(prompts, c)
        assert [x for r in rounds for x in r] == prompts
        assert all(len(r) >= min(c, len(prompts)) for r in rounds)


def test_turns_rotate_so_that_each_mode_goes_first_in_turn():
    assert turn_order(("a", "b"), 0) == ("a", "b") and turn_order(("a", "b"), 1) == ("b", "a")
    three = ("a", "b", "c")
    assert [turn_order(three, t)[0] for t in range(4)] == ["a", "b", "c", "a"]
    assert all(sorted(turn_order(three, t)) == list(three) for t in range(3))
