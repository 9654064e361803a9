"""`make run`'s job at a small size: both modes run the same workload under one budget, HiSparse admits more."""

import re

from hisparse.demo import main


def test_demo_admits_more_with_hisparse_and_reports_throughput(capsys):
    code = main(["--skip-chat", "--requests", "3", "--prompt-tokens", "1000", "--output-tokens", "4",
                 "--baseline-requests", "1", "--hisparse-config",
                 '{"top_k": 256, "device_buffer_size": 256, "host_to_device_ratio": 4}'])
    out = capsys.readouterr().out
    assert code == 0
    rows = {m.group(1): (int(m.group(2)), float(m.group(3)))
            for m in re.finditer(r"^(baseline|hisparse)\s+(\d+)\s+([\d.]+)", out, re.MULTILINE)}
    assert rows["baseline"][0] == 1 and rows["hisparse"][0] == 3
    assert rows["baseline"][1] > 0 and rows["hisparse"][1] > 0
    assert re.search(r"\d+ hits, [1-9]\d* misses", out)


def test_demo_rejects_bad_flags(capsys):
    assert main(["--skip-chat", "--requests", "0"]) == 2
    assert "--requests must be >= 1" in capsys.readouterr().err
