"""The one prepared script for a GPU machine: the engine end to end on the device against the same run on the
CPU, for the default model and a DSA checkpoint, then the Triton swap-in against a pinned copy.

    python -m hisparse.bench.gpu_check [--device cuda] [--prompts 4] [--new-tokens 32] [--tp N] [--out FILE.json]
                                       [--skip-swap-in] [--skip-serving] [--serving-flags "--concurrency 1,16"]

1. The default model, float32, HiSparse on (a hot buffer smaller than the prompts, so that the swap-in runs
   on the device, Triton's under `--swap-in-backend auto`) and off: the same greedy requests on `--device`
   and on the CPU, every weight and device pool checked to be on its device first. Printed: per mode, how
   many requests got the CPU's tokens exactly, the first position where one did not, and the mean decode
   step on each.
2. The same for a random GLM-5 checkpoint (`hisparse.tools.random_checkpoint`, DSA-shaped per token, float32
   weights, bfloat16 latent rows, FP8 indexer keys).
3. `hisparse.bench.swap_in_cuda`: every Triton policy checked against the reference, then timed against a
   plain pinned host -> device copy of the same bytes.
4. On a GPU, `hisparse.bench_serving --device cuda` (`--serving-flags`, default `--concurrency 1,16`): both
   servers on the device, HiSparse / baseline output tokens/s under one device budget, a few minutes. On our
   CPU both modes' prefill of the same prompts bounds that ratio at c = 16 (1.7x at most); this is where the
   decode, and so the memory, decides it.

`--tp N` (a machine with N GPUs) also runs each pair's engine over N rank processes on the device kind, one GPU
each, their collectives through NCCL (the default model tensor-parallel while N is at most its 3 KV heads; the
DSA model tensor-parallel and with DP attention, its experts split), against the same CPU run.

`--device cpu` runs steps 1-3 on the CPU (the swap-in through the Triton interpreter, TRITON_INTERPRET=1),
where the two runs of each pair must agree exactly: the test suite runs it so, so that the script cannot rot
before a GPU is lent. A step that fails is reported and the next runs; exit status 1 when one failed, or when a
pair differs on the CPU.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from hisparse.bench import serving, swap_in_cuda
from hisparse.cli_args import OneLineParser, device_flag, int_in, output_file, run_main
from hisparse.data.pydoc_corpus import heldout_tokens
from hisparse.engine.engine_config import EngineConfig
from hisparse.engine.llm_engine import LLMEngine
from hisparse.engine.sampling_params import SamplingParams
from hisparse.models.deepseek_v32 import DsaConfig
from hisparse.models.loader import open_model
from hisparse.tools import random_checkpoint

PROG = "python -m hisparse.bench.gpu_check"
HISPARSE = {"top_k": 32, "device_buffer_size": 64, "host_to_device_ratio": 4}  # buffer below every prompt
PROMPT_TOKENS = (96, 150, 200, 260)  # cycled over --prompts
SERVING_FLAGS = ["--concurrency", "1,16"]


def greedy_run(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float]:
    """The requests' tokens and the mean decode-only step, in seconds."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    steps: list[float] = []
    while engine.has_unfinished:
        before = engine.stats.decode_seconds, engine.stats.decode_steps
        engine.step()
        if engine.stats.decode_steps > before[1]:
            steps.append(engine.stats.decode_seconds - before[0])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return [r.output_token_ids for r in requests], statistics.mean(steps) if steps else 0.0


def check_placement(engine: LLMEngine, device: str) -> None:
    """AssertionError unless every weight and every device-side pool of the engine is on `device`."""
    where = torch.device(device)
    tensors = {name: p for name, p in engine.model.named_parameters()}
    tensors.update({name: getattr(engine.cache, name) for name in ("kv", "device_kv", "device_rows", "slot_pos")
                    if isinstance(getattr(engine.cache, name, None), torch.Tensor)})
    index_cache = getattr(engine.cache, "index_cache", None)
    if index_cache is not None:
        tensors["index keys"] = index_cache.rows
    wrong = [name for name, t in tensors.items() if t.device.type != where.type]
    if wrong:
        raise AssertionError(f"not on {device}: {', '.join(wrong[:5])}")


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def compare(name: str, model_path: str | None, device: str, prompts: list[list[int]], new_tokens: int,
            tp: int = 1) -> list[dict]:
    """Each mode's run on `device` (and over `tp` ranks on its kind) against the CPU's."""
    rows = []
    files = open_model(model_path)
    cpu_model = files.load(torch.float32, "cpu")
    device_model = cpu_model if device == "cpu" else files.load(torch.float32, device)
    tokenizer = files.tokenizer()
    for mode, hisparse in (("baseline", None), ("hisparse", HISPARSE)):
        common = dict(model=model_path, dtype="float32", device_kv_budget=256 << 20,
                      enable_hisparse=hisparse is not None, hisparse_config=hisparse)
        runs = []
        for where, model in (("cpu", cpu_model), (device, device_model)):
            engine = LLMEngine(EngineConfig(device=where, **common), model=model, tokenizer=tokenizer)
            check_placement(engine, where)
            runs.append(greedy_run(engine, prompts, new_tokens))
        labels = [device]
        for label, split in parallel_splits(tp, files.config):
            engine = LLMEngine(EngineConfig(device=torch.device(device).type, **common, **split))
            try:
                runs.append(greedy_run(engine, prompts, new_tokens))
            finally:
                engine.close()
            labels.append(f"{device} x {label}")
        (want, cpu_step), *others = runs
        for (got, device_step), label in zip(others, labels, strict=True):
            differences = [first_difference(a, b) for a, b in zip(want, got, strict=True)]
            rows.append({"model": name, "mode": mode, "on": label, "equal": sum(d is None for d in differences),
                         "requests": len(prompts),
                         "first_difference": min((d for d in differences if d is not None), default=None),
                         "cpu_step_ms": 1e3 * cpu_step, "device_step_ms": 1e3 * device_step})
    return rows


def parallel_splits(tp: int, config) -> list[tuple[str, dict]]:
    """The ways to run the model over `tp` ranks: tensor parallel (a Llama model up to its KV heads), and for a DSA
    model DP attention too, the experts split."""
    if tp == 1:
        return []
    if not isinstance(config, DsaConfig):
        return [(f"tp {tp}", {"tp_size": tp})] if tp <= config.num_kv_heads else []
    return [(f"tp {tp}", {"tp_size": tp, "ep_size": tp}),
            (f"dp {tp}", {"tp_size": tp, "dp_size": tp, "enable_dp_attention": True, "ep_size": tp})]


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", type=device_flag, default="cuda", help="cuda, cuda:N or cpu")
    ap.add_argument("--prompts", type=int_in(1, 64), default=4)
    ap.add_argument("--new-tokens", type=int_in(1, 1024), default=32)
    ap.add_argument("--skip-swap-in", action="store_true", help="the engine checks only")
    ap.add_argument("--skip-serving", action="store_true", help="no serving benchmark (step 4) on the GPU")
    ap.add_argument("--serving-flags", type=shlex.split, default=SERVING_FLAGS,
                    help=f'flags for step 4\'s `bench_serving`, one string (default "{shlex.join(SERVING_FLAGS)}")')
    ap.add_argument("--tp", type=int_in(1, 64), default=1, help="also run each engine over this many ranks (GPUs)")
    ap.add_argument("--out", type=output_file, default=None, help="also write the figures as JSON")
    return ap


def serving_argv(device: str, flags: list[str], out_dir: Path) -> list[str]:
    """Step 4's `bench_serving` command line: the flags given, both servers on `device`, results in out_dir."""
    return [*flags, "--device", device, "--out-dir", str(out_dir)]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if not args.skip_swap_in or args.device != "cpu":  # the CPU needs the Triton interpreter for the swap-in only
            swap_in_cuda.check_device(args.device)
    except ValueError as error:
        parser.error(str(error))
    serving_args = serving_out = None
    if args.device != "cpu" and not args.skip_serving:
        serving_out = Path(tempfile.mkdtemp(prefix="hisparse-serving-"))
        serving_args = serving_argv(args.device, args.serving_flags, serving_out)
        serving.build_parser().parse_args(serving_args)  # a bad flag fails now, not after steps 1-3
    tokenizer = open_model(None).tokenizer()
    prompts = [heldout_tokens(tokenizer, PROMPT_TOKENS[i % len(PROMPT_TOKENS)], offset=211 * i)
               for i in range(args.prompts)]
    report: dict = {"device": args.device, "engine": [], "failed": {}}

    def default_model() -> None:
        report["engine"] += compare("default", None, args.device, prompts, args.new_tokens, args.tp)

    def dsa_model() -> None:
        with tempfile.TemporaryDirectory(prefix="hisparse-gpu-check-") as folder:
            random_checkpoint.main(["--arch", "glm-5", "--out", folder, "--layers", "2", "--index-topk", "32",
                                    "--dtype", "float32"])
            report["engine"] += compare("random glm-5", folder, args.device, prompts, args.new_tokens, args.tp)

    def swap_in() -> None:
        swap_out = Path(tempfile.mkdtemp(prefix="hisparse-swap-in-")) / "swap_in.json"
        small = ["--batches", "2", "--miss-rates", "1.0", "--repeats", "1", "--host-gib", "0.0625"]
        swap_in_cuda.main(["--device", args.device, "--out", str(swap_out), *(small if args.device == "cpu" else [])])
        report["swap_in"] = json.loads(swap_out.read_text())

    def serving_levels() -> None:
        status = serving.main(serving_args)
        results = serving_out / "results.json"
        report["serving"] = json.loads(results.read_text()) if results.exists() else {}
        if status:
            raise RuntimeError(f"bench_serving exited with status {status}")

    steps = {"default model": default_model, "random glm-5": dsa_model}
    if not args.skip_swap_in:
        steps["swap-in"] = swap_in
    if serving_args is not None:
        steps["serving"] = serving_levels
    for name, step in steps.items():
        run_step(report, name, step, args.out)
        if name == "random glm-5":
            print_engine_rows(report["engine"])
    mismatched = [r for r in report["engine"] if r["equal"] != r["requests"]]
    return 1 if report["failed"] or (mismatched and args.device == "cpu") else 0


def run_step(report: dict, name: str, step, out: Path | None) -> None:
    """One step of the script; one that raises is reported (its traceback on stderr, its error in the report) and
    the next still runs: a lent GPU's minutes cannot be had again. The report is written after every step, so a
    call that runs out of time keeps what it measured."""
    try:
        step()
    except Exception as error:
        traceback.print_exc()
        report["failed"][name] = f"{type(error).__name__}: {error}"
        print(f"{PROG}: step {name!r} failed: {report['failed'][name]}", file=sys.stderr)
    if out:
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {out} (after {name})")


def print_engine_rows(rows: list[dict]) -> None:
    print(f"{'model':<14}{'mode':<10}{'on':<14}{'tokens as on the cpu':>22}{'first diff':>11}{'cpu step ms':>12}"
          f"{'device step ms':>15}")
    for r in rows:
        diff = "" if r["first_difference"] is None else str(r["first_difference"])
        print(f"{r['model']:<14}{r['mode']:<10}{r['on']:<14}{r['equal']:>12} of {r['requests']:<6}{diff:>11}"
              f"{r['cpu_step_ms']:>12.1f}{r['device_step_ms']:>15.1f}")

if __name__ == "__main__":
    sys.exit(run_main(main, prog=PROG))
