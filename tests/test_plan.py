"""The capacity planner: its figures against the reference formula worked out here, and its refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hisparse.memory.hisparse_config import HiSparseConfig
from hisparse.plan import GIB, MODELS, PROG, main, plan_capacity

GLM_ARGS = ["--model", "glm-5.1", "--gpu-memory-gb", "141", "--tp", "8", "--input-len", "32768",
            "--output-len", "8192"]
CONFIG = '{"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 8}'


def reference_figures(layers: int, kv: int, idx: int, budget: int, buffer: int, ratio: int, context: int):
    """SGLang HiSparse's sizing, written out independently of hisparse.plan."""
    cell = layers * (kv + ratio * idx)
    slots = budget // cell
    logical = slots * ratio
    hisparse = min(slots // (buffer + 1), logical // context)
    baseline = budget // (layers * (kv + idx)) // context
    return cell, slots, logical, hisparse, baseline


@pytest.mark.parametrize("model,kv_dtype,kv_bytes,layers", [
    ("glm-5.1", "bfloat16", 1152, 78),
    ("glm-5.1", "fp8_e4m3", 656, 78),
    ("deepseek-v3.2", "bfloat16", 1152, 61),
    ("deepseek-v3.2", "fp8_e4m3", 656, 61),
])
def test_figures_follow_the_reference_formula(model, kv_dtype, kv_bytes, layers):
    weights_gb, gpu_gb, fraction, tp = 720.0, 141.0, 0.85, 8
    plan = plan_capacity(MODELS[model], HiSparseConfig(2048, 4096, 8), gpu_memory_gb=gpu_gb, tp=tp,
                         mem_fraction_static=fraction, weights_gb=weights_gb, input_len=32768,
                         output_len=8192, kv_cache_dtype=kv_dtype)
    budget = int(gpu_gb * fraction * GIB) - int(weights_gb * GIB) // tp
    cell, slots, logical, hisparse, baseline = reference_figures(layers, kv_bytes, 132, budget, 4096, 8,
                                                                 40960)
    assert (plan.kv_bytes, plan.indexer_bytes, plan.budget_bytes_per_gpu) == (kv_bytes, 132, budget)
    assert (plan.hisparse_cell_bytes, plan.device_slots, plan.logical_capacity) == (cell, slots, logical)
    assert (plan.max_requests_hisparse, plan.max_requests_baseline) == (hisparse, baseline)
    assert plan.baseline_bytes_per_token == layers * (kv_bytes + 132)
    assert plan.host_bytes_per_gpu == logical * layers * kv_bytes
    assert plan.max_requests_hisparse > 3 * plan.max_requests_baseline  # the point of HiSparse


def test_cli_prints_the_figures(capsys):
    assert main(GLM_ARGS + ["--weights-gb", "720", "--hisparse-config", CONFIG]) == 0
    out = capsys.readouterr().out
    budget = int(141 * 0.85 * GIB) - int(720 * GIB) // 8
    cell, slots, logical, hisparse, baseline = reference_figures(78, 1152, 132, budget, 4096, 8, 40960)
    assert f"{cell:,} B per slot" in out and f"{78 * 1284:,} B" in out and f"{78 * 1152:,} B" in out
    assert f"device slots        {slots:,}" in out
    assert f"logical capacity    {logical:,}" in out
    assert f"baseline {baseline:,} per pool" in out and f"hisparse {hisparse:,} per pool" in out
    assert "host memory" in out


def test_dp_attention_multiplies_pools_and_replicates_attention_weights():
    shape, cfg = MODELS["glm-5.1"], HiSparseConfig(2048, 4096, 8)
    common = dict(gpu_memory_gb=141, tp=8, input_len=32768, output_len=8192)
    tp_only, dp8 = plan_capacity(shape, cfg, **common), plan_capacity(shape, cfg, dp=8, **common)
    attn, other = shape.weight_bytes()
    heads = shape.attention_head_bytes()  # only the heads' projections split; the rest of attention is whole
    assert tp_only.weights_bytes_per_gpu == attn - heads + heads // 8 + other // 8
    vocab = shape.vocabulary_bytes()  # the embedding and the LM head are whole in each DP group too
    assert dp8.weights_bytes_per_gpu == attn + vocab + (other - vocab) // 8
    assert dp8.kv_pools == 8 and dp8.max_requests_hisparse_total == 8 * dp8.max_requests_hisparse


def test_derived_fp8_weights_are_the_size_of_the_released_checkpoints():
    for model, low, high in (("deepseek-v3.2", 650e9, 700e9), ("glm-5.1", 720e9, 780e9)):
        assert low < sum(MODELS[model].weight_bytes()) < high, model


def test_hisparse_config_defaults_and_type_errors(capsys):
    """The planner reads --hisparse-config with the engine's own parser: same defaults, same errors."""
    assert HiSparseConfig.parse(None, 2048) == HiSparseConfig(2048, 4096, 8)
    assert HiSparseConfig.parse('{"host_to_device_ratio": 4}', 2048) == HiSparseConfig(2048, 4096, 4)
    for text, field in (('{"top_k": true}', "top_k"),
                        ('{"device_buffer_size": 4096.0}', "device_buffer_size"),
                        ('{"host_to_device_ratio": 0}', "host_to_device_ratio")):
        assert main([*GLM_ARGS, "--hisparse-config", text]) == 2
        assert field in capsys.readouterr().err


@pytest.mark.parametrize("extra,message", [
    (["--hisparse-config", '{"top_k": 2048, "device_buffer_size": 1024}'], "must be >= top_k"),
    (["--hisparse-config", '{"top_k": 2048, "device_buffer_size": 202751}'], "must be at most 202750 for a context"),
    (["--hisparse-config", '{"top_k": 2048, "buffer": 4096}'], "unknown field 'buffer'"),
    (["--hisparse-config", '{"top_k": "2048"}'], "top_k must be an integer"),
    (["--hisparse-config", "{top_k: 2048}"], "not valid JSON"),
    (["--hisparse-config", "[2048]"], "must be a JSON object"),
    (["--weights-gb", "2000"], "weights need"),
    (["--host-memory-gb", "256", "--hisparse-config", CONFIG], "host pools need"),
    (["--mem-fraction-static", "1.5"], "mem-fraction-static"),
    (["--dp", "3"], "must divide --tp"),
    (["--num-gpus", "12"], "not a multiple of --tp"),
    (["--weights-gb", "956"], "fewer than one request's hot buffer"),
])
def test_impossible_configs_are_refused_with_one_line(assert_refused, extra, message):
    assert assert_refused(main, GLM_ARGS + extra, PROG, message) == ""


@pytest.mark.parametrize("extra,message", [
    (["--gpu-memory-gb", "nan"], "--gpu-memory-gb: must be in (0, 1024], got nan"),
    (["--gpu-memory-gb", "inf"], "--gpu-memory-gb: must be in (0, 1024], got inf"),
    (["--gpu-memory-gb", "1e12"], "--gpu-memory-gb: must be in (0, 1024], got 1e12"),
    (["--weights-gb", "nan"], "--weights-gb: must be > 0, got nan"),
    (["--host-memory-gb", "nan"], "--host-memory-gb: must be > 0, got nan"),
    (["--host-memory-gb", "-1"], "--host-memory-gb: must be > 0, got -1"),
    (["--tp", str(10**12)], "--tp: must be in [1, 1024]"),
    (["--tp", "128"], "more than the 64 attention heads of glm-5.1"),
    (["--input-len", str(10**12)], "exceeds the context of glm-5.1 (202,752 tokens)"),
    (["--input-len", "200000", "--output-len", "2753"], "= 202,753 tokens exceeds the context"),
    (["--input-len", "0"], "--input-len: must be >= 1, got 0"),
    (["--output-len", "-1"], "--output-len: must be >= 0, got -1"),
    (["--num-gpus", "0"], "--num-gpus: must be in [1, 65536], got 0"),
    (["--tp", "x"], "--tp: not an integer: 'x'"),
])
def test_bad_flags_are_one_line_and_exit_2(assert_refused, extra, message):
    assert assert_refused(main, [*GLM_ARGS, *extra], PROG, message) == ""


def test_the_largest_context_of_a_model_is_planned(capsys):
    """Input + output exactly the model's context still plans; one token more is refused (above)."""
    assert main([*GLM_ARGS[:6], "--input-len", "200000", "--output-len", "2752"]) == 0
    assert "202,752 tokens per request" in capsys.readouterr().out


def test_module_entry_point_exits_non_zero_without_traceback():
    run = subprocess.run([sys.executable, "-m", "hisparse.plan", *GLM_ARGS, "--hisparse-config", '{"k": 1}'],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "Traceback" not in run.stderr and "unknown field 'k'" in run.stderr
