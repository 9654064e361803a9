"""The swap-in bandwidth benchmark: a small run prints a row per page kind, and bad flags say what is wrong."""

from __future__ import annotations

import pytest

from hisparse.bench import swap_in


def test_small_run_prints_both_page_kinds(capsys):
    swap_in.main(["--dtype", "bfloat16", "--host-pages", "small,huge", "--batches", "1,2", "--miss-rates", "0.5,1.0",
                  "--buffer", "32", "--top-k", "16", "--repeats", "1", "--host-gib", "0.01", "--copy-mib", "8"])
    printed = capsys.readouterr().out
    assert "of the small-page one" in printed and "of the huge-page one" in printed
    for pages in ("small", "huge"):
        assert f"bfloat16, {pages} pages: cpu at 100% misses, best batch (" in printed
        assert f"bfloat16, {pages} pages: reference at 100% misses, best batch (" in printed
        assert f"      cpu bfloat16 {pages:>5}     2 100.0%      32" in printed  # batch 2 x top_k 16
    assert "bfloat16: cpu at 100% misses, time per call on huge / on small pages: batch 1 " in printed


@pytest.mark.parametrize(("argv", "message"), [
    (["--host-pages", "giant"], "--host-pages: 'giant' is not one of huge, small"),
    (["--top-k", "64", "--buffer", "32"], "--top-k must not exceed --buffer"),
])
def test_bad_flags_name_the_problem(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        swap_in.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
