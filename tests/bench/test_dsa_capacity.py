"""`python -m hisparse.bench.dsa_capacity` on a small GLM-5 checkpoint: both modes serve every request, and
the requests admitted at once are the planner's for that shape."""

from __future__ import annotations

import re

from hisparse.bench import dsa_capacity


def test_admission_matches_the_planner(tiny_dsa_dir, capsys):
    argv = ["--model", str(tiny_dsa_dir("glm-5")), "--prompt-tokens", "100", "--output-tokens", "8",
            "--baseline-admits", "2", "--hisparse-config", '{"device_buffer_size": 32, "host_to_device_ratio": 8}']
    assert dsa_capacity.main(argv) == 0
    out = capsys.readouterr().out
    assert "admission matches the planner" in out
    rows = dict(re.findall(r"^(baseline|hisparse)\s+(\d+) \(", out, re.M))
    assert int(rows["baseline"]) == 2 and int(rows["hisparse"]) > int(rows["baseline"])


def test_bad_flags_fail_in_one_line(tiny_dsa_dir, assert_refused):
    model = str(tiny_dsa_dir("glm-5"))
    assert_refused(dsa_capacity.main, ["--model", model, "--prompt-tokens", "2000"], dsa_capacity.PROG,
                   "exceeds the model's context (1024 tokens)")
    assert_refused(dsa_capacity.main, ["--model", model, "--hisparse-config", '{"device_buffer_size": 8}'],
                   dsa_capacity.PROG, "device_buffer_size (8) must be >= top_k (16")
    assert_refused(dsa_capacity.main, ["--kv-cache-dtype", "int4"], dsa_capacity.PROG, "invalid choice")
