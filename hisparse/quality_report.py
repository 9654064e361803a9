"""How much the default model loses by attending to the indexer's top_k: `python -m hisparse.quality_report`.

On held-out text (the Python-documentation topics never used for training) at each context length, in
the same run, sparse (top_k 256) against dense:

1. recall: per layer, the share of the true attention mass (the model's attention summed over heads,
   L1-normalised) inside the indexer's top_k, next to the share inside the true top_k (the oracle);
2. next-token NLL and perplexity of sparse against dense on the same tokens (the held-out text of the
   tail, not the passkey question and answer);
3. passkey retrieval: a 5-digit number hidden at some depth of the text, asked for at the end;
4. overlap of consecutive decode steps' top-k sets per layer (indexer and oracle): what decides the miss
   rate of a hot buffer.

How, per trial: the text is held-out tokens with the passkey sentence inserted and the question at the
end, then the answer. The first `context - tail` tokens run densely once (as a prefill would); then the
last `tail` tokens run teacher-forced twice over that shared prefix: densely (the dense NLL, the true
attention for recall and overlap) and sparsely, each query attending to its own indexer top_k of its
causal past through a mask (the sparse NLL). That is what sparse decode computes token by token: the
selection is `IndexSelector.select` on keys stored in the weights' `key_format` (int8 for the
default model), the newest position always included, `dense_layers` dense. The passkey answer runs
like the engine's greedy decode: the prompt dense (prefill), the answer tokens sparse (decode); it
counts as retrieved when every answer token is the argmax (= greedy decode writes the number).
`--engine-check` also decodes one passkey prompt through the real engine, sparse and
dense, and prints whether the engine's text agrees with the teacher-forced verdict.

The model runs in the engine's dtype (`--dtype`, default auto: bfloat16 on our CPUs) and quantization
(`--quantization`: the dense copy of the quantized numbers serves these long prompts); the measuring
(the true attention, the NLL) is float32 either way. Defaults: 8 trials at each of 2k, 4k and 8k, tail 256:
about 7.5 minutes on 2 CPU cores in bfloat16, two thirds of it the 8k prefix forwards. Fewer trials are too
noisy for perplexity: the paired NLL difference of one 256-token tail ranged from -0.01 to +0.23 nats at 4k
with one set of weights (one text leaned on copy heads the indexer missed), and 2 trials gave +4.3% where 8
gave +6.8%.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from hisparse.attention.functional import causal_attention
from hisparse.attention.index_selection import IndexSelector
from hisparse.cli_args import (
    OneLineParser,
    comma_list,
    existing_file,
    int_in,
    output_file,
    positive_int,
    run_main,
)
from hisparse.engine.engine_config import DTYPES, resolve_model_dtype
from hisparse.layers.indexer import check_indexer_weights
from hisparse.layers.linear import QUANTIZATIONS
from hisparse.memory.indexer_cache import IndexerKeyCache

PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"
_ROW_CHUNK = 32  # query rows per select() call: bounds the [rows, T, d] key gather
PROG = "python -m hisparse.quality_report"
MAX_TRIALS = 1000  # each trial is seconds to minutes; the cap only stops a run that could never end
MAX_THREADS = 1024


class ForcedSequenceBackend:
    """One sequence's K/V and index keys (in the weights' key format), growing chunk by chunk; attention dense
    or teacher-forced sparse.

    `truncate(n)` forgets everything from position n on, so several tails can run over one shared prefix.
    With `measure` set, a dense chunk records per layer the true attention mass in the indexer's and the
    oracle's top_k, and both selections (for the overlap of consecutive rows).
    """

    reads_index_queries = True  # every chunk measures or selects with them
    decode_only = False  # chunks of a text
    index_query_rows = None

    def __init__(self, model, top_k: int, dense_layers: tuple[int, ...], max_len: int) -> None:
        self.num_layers = len(model.layers)
        self.scale = model.attention_scale
        self.top_k = top_k
        self.dense_layers = set(dense_layers)
        self.k: list[torch.Tensor | None] = [None] * self.num_layers
        self.v: list[torch.Tensor | None] = [None] * self.num_layers
        self.index = IndexerKeyCache(self.num_layers, max_len, model.indexer_config.key_layout)
        self.selector = IndexSelector(self.index)
        self.length = 0
        self.sparse = False
        self.oracle = False  # sparse attention over the true top_k instead of the indexer's
        self.measure: list[dict] | None = None

    def truncate(self, n: int) -> None:
        self.k = [None if k is None else k[:n] for k in self.k]
        self.v = [None if v is None else v[:n] for v in self.v]
        self.length = n

    def select(self, layer: int, index_q, index_w, rows: torch.Tensor) -> torch.Tensor:
        """Indexer top_k positions of query rows (absolute positions) over their causal past: [n, K]."""
        width = int(rows.max()) + 1
        slots = torch.arange(width).expand(_ROW_CHUNK, width)
        out = []
        for i in range(0, len(rows), _ROW_CHUNK):
            sl = slice(i, i + _ROW_CHUNK)
            n = len(rows[sl])
            out.append(self.selector.select(layer, index_q[sl], index_w[sl], slots[:n], rows[sl] + 1, self.top_k))
        return torch.cat(out)

    def attend(self, layer, q, k, v, index_q=None, index_k=None, index_w=None):
        n = q.shape[0]
        start = self.k[layer].shape[0] if self.k[layer] is not None else 0
        if self.k[layer] is not None:
            k, v = torch.cat([self.k[layer], k]), torch.cat([self.v[layer], v])
        self.k[layer], self.v[layer] = k, v
        rows = torch.arange(start, start + n)
        self.index.write(layer, rows, index_k)
        if layer == self.num_layers - 1:
            self.length = start + n
        if self.sparse and layer not in self.dense_layers:
            if self.oracle:
                target = self._target(q, k, rows)
                target[torch.arange(n), rows] = float("inf")
                picked = target.topk(min(self.top_k, k.shape[0]), dim=-1).indices
                picked = picked.masked_fill(target.gather(1, picked) <= 0, -1)
            else:
                picked = self.select(layer, index_q, index_w, rows)
            mask = torch.zeros(n, k.shape[0] + 1, dtype=torch.bool)  # column -1 takes the padding
            mask.scatter_(1, torch.where(picked >= 0, picked, k.shape[0]), True)
            mask = mask[:, :-1]
            qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale, enable_gqa=True)
            return out[0].transpose(0, 1)
        if self.measure is not None:
            self._measure(layer, q, k, index_q, index_w, rows)
        return causal_attention(q, k, v, self.scale)

    def _target(self, q, k, rows) -> torch.Tensor:
        """The true attention of rows over all keys, summed over heads and L1-normalised: [n, T]."""
        group = q.shape[1] // k.shape[1]
        q, k = q.float(), k.float()  # the measuring stick stays float32 whatever the model runs in
        logits = torch.einsum("nhd,shd->hns", q, k.repeat_interleave(group, dim=1)) * self.scale
        logits.masked_fill_(torch.arange(k.shape[0])[None, None, :] > rows[None, :, None], float("-inf"))
        return logits.softmax(-1).mean(0)

    def _measure(self, layer, q, k, index_q, index_w, rows) -> None:
        target = self._target(q, k, rows)
        picked = self.select(layer, index_q, index_w, rows)
        oracle = target.topk(min(self.top_k, target.shape[1]), dim=-1).indices
        self.measure[layer] = {
            "mass": target.gather(1, picked.clamp(min=0)).mul(picked >= 0).sum(-1),
            "oracle": target.gather(1, oracle).sum(-1),
            "picked": picked, "oracle_picked": oracle}


def _overlap(sets: torch.Tensor) -> float:
    """Mean |S_t & S_t+1| / |S_t+1| over consecutive rows of a [n, K] selection (-1 = padding)."""
    shares = []
    for a, b in zip(sets[:-1].tolist(), sets[1:].tolist(), strict=True):
        a, b = {p for p in a if p >= 0}, {p for p in b if p >= 0}
        shares.append(len(a & b) / len(b))
    return float(np.mean(shares))


def passkey_parts(tokenizer, key: int) -> tuple[list[int], list[int], list[int]]:
    """The token ids of the needle sentence, the question and the answer for a 5-digit passkey."""
    return (tokenizer.encode(f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n"),
            tokenizer.encode(PASSKEY_QUESTION), tokenizer.encode(f" {key}."))


def passkey_prompt(tokenizer, context: int, trial: int) -> tuple[list[int], list[int], int]:
    """(prompt ids, answer ids, passkey): held-out text with the passkey sentence inserted at a depth that
    varies with the trial, then the question; prompt + answer is exactly `context` tokens."""
    from hisparse.data.pydoc_corpus import heldout_tokens

    rng = np.random.default_rng(1000 + 7 * context + trial)
    key = int(rng.integers(10000, 100000))
    needle, question, answer = passkey_parts(tokenizer, key)
    filler_len = context - len(needle) - len(question) - len(answer)
    filler = heldout_tokens(tokenizer, filler_len, offset=997 * trial)
    depth = [0.25, 0.6, 0.85, 0.4, 0.1][trial % 5]
    at = int(depth * filler_len)
    return filler[:at] + needle + filler[at:] + question, answer, key


@torch.inference_mode()
def run_trial(model, prompt: list[int], answer: list[int], top_k: int, dense_layers: tuple[int, ...],
              tail: int, alt_dense_layers: tuple[int, ...] | None = None, text_end: int | None = None) -> dict:
    """One passkey prompt: recall, overlap, NLL and passkey, sparse vs dense (module docstring). The NLL
    counts only next tokens before `text_end` (the question's first token: the held-out text); with
    `alt_dense_layers`, also the sparse NLL when those layers (instead of `dense_layers`) stay dense."""
    ids = torch.tensor(prompt + answer)
    total = len(ids)
    split = total - tail
    backend = ForcedSequenceBackend(model, top_k, dense_layers, total)
    positions = torch.arange(total)

    def run(lo, hi):
        return model(ids[lo:hi], positions[lo:hi], backend)

    end = len(prompt) if text_end is None else text_end

    def nll(hidden, lo, hi):
        """Mean NLL of the next tokens lo+1 .. min(hi, end)-1 (the text, not the question or answer)."""
        last = min(hi, end)
        logp = model.compute_logits(hidden[:last - 1 - lo]).float().log_softmax(-1)
        return -logp.gather(1, ids[lo + 1:last, None]).squeeze(1)

    run(0, split)  # the shared dense prefix (a prefill)
    backend.measure = [None] * backend.num_layers
    dense_hidden = run(split, total)
    measured, backend.measure = backend.measure, None
    dense_nll = nll(dense_hidden, split, total)
    p = len(prompt)
    answer_logits = model.compute_logits(dense_hidden[p - 1 - split:]).argmax(-1)
    dense_ok = answer_logits[:-1].tolist() == answer
    # Sparse decode of the answer after a dense prefill of the prompt (what the engine does).
    backend.truncate(p)
    backend.sparse = True
    sparse_answer_hidden = run(p, total)
    first = int(answer_logits[0])  # from the prompt's last position: prefill, dense in both modes
    sparse_pred = [first] + model.compute_logits(sparse_answer_hidden[:-1]).argmax(-1).tolist()
    sparse_ok = sparse_pred == answer
    # The whole tail teacher-forced sparse over the dense prefix.
    backend.truncate(split)
    sparse_nll = nll(run(split, total), split, total)
    alt_nll = None
    if alt_dense_layers is not None:
        backend.truncate(split)
        backend.dense_layers = set(alt_dense_layers)
        alt_nll = float(nll(run(split, total), split, total).mean())
    valid = torch.arange(split, total) >= top_k  # rows whose context exceeds top_k (others are dense)
    layers = []
    for layer, m in enumerate(measured):
        layers.append({
            "layer": layer,
            "mass": float(m["mass"][valid].mean()),
            "oracle": float(m["oracle"][valid].mean()),
            "overlap": _overlap(m["picked"][valid]),
            "oracle_overlap": _overlap(m["oracle_picked"][valid])})
    return {"dense_nll": float(dense_nll.mean()), "sparse_nll": float(sparse_nll.mean()), "alt_sparse_nll": alt_nll,
            "passkey_dense": dense_ok, "passkey_sparse": sparse_ok, "layers": layers}


def engine_check(model, tokenizer, prompt: list[int], answer: list[int], top_k: int) -> dict:
    """Greedy-decode the passkey prompt through the real engine, sparse and dense."""
    from hisparse.engine.engine_config import EngineConfig
    from hisparse.engine.llm_engine import LLMEngine
    from hisparse.engine.sampling_params import SamplingParams

    out = {}
    for sparse in (True, False):
        engine = LLMEngine(EngineConfig(sparse_attention=sparse, top_k=top_k, chunked_prefill_size=len(prompt)),
                           model=model, tokenizer=tokenizer)
        request = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=len(answer),
                                                            ignore_eos=True))
        while not request.finished:
            engine.step()
        out["sparse" if sparse else "dense"] = request.output_token_ids == answer
    return out


def summarize(context: int, trials: list[dict]) -> dict:
    num_layers = len(trials[0]["layers"])
    per_layer = [{key: float(np.mean([t["layers"][i][key] for t in trials]))
                  for key in ("mass", "oracle", "overlap", "oracle_overlap")} | {"layer": i}
                 for i in range(num_layers)]
    dense_nll = float(np.mean([t["dense_nll"] for t in trials]))
    sparse_nll = float(np.mean([t["sparse_nll"] for t in trials]))
    return {
        "context": context, "trials": len(trials), "layers": per_layer,
        "mass": float(np.mean([r["mass"] for r in per_layer])),
        "oracle": float(np.mean([r["oracle"] for r in per_layer])),
        "mass_ratio": float(np.mean([r["mass"] / r["oracle"] for r in per_layer])),
        "overlap": float(np.mean([r["overlap"] for r in per_layer])),
        "oracle_overlap": float(np.mean([r["oracle_overlap"] for r in per_layer])),
        "dense_nll": dense_nll, "sparse_nll": sparse_nll,
        "dense_ppl": math.exp(dense_nll), "sparse_ppl": math.exp(sparse_nll),
        "ppl_change": math.exp(sparse_nll - dense_nll) - 1,
        "alt_ppl_change": (None if trials[0]["alt_sparse_nll"] is None else
                           math.exp(float(np.mean([t["alt_sparse_nll"] for t in trials])) - dense_nll) - 1),
        "passkey_dense": float(np.mean([t["passkey_dense"] for t in trials])),
        "passkey_sparse": float(np.mean([t["passkey_sparse"] for t in trials])),
    }


def format_table(results: list[dict], top_k: int, dense_layers) -> str:
    lines = [f"top_k {top_k}, dense layers {list(dense_layers)}", "",
             "context  trials  mass  oracle  ratio  overlap(idx/oracle)  ppl dense  ppl sparse  change  "
             "passkey dense  passkey sparse"]
    for r in results:
        lines.append(f"{r['context']:>7}  {r['trials']:>6}  {r['mass']:.3f}  {r['oracle']:.3f}  {r['mass_ratio']:.3f}"
                     f"  {r['overlap']:.3f} / {r['oracle_overlap']:.3f}      {r['dense_ppl']:9.3f}  "
                     f"{r['sparse_ppl']:10.3f}  {100 * r['ppl_change']:+5.2f}%  {r['passkey_dense']:13.2f}  "
                     f"{r['passkey_sparse']:14.2f}")
    lines += ["", "per layer: indexer mass / oracle mass (ratio), indexer overlap / oracle overlap"]
    header = "layer  " + "  ".join(f"{r['context']:>31}" for r in results)
    lines.append(header)
    for i in range(len(results[0]["layers"])):
        cells = []
        for r in results:
            x = r["layers"][i]
            cells.append(f"{x['mass']:.3f}/{x['oracle']:.3f} ({x['mass'] / x['oracle']:.2f}) "
                         f"{x['overlap']:.2f}/{x['oracle_overlap']:.2f}")
        lines.append(f"{i:>5}  " + "  ".join(f"{c:>31}" for c in cells))
    return "\n".join(lines)


def layer_list(text: str) -> list[int]:
    """argparse type: comma-separated layer numbers, '' for none."""
    return [] if not text.strip() else comma_list(int_in(0))(text)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=positive_int, nargs="+", default=[2048, 4096, 8192],
                        help="context lengths, each above top_k + 1 and within the model's context")
    parser.add_argument("--trials", type=int_in(1, MAX_TRIALS), default=8, help="passkey prompts per context "
                        f"(each also gives a recall/NLL sample of `tail` tokens; at most {MAX_TRIALS})")
    parser.add_argument("--tail", type=positive_int, default=256,
                        help="teacher-forced positions per trial: more than the passkey question and answer, "
                        "fewer than the smallest context")
    parser.add_argument("--top-k", type=positive_int, default=256)
    parser.add_argument("--dense-layers", type=layer_list, default=None,
                        help="comma-separated layers kept dense ('' = none); default: the weights' choice")
    parser.add_argument("--compare-dense-layers", type=layer_list, default=None,
                        help="also measure sparse perplexity with these layers dense instead ('' = none)")
    parser.add_argument("--indexer", type=existing_file, default=None,
                        help="indexer weights (default: the shipped ones)")
    parser.add_argument("--engine-check", action="store_true", help="also decode one 2k passkey prompt "
                        "through the real engine, sparse and dense (about 1.5 minutes more)")
    parser.add_argument("--json", type=output_file, default="quality_report.json")
    parser.add_argument("--threads", type=int_in(1, MAX_THREADS), default=2)
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="the model's dtype, as the engine's --dtype (default: what the engine would serve in)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                        help="the model's weight-only quantization, as the server's --quantization")
    return parser


def check_args(args: argparse.Namespace, num_layers: int, max_context: int) -> None:
    """Refuse what the model's config alone shows cannot run, before the tokenizer and the weights load.

    A context must exceed top_k + 1: the recall and overlap figures average over the tail rows with more than
    top_k positions behind them (two rows at least, for an overlap), and a context without one gave NaN."""
    if len(set(args.contexts)) != len(args.contexts):
        raise ValueError(f"--contexts: a context given twice in {args.contexts}")
    for context in args.contexts:
        if context > max_context:
            raise ValueError(f"--contexts {context} exceeds the model's context of {max_context} tokens")
        if context < args.top_k + 2:
            raise ValueError(f"--contexts {context} must exceed --top-k {args.top_k} + 1: no position has more "
                             "than top_k positions to choose from, so sparse is dense")
        if args.tail >= context:
            raise ValueError(f"--tail {args.tail} must be smaller than --contexts {context} (the tail runs over a "
                             "dense prefix of the rest)")
    for flag, layers in (("--dense-layers", args.dense_layers), ("--compare-dense-layers", args.compare_dense_layers)):
        if layers and max(layers) >= num_layers:
            raise ValueError(f"{flag}: layer {max(layers)} does not exist; the model has layers 0..{num_layers - 1}")
    if args.indexer is not None:
        try:
            check_indexer_weights(args.indexer, num_layers)
        except ValueError as error:
            raise ValueError(f"--indexer {error}") from None


def check_passkey_fits(args: argparse.Namespace, tokenizer) -> None:
    """What the passkey sentences' lengths decide, checked once the tokenizer is read (before the weights).

    The tail must reach back past the question and answer into the held-out text, since the NLL is measured on
    that text only (a shorter tail measured nothing and reported NaN); each context must hold the needle, the
    question, the answer and some text."""
    parts = [passkey_parts(tokenizer, key) for key in (10000, 99999)]  # the shortest and longest keys
    needle, question, answer = (max(len(p[i]) for p in parts) for i in range(3))
    if args.tail < question + answer + 2:
        raise ValueError(f"--tail {args.tail} must be at least {question + answer + 2}: the last {question + answer} "
                         "positions are the passkey question and answer, and the NLL needs two text positions")
    least = needle + question + answer + 1
    if min(args.contexts) < least:
        raise ValueError(f"--contexts {min(args.contexts)} is too short for the passkey prompt: at least {least} "
                         "tokens")


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    from hisparse.models.loader import load_llama, open_model

    files = open_model(None)
    config = files.config
    check_args(args, config.num_layers, config.max_position_embeddings)
    tokenizer = files.tokenizer()
    check_passkey_fits(args, tokenizer)
    torch.set_num_threads(args.threads)

    dtype = resolve_model_dtype(args.dtype)
    model = load_llama(files, indexer=args.indexer if args.indexer else True, dtype=dtype,
                       quantization=args.quantization)
    dense_layers = tuple(model.indexer_config.dense_layers if args.dense_layers is None else args.dense_layers)
    alt = None if args.compare_dense_layers is None else tuple(args.compare_dense_layers)
    started = time.perf_counter()
    results = []
    for context in args.contexts:
        trials = []
        for trial in range(args.trials):
            prompt, answer, _ = passkey_prompt(tokenizer, context, trial)
            text_end = len(prompt) - len(tokenizer.encode(PASSKEY_QUESTION))
            t0 = time.perf_counter()
            trials.append(run_trial(model, prompt, answer, args.top_k, dense_layers, args.tail, alt, text_end))
            t = trials[-1]
            print(f"context {context} trial {trial}: nll dense {t['dense_nll']:.4f} sparse {t['sparse_nll']:.4f}, "
                  f"passkey dense {t['passkey_dense']} sparse {t['passkey_sparse']} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        results.append(summarize(context, trials))
    report = {"top_k": args.top_k, "dense_layers": list(dense_layers), "tail": args.tail,
              "dtype": str(dtype).removeprefix("torch."), "quantization": args.quantization,
              "compare_dense_layers": None if alt is None else list(alt), "results": results}
    if args.engine_check:
        prompt, answer, _ = passkey_prompt(tokenizer, min(args.contexts), 0)
        report["engine_check"] = engine_check(model, tokenizer, prompt, answer, args.top_k)
        print(f"engine check ({min(args.contexts)} tokens, trial 0): passkey retrieved {report['engine_check']}")
    report["seconds"] = time.perf_counter() - started
    print(f"model in {report['dtype']}, quantization {args.quantization}")
    print(format_table(results, args.top_k, dense_layers))
    if alt is not None:
        print(f"\nwith dense layers {list(alt)} instead: sparse perplexity change "
              + ", ".join(f"{r['context']}: {100 * r['alt_ppl_change']:+.2f}%" for r in results))
    print(f"\n{report['seconds']:.0f} s; JSON in {args.json}")
    args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.exit(run_main(main, prog=PROG))
