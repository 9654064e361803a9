"""`python -m hisparse.bench.vs_llamacpp`: its flags refused before any server starts, prompts never sent twice,
and the report's ratios and verdicts; end to end only where `make llama-server` has been run (CI never does)."""

from __future__ import annotations

import random

import pytest

from hisparse.bench import vs_llamacpp
from hisparse.bench.vs_llamacpp import PROG, WORKLOADS, main


@pytest.fixture
def no_servers(forbid):
    forbid(vs_llamacpp.ServerProcess, "start")
    forbid(vs_llamacpp.LlamaServer, "start")


def test_a_missing_llama_server_is_one_line_naming_the_make_target(assert_refused, no_servers, tmp_path):
    assert_refused(main, ["--llama-server", str(tmp_path / "llama-server")], PROG, "run `make llama-server`")


@pytest.mark.parametrize("argv, words", [
    (["--workloads", "c1,c2"], "'c2' is not one of c1, c8, c32, long"),
    (["--rounds", "0"], "--rounds"),
    (["--busy", "--workloads", "c8"], "--busy runs c1 on our server alone"),
    (["--busy", "--threads", "4"], "--busy runs c1 on our server alone"),
    (["--busy-threads", "1"], "--busy-threads needs --busy"),
    (["--our-flags=--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--our-flags=--max-running-requests 0"], "--max-running-requests"),
    (["--our-flags=--port 8000"], "--port is the benchmark's to set"),
    (["--our-flags=--model-path x.gguf"], "--model-path is the benchmark's to set"),
])
def test_bad_flags_are_refused(assert_refused, no_servers, argv, words):
    assert_refused(main, argv, PROG, words)


def test_our_flags_pass_through_as_words():
    assert vs_llamacpp.build_parser().parse_args(["--our-flags=--kv-cache-dtype bfloat16"]).our_flags == [
        "--kv-cache-dtype", "bfloat16"]


def test_no_prompt_is_sent_twice_across_workloads_rounds_and_servers():
    draw = random.Random(0)
    stream = [draw.randrange(49152) for _ in range(13_000)]
    sides = ("hisparse", "llama.cpp")
    plan = vs_llamacpp.plan_prompts(stream, list(WORKLOADS.values()), 2, sides)
    assert set(plan) == {("warmup", 0, side) for side in sides} | {
        (name, r, side) for name in WORKLOADS for r in range(2) for side in sides}
    for (name, _, _), prompts in plan.items():
        if name != "warmup":
            assert len(prompts) == WORKLOADS[name].requests
            assert {len(p) for p in prompts} == {WORKLOADS[name].prompt_tokens}
    sent = [tuple(p) for prompts in plan.values() for p in prompts]
    assert len(set(sent)) == len(sent) == 2 + 2 * 2 * sum(w.requests for w in WORKLOADS.values())
    with pytest.raises(ValueError, match="use fewer --rounds"):
        vs_llamacpp.plan_prompts(stream[:300], list(WORKLOADS.values()), 2, sides)


def row(workload: str, round_: int, side: str, tok_s: float, ttft: float, itl: float) -> dict:
    return {"workload": workload, "round": round_, "side": side, "output_tok_s": tok_s, "ttft_median_s": ttft,
            "itl_median_s": itl, "failed": 0}


def test_ratios_are_taken_within_each_round_then_their_median_and_judged_against_the_targets():
    rows = [row("c1", 0, "hisparse", 30, 0.2, 0.030), row("c1", 0, "llama.cpp", 20, 0.1, 0.040),
            row("c1", 1, "llama.cpp", 40, 0.1, 0.020), row("c1", 1, "hisparse", 20, 0.3, 0.050),
            row("long", 0, "hisparse", 80, 1.0, 0.1), row("long", 0, "llama.cpp", 20, 5.0, 0.2)]
    summary = vs_llamacpp.summarize(rows, ("hisparse", "llama.cpp"))
    c1, long = summary
    assert c1["hisparse"]["output_tok_s"] == 25 and c1["llama.cpp"]["output_tok_s"] == 30
    assert c1["ratio"]["output_tok_s"] == pytest.approx((1.5 + 0.5) / 2)  # not 25 / 30
    assert c1["ratio"]["ttft_median_s"] == pytest.approx((2 + 3) / 2)
    assert c1["ratio"]["itl_median_s"] == pytest.approx((0.75 + 2.5) / 2)
    assert long["ratio"]["output_tok_s"] == 4.0 and long["ratio"]["ttft_median_s"] == pytest.approx(0.2)
    lines = vs_llamacpp.verdicts(summary, busy=False)
    assert lines == ["c=1, 5 x 100 + 128 tokens: output tok/s 1.00x llama.cpp's, target >= 1x: met",
                     "c=8, 8 x 1500 + 128 tokens: output tok/s 4.00x llama.cpp's, target >= 4x; "
                     "TTFT 0.20x, target <= 0.25x: met"]
    slow_first_token = vs_llamacpp.summarize(rows[:4] + [row("long", 0, "hisparse", 80, 2.0, 0.1), rows[5]],
                                             ("hisparse", "llama.cpp"))
    assert vs_llamacpp.verdicts(slow_first_token, busy=False)[1].endswith("TTFT 0.40x, target <= 0.25x: not met")
    report = {"title": "toy", "commit": "abc", "rounds": 2, "sides": ("hisparse", "llama.cpp"), "summary": summary,
              "verdicts": lines, "load_average_before": (0.5, 0, 0), "load_average_after": (1.25, 0, 0)}
    text = vs_llamacpp.markdown(report)
    assert text.startswith("toy (commit abc, 2 rounds, medians; load average 0.5 before, 1.2 after)")
    assert "| c=1, 5 x 100 + 128 tokens | 25.0 | 30.0 | 1.00x | 250.0 | 100.0 | 2.50x | 40.0 | 30.0 | 1.62x |" in text


def test_busy_over_quiet_is_judged_against_four_tenths():
    rows = [row("c1", 0, "busy", 9, 0.5, 0.1), row("c1", 0, "quiet", 20, 0.2, 0.05)]
    summary = vs_llamacpp.summarize(rows, ("busy", "quiet"))
    assert vs_llamacpp.verdicts(summary, busy=True) == [
        "c=1, 5 x 100 + 128 tokens: output tok/s 0.45x our quiet figure, target >= 0.4x: met"]


@pytest.mark.slow
@pytest.mark.skipif(not vs_llamacpp.DEFAULT_LLAMA_SERVER.is_file(), reason="llama-server not built (make llama-server)")
def test_both_servers_do_the_same_work_on_the_same_gguf(tmp_path):
    from hisparse.data.pydoc_corpus import corpus_tokens
    from hisparse.models.default_model import default_model_path
    from hisparse.models.loader import open_model

    gguf = default_model_path()
    tiny = vs_llamacpp.Workload("tiny", 2, 2, 24, 1.0, output_tokens=8)
    sides = ("hisparse", "llama.cpp")
    plan = vs_llamacpp.plan_prompts(corpus_tokens(open_model(str(gguf)).tokenizer(), "heldout"), [tiny], 1, sides)
    servers = {"hisparse": vs_llamacpp.ServerProcess("hisparse", ["--model-path", str(gguf)], tmp_path / "ours.log"),
               "llama.cpp": vs_llamacpp.LlamaServer(vs_llamacpp.DEFAULT_LLAMA_SERVER, gguf, 2, 64,
                                                    tmp_path / "llama.log")}
    try:
        for server in servers.values():
            server.start()
        vs_llamacpp.wait_ready(list(servers.values()))
        rows = vs_llamacpp.take_turns(servers, [tiny], 1, plan, vs_llamacpp.tqdm(disable=True))
    finally:
        for server in servers.values():
            server.stop()
    assert [(r["side"], r["failed"], r["errors"]) for r in rows] == [(side, 0, []) for side in sides]
    assert all(r["output_tok_s"] > 0 and r["ttft_median_s"] > 0 and r["cached_tokens"] == 0 for r in rows)
