"""`python -m hisparse.tools.random_checkpoint` writes checkpoints in the real format: transformers reads them
and computes what we compute, our loader reads them as it reads a release (block-FP8 included), and the
engine serves them from the folder alone (config, weights, tokenizer, chat template)."""

from __future__ import annotations

import json

import pytest
import torch
from dsa_checkpoints import baseline_cache, rel_err, sequence_logits
from transformers import AutoModelForCausalLM

from hisparse import LLM, SamplingParams
from hisparse.formats.fp8 import block_dequant
from hisparse.models.loader import open_model
from hisparse.tools import random_checkpoint


@pytest.mark.parametrize("arch, name", [("glm-5", "GlmMoeDsaForCausalLM"), ("deepseek-v3.2", "DeepseekV32ForCausalLM")])
def test_transformers_reads_the_checkpoint_and_computes_what_we_compute(tiny_dsa_dir, arch, name, tokenizer):
    folder = tiny_dsa_dir(arch)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [name]
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"], config["index_head_dim"]) == (512, 64, 128)
    files = open_model(folder)
    assert files.architecture == name and files.config.index_topk == 16
    ours = files.load(torch.float32)
    layout = files.config.row_layout("bfloat16")
    assert layout.row_bytes == 1152 and files.config.row_layout("fp8_e4m3").row_bytes == 656  # DSA's rows
    assert files.indexer_spec().key_format.row_bytes == 132
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor(tokenizer.encode("A memory hierarchy keeps the whole cache on the host. " * 8)[:90])
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert rel_err(sequence_logits(ours, ids, 80, baseline_cache(ours, 128)), ref) < 1e-4


def test_fp8_weights_load_as_their_dequantized_values(tmp_path, tiny_dsa_dir):
    assert random_checkpoint.main(["--arch", "deepseek-v3.2", "--out", str(tmp_path), "--layers", "2",
                                   "--hidden", "128", "--heads", "2", "--experts", "4", "--fp8"]) == 0
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        q_b = f.get_tensor("model.layers.1.self_attn.q_b_proj.weight")
        assert q_b.dtype == torch.float8_e4m3fn
        assert "model.layers.1.self_attn.q_b_proj.weight_scale_inv" in f.keys()
        assert f.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.float32  # the router, as released
        scale = f.get_tensor("model.layers.1.self_attn.q_b_proj.weight_scale_inv")
    model = open_model(tmp_path).load(torch.float32)
    loaded = model.model.layers[1].self_attn.q_b_proj.weight
    assert loaded.dtype == torch.float32 and torch.equal(loaded, block_dequant(q_b, scale))


def test_the_engine_serves_the_folder_with_its_tokenizer_and_chat_template(tiny_dsa_dir):
    llm = LLM(str(tiny_dsa_dir("glm-5")), dtype="float32", enable_hisparse=True,
              hisparse_config={"device_buffer_size": 32}, max_running_requests=4, device_kv_budget=32 << 20)
    assert llm.engine.cache.config.top_k == 16  # the checkpoint's index_topk
    prompt = "The printing press spread across Europe within fifty years. " * 6
    outs = llm.generate([prompt, "Hello"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [24, 24] and all(o.text for o in outs)
    assert llm.stats()["swap_in"]["misses"] > 0
    chat = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=4, temperature=0))
    assert len(chat[0].token_ids) >= 1
    assert llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]).startswith("<|im_start|>")


@pytest.mark.parametrize("argv, words", [
    (["--arch", "gpt-2"], "invalid choice"),
    (["--arch", "glm-5", "--layers", "0"], "--layers: must be"),
    (["--arch", "glm-5", "--rope-dim", "256"], "--rope-dim (256) must be even and at most --index-head-dim"),
    (["--arch", "deepseek-v3.2", "--experts", "3"], "--experts (3) must give each of the 2 expert groups"),
    (["--arch", "glm-5", "--shared-indexer-layers", "9"], "--shared-indexer-layers [9] out of range"),
    (["--arch", "glm-5", "--index-head-dim", "96"], "--index-head-dim (96) must be a power of two"),
])
def test_bad_flags_fail_in_one_line(tmp_path, assert_refused, argv, words):
    assert_refused(random_checkpoint.main, [*argv, "--out", str(tmp_path / "x")], random_checkpoint.PROG, words)
