"""The indexer selection benchmark: a small run prints a row per batch, and bad flags say what is wrong."""

from __future__ import annotations

import pytest

from hisparse.bench import index_scores


def test_small_run_prints_a_row_per_batch(capsys):
    index_scores.main(["--batches", "1,3", "--context", "40", "--top-k", "8", "--repeats", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["scores", "top-k", "selection"]
    rows = [line.split() for line in lines[3:]]
    assert [r[0] for r in rows] == ["1", "3"]
    for row in rows:
        compiled, reference, ratio, diff, top_k_compiled, top_k_reference, top_k_ratio, one_call, vs_two = (
            float(x) for x in row[1:])
        assert min(compiled, reference, ratio, top_k_compiled, top_k_reference, top_k_ratio, one_call, vs_two) > 0
        assert diff < 1e-4


@pytest.mark.parametrize(("argv", "message"), [
    (["--head-dim", "6"], "--head-dim: must be a positive multiple of 4"),
    (["--context", "1"], "--context: must be >= 2"),
    (["--top-k", "0"], "--top-k: must be >= 1"),
])
def test_bad_flags_name_the_problem(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        index_scores.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
