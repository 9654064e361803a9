"""The swap-in bandwidth benchmark: a small run prints a table per page kind, and bad flags say what is wrong."""

from __future__ import annotations

import pytest

from hisparse.bench import swap_in


def test_small_run_prints_both_page_kinds(capsys):
    swap_in.main(["--dtype", "bfloat16", "--host-pages", "small,huge", "--batches", "1,2", "--miss-rates", "0.5,1.0",
                  "--buffer", "32", "--top-k", "16", "--repeats", "1", "--host-gib", "0.01", "--copy-mib", "8"])
    printed = capsys.readouterr().out
    for pages in ("small", "huge"):
        assert f"bfloat16 rows, host pool on {pages} pages" in printed
        assert f"bfloat16, {pages} pages: cpu at 100% misses, best batch:" in printed
        assert f"bfloat16, {pages} pages: reference at 100% misses, best batch:" in printed
    assert printed.count("      cpu bfloat16     2 100.0%      32") == 2  # batch 2 x top_k 16, both tables


@pytest.mark.parametrize(("argv", "message"), [
    (["--host-pages", "giant"], "--host-pages: 'giant' is not one of huge, small"),
    (["--top-k", "64", "--buffer", "32"], "--top-k must not exceed --buffer"),
])
def test_bad_flags_name_the_problem(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        swap_in.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
