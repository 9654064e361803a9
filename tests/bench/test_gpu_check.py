"""The GPU machine's prepared script, run on the CPU so that it cannot rot before a GPU is lent: the engine on
the "device" gives the CPU run's tokens, for the default model and a DSA checkpoint, HiSparse on and off, on one
rank and over two (NCCL's place taken by the CPU's collectives)."""

from __future__ import annotations

import json

from hisparse.bench import gpu_check, serving
from hisparse.data.pydoc_corpus import heldout_tokens
from hisparse.models.loader import open_model
from hisparse.tools import random_checkpoint


def test_the_engine_checks_run_and_agree_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--device", "cpu", "--prompts", "2", "--new-tokens", "4", "--skip-swap-in",
                           "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {(r["model"], r["mode"], r["on"]): r for r in report["engine"]}
    assert set(rows) == {(m, mode, "cpu") for m in ("default", "random glm-5") for mode in ("baseline", "hisparse")}
    assert all(r["equal"] == r["requests"] == 2 and r["first_difference"] is None for r in rows.values())
    assert report["failed"] == {} and "tokens as on the cpu" in capsys.readouterr().out


def test_each_parallel_split_gives_one_ranks_tokens(tmp_path):
    """`--tp 2` on the DSA model: tensor parallel and DP attention, each over two rank processes (the default
    model's split, tensor parallel alone, is tests/engine/test_tensor_parallel.py's)."""
    tokenizer = open_model(None).tokenizer()
    prompts = [heldout_tokens(tokenizer, n, offset=211 * i) for i, n in enumerate(gpu_check.PROMPT_TOKENS[:2])]
    random_checkpoint.main(["--arch", "glm-5", "--out", str(tmp_path), "--layers", "2", "--index-topk", "32",
                            "--dtype", "float32"])
    rows = gpu_check.compare("random glm-5", str(tmp_path), "cpu", prompts, 4, tp=2)
    assert {(r["mode"], r["on"]) for r in rows} == {(mode, on) for mode in ("baseline", "hisparse")
                                                    for on in ("cpu", "cpu x tp 2", "cpu x dp 2")}
    assert all(r["equal"] == r["requests"] == 2 and r["first_difference"] is None for r in rows)


def test_a_cuda_run_without_cuda_is_refused_in_one_line(assert_refused, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert_refused(gpu_check.main, ["--device", "cuda"], gpu_check.PROG, "no CUDA device here")


def test_the_serving_step_runs_both_servers_on_the_device(tmp_path):
    argv = gpu_check.serving_argv("cuda:1", gpu_check.SERVING_FLAGS, tmp_path)
    args = serving.build_parser().parse_args(argv)
    assert args.device == "cuda:1" and args.concurrency == [1, 16] and args.out_dir == tmp_path
    # a --device among the flags given cannot move the servers off the device checked
    assert serving.build_parser().parse_args(gpu_check.serving_argv("cuda", ["--device", "cpu"], tmp_path)).device \
        == "cuda"


def test_bad_serving_flags_are_refused_before_the_engine_checks(assert_refused, monkeypatch, forbid):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    forbid(gpu_check, "open_model", "compare")
    assert_refused(gpu_check.main, ["--device", "cuda", "--serving-flags", "--concurrency 1,x"], serving.PROG,
                   "not an integer")


def test_a_failing_step_is_reported_and_the_next_still_runs(tmp_path, capsys, monkeypatch, opened_model):
    """On a lent GPU every step is minutes that cannot be had again: one that raises must not cost the others."""
    opened_model(gpu_check)

    def compare(name, *args):
        if name == "default":
            raise RuntimeError("boom")
        return [{"model": name, "mode": "baseline", "on": "cpu", "equal": 1, "requests": 1, "first_difference": None,
                 "cpu_step_ms": 1.0, "device_step_ms": 1.0}]

    monkeypatch.setattr(gpu_check, "compare", compare)
    out = tmp_path / "report.json"
    assert gpu_check.main(["--device", "cpu", "--skip-swap-in", "--prompts", "1", "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["failed"] == {"default model": "RuntimeError: boom"}
    assert [r["model"] for r in report["engine"]] == ["random glm-5"]  # the step after the failure ran
    captured = capsys.readouterr()
    assert "step 'default model' failed: RuntimeError: boom" in captured.err and "Traceback" in captured.err
    assert "random glm-5" in captured.out
