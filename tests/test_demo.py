"""`make run`'s job at a small size: both modes run the same workload under one budget, HiSparse admits more."""

import re

import pytest

from hisparse import demo
from hisparse.demo import main


def test_demo_admits_more_with_hisparse_and_reports_throughput(capsys, monkeypatch):
    """Also: both modes' kernels are warmed up (compiled) before either is timed, with a context past the
    hot buffer so that the swap-in runs in the warm-up."""
    calls = []
    real_warm_up, real_serve = demo.warm_up, demo.serve

    def warm_up(config, model, tokenizer, prompt):
        calls.append(("warm up", config.enable_hisparse, len(prompt)))
        real_warm_up(config, model, tokenizer, prompt)

    def serve(engine, prompts, params, label):
        calls.append(("serve", label))
        return real_serve(engine, prompts, params, label)

    monkeypatch.setattr(demo, "warm_up", warm_up)
    monkeypatch.setattr(demo, "serve", serve)
    code = main(["--skip-chat", "--requests", "3", "--prompt-tokens", "1000", "--output-tokens", "4",
                 "--baseline-requests", "1", "--hisparse-config",
                 '{"top_k": 256, "device_buffer_size": 256, "host_to_device_ratio": 4}'])
    out = capsys.readouterr().out
    assert code == 0
    assert calls == [("warm up", False, 256 + 16), ("warm up", True, 256 + 16), ("serve", "baseline"),
                     ("serve", "hisparse")]
    rows = {m.group(1): (int(m.group(2)), float(m.group(3)))
            for m in re.finditer(r"^(baseline|hisparse)\s+(\d+)\s+([\d.]+)", out, re.MULTILINE)}
    assert rows["baseline"][0] == 1 and rows["hisparse"][0] == 3
    assert rows["baseline"][1] > 0 and rows["hisparse"][1] > 0
    assert re.search(r"\d+ hits, [1-9]\d* misses", out)


def test_demo_rejects_bad_flags(capsys):
    """More bad flags, each refused before the model loads: tests/bench/test_command_flags_serving_demo.py."""
    with pytest.raises(SystemExit) as done:
        main(["--skip-chat", "--requests", "0"])
    assert done.value.code == 2
    assert "--requests: must be in [1, 4096], got 0" in capsys.readouterr().err
