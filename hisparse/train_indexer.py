"""Train the lightning indexers of SmolLM2 by DeepSeek's dense warm-up: `python -m hisparse.train_indexer`.

The model stays frozen. For every layer the target is the model's own attention distribution, summed
over heads and L1-normalised (the mean over heads); the loss is KL(target || softmax(I)) over the causal
past, I the indexer scores (`--target max`: the per-key max over heads instead, L1-normalised; `--loss
kl+topk` adds `topk_margin_loss`, which charges the target mass that ranks below the k-th score). All 30
layers train from the same forward passes:

1. capture: one frozen forward per `--seq-len` chunk of the training text records each layer's attention
   input x (after the input RMSNorm) to a float16 memmap in `--out` (about 3.4 GB for 2k-token chunks);
2. epochs: per chunk and layer, the target is recomputed from x with the layer's frozen q/k projections
   (cheap: it is one attention's logits), for `--queries` query rows drawn at random from the chunk (new
   rows every epoch; the keys are always the whole causal past), and every layer's indexer takes its own
   gradient step from the same chunk.

Data: the Python documentation shipped with the standard library (`hisparse.data.pydoc_corpus`), the
held-out topics never used; with `--retrieval-chunks N`, also N passkey-style sequences built from the
training text (`hisparse.data.retrieval_sequences`), whose answer rows are always among the query rows
(repeated so that they weigh about a quarter of that chunk's loss). Progress bar, a checkpoint after
every epoch (`--resume` continues from it; the seed fixes the initialisation, the chunk order and the
query rows of every epoch, so a resumed run is the same run), a held-out recall line after every
epoch (head-summed top-k mass against the oracle's, and the worst-head miss, `worst_head_miss`, the figure
that tracks perplexity), and the final weights as bf16 safetensors (`--export`, default
`<out>/smollm2_indexer.safetensors`).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from hisparse.attention.single_sequence import SingleSequenceCache
from hisparse.cli_args import (
    OneLineParser,
    comma_list,
    existing_file,
    float_in,
    int_in,
    output_dir,
    output_file,
    positive_float,
    positive_int,
    run_main,
)
from hisparse.layers.indexer import (
    IndexerConfig,
    LlamaIndexer,
    attach_indexers,
    check_indexer_weights,
    load_indexer_weights,
    save_indexer_weights,
)
from hisparse.layers.rotary import apply_rope_half


@torch.inference_mode()
def capture_attention_inputs(model, ids: torch.Tensor) -> torch.Tensor:
    """One frozen forward over `ids` (positions 0..T-1) -> every layer's attention input [L, T, hidden] (what its
    input norm hands the attention, and an indexer reads)."""
    sink: list[torch.Tensor] = []
    hooks = [layer.input_norm.register_forward_hook(lambda module, args, out: sink.append(out.detach().clone()))
             for layer in model.layers]
    try:
        model(ids, torch.arange(ids.shape[0]), SingleSequenceCache(len(model.layers), model.attention_scale))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack(sink)


_MASKED = -1e30  # finite, so that 0 * log p stays 0 at masked (future) positions


@torch.no_grad()
def head_attention(model, layer: int, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The frozen model's attention of query rows `rows` over keys 0..T-1 of the sequence whose layer input
    is x [T, hidden], per query head: [H, R, T], zero after each row's position."""
    attn = model.layers[layer].attn
    mc = model.config
    groups, per_group, d = mc.num_kv_heads, mc.num_heads // mc.num_kv_heads, mc.head_dim
    cos, sin = model.rotary.cos_sin(torch.arange(x.shape[0]))
    q = apply_rope_half((x[rows] @ attn.q_proj.weight.T).view(-1, mc.num_heads, d), cos[rows], sin[rows])
    k = apply_rope_half((x @ attn.k_proj.weight.T).view(-1, groups, d), cos, sin)
    # Query head h reads KV head h // per_group: batch the matmul per KV head, never expanding K.
    qg = q.view(-1, groups, per_group, d).permute(1, 2, 0, 3).reshape(groups, -1, d)
    logits = torch.bmm(qg, k.permute(1, 2, 0)).view(mc.num_heads, len(rows), -1)
    logits.mul_(model.attention_scale)
    future = torch.arange(x.shape[0])[None, :] > rows[:, None]
    return logits.masked_fill_(future, float("-inf")).softmax(-1)


def reduce_heads(probs: torch.Tensor, reduce: str = "mean") -> torch.Tensor:
    """[H, R, T] -> [R, T]: the sum over heads L1-normalised (the mean), or with reduce="max" the largest
    head's probability per key, L1-normalised: a key one head attends to sharply weighs as much as a key
    all heads attend to."""
    if reduce == "max":
        top = probs.amax(0)
        return top / top.sum(-1, keepdim=True)
    return probs.mean(0)


def attention_target(model, layer: int, x: torch.Tensor, rows: torch.Tensor, reduce: str = "mean") -> torch.Tensor:
    """The training target: `head_attention` reduced over heads (`reduce_heads`), [R, T]."""
    return reduce_heads(head_attention(model, layer, x, rows), reduce)


def indexer_logits(indexer: LlamaIndexer, x: torch.Tensor, rows: torch.Tensor, cos, sin) -> torch.Tensor:
    """Index scores I [R, T] of query rows over all keys, a large negative number after each row's
    position (differentiable)."""
    cos, sin = cos[..., ::indexer.rope_stride], sin[..., ::indexer.rope_stride]
    q, w = indexer.queries(x[rows], cos[rows], sin[rows]), indexer.head_weights(x[rows])
    k = indexer.keys(x, cos, sin)
    per_head = torch.matmul(q, k.T).relu()  # [R, H, T]
    scores = torch.bmm(w.unsqueeze(1), per_head).squeeze(1)
    future = torch.arange(x.shape[0])[None, :] > rows[:, None]
    return scores.masked_fill(future, _MASKED)


def kl_loss(target: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(target || softmax(logits)); both [R, T], target 0 where logits are masked."""
    cross = -(target * logits.log_softmax(-1)).sum(-1)
    with torch.no_grad():
        neg_entropy = torch.xlogy(target, target).sum(-1)
    return (cross + neg_entropy).mean()


def topk_margin_loss(target: torch.Tensor, logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Mean over rows of the target mass expected outside the indexer's top_k: sum_s target[s] *
    softplus((I_k - I_s) / sigma), I_k the row's k-th largest score, sigma the spread of its valid scores.

    Why, next to the KL: decode only needs every key that matters to rank above the k-th, while the KL
    spends its effort matching the whole distribution, tail included. Induction and copy heads put nearly
    all of their mass on one key a few thousand positions back; in the KL that key is one term among
    thousands, but when it falls out of the top_k the layer's output for that head is lost (layer 18 of
    SmolLM2: 2% perplexity at 4k from a handful of such rows). The threshold I_k is not detached, so the
    term also pushes down the keys that crowd the important one out. Both [R, T]; target 0 where logits
    are masked (at most -1e29)."""
    valid = logits.detach() > -1e29
    count = valid.sum(-1, keepdim=True).clamp(min=1)
    scores = logits.detach().masked_fill(~valid, 0.0)
    mean = scores.sum(-1, keepdim=True) / count
    sigma = (((scores - mean) ** 2).masked_fill(~valid, 0.0).sum(-1, keepdim=True) / count).sqrt().clamp(min=1e-3)
    kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
    below = torch.nn.functional.softplus(((kth - logits) / sigma).clamp(max=50.0))
    return (target * below).sum(-1).mean()


def worst_head_miss(probs: torch.Tensor, scores: torch.Tensor, rows: torch.Tensor, top_k: int) -> float:
    """Mean over rows of the largest per-head attention mass (probs [H, R, T], `head_attention`) that the
    oracle's top_k (of the head mean) keeps and the indexer's (of scores [R, T]) loses, the newest position
    forced into both. The head-summed mass hides a head whose keys all fall out (an induction head reads
    one key); this is the figure that moved with perplexity when single layers were retrained."""
    heads = probs.shape[0]
    kept = probs.gather(2, _topk_with_newest(scores, rows, top_k).expand(heads, -1, -1)).sum(-1)
    best = probs.gather(2, _topk_with_newest(probs.mean(0), rows, top_k).expand(heads, -1, -1)).sum(-1)
    return float((best - kept).amax(0).mean())


def _topk_with_newest(scores: torch.Tensor, rows: torch.Tensor, top_k: int) -> torch.Tensor:
    """Indices [R, top_k] of each row's top_k scores with the row's own position forced in, as decode does."""
    scores = scores.clone()
    scores[torch.arange(len(rows)), rows] = float("inf")
    return scores.topk(top_k, dim=-1).indices


def topk_mass(target: torch.Tensor, scores: torch.Tensor, rows: torch.Tensor, top_k: int) -> tuple[float, float]:
    """(indexer mass, oracle mass): mean over rows of the target mass inside the indexer's top_k (newest
    position forced in, as decode does) and inside the target's own top_k."""
    mass = target.gather(1, _topk_with_newest(scores, rows, top_k)).sum(-1)
    oracle = target.topk(top_k, dim=-1).values.sum(-1)
    return float(mass.mean()), float(oracle.mean())


def _sample_rows(generator: torch.Generator, length: int, n: int, min_row: int) -> torch.Tensor:
    return torch.randperm(length - min_row, generator=generator)[:n].sort().values + min_row


def _retrieval_rows(generator: torch.Generator, length: int, n: int, min_row: int, answer_rows: int) -> torch.Tensor:
    """The rows whose next token is copied from the needle (the last `answer_rows` + 1 positions but the
    last), repeated to about a quarter of `n`, plus random rows for the rest."""
    forced = torch.arange(length - 1 - answer_rows, length - 1)
    repeats = max(1, n // (4 * answer_rows))
    rest = _sample_rows(generator, length, max(n - repeats * answer_rows, 0), min_row)
    return torch.cat([rest, forced.repeat(repeats)]).sort().values


def _chunks(tokens: list[int], seq_len: int) -> list[torch.Tensor]:
    return [torch.tensor(tokens[i:i + seq_len]) for i in range(0, len(tokens) - seq_len + 1, seq_len)]


def capture_to_memmap(model, chunks: list[torch.Tensor], folder: Path, name: str, needed: int) -> np.memmap:
    """Capture the layer inputs of the first `needed` chunks into <folder>/<name>.f16, a store sized for
    all of them; what an earlier (interrupted or smaller) run captured is kept."""
    mc = model.config
    shape = (len(chunks), mc.num_layers, chunks[0].shape[0], mc.hidden_size)
    path, done = folder / f"{name}.f16", folder / f"{name}.done.json"
    start = 0
    if path.exists() and done.exists() and json.loads(done.read_text()).get("shape") == list(shape):
        start = json.loads(done.read_text())["chunks"]
    store = np.memmap(path, dtype=np.float16, mode="r+" if start else "w+", shape=shape)
    for i in tqdm(range(start, needed), desc=f"capture {name}", initial=min(start, needed), total=needed):
        store[i] = capture_attention_inputs(model, chunks[i]).numpy().astype(np.float16)
        store.flush()
        done.write_text(json.dumps({"shape": list(shape), "chunks": i + 1}))
    return store


def evaluate(model, indexers, store: np.memmap, rows_per_layer: int, top_k: int, min_row: int,
             layers: list[int]) -> list[dict]:
    """Held-out recall of `layers` on the first held-out chunk, on evenly spaced query rows."""
    t = store.shape[2]
    rows = torch.linspace(min_row, t - 1, rows_per_layer).long()
    cos, sin = model.rotary.cos_sin(torch.arange(t))
    out = []
    with torch.no_grad():
        for layer in layers:
            indexer = indexers[layer]
            x = torch.from_numpy(np.asarray(store[0, layer])).float()
            probs = head_attention(model, layer, x, rows)
            target = reduce_heads(probs)
            logits = indexer_logits(indexer, x, rows, cos, sin)
            mass, oracle = topk_mass(target, logits, rows, top_k)
            out.append({"layer": layer, "kl": float(kl_loss(target, logits)), "mass": mass, "oracle": oracle,
                        "worst_head_miss": worst_head_miss(probs, logits, rows, top_k)})
    return out


@functools.lru_cache(maxsize=1)
def _model_files():
    """The default model's file, opened once per process: its config checks the flags, then its tokenizer and
    weights come from the same reader."""
    from hisparse.models.loader import open_model

    return open_model(None)


@functools.lru_cache(maxsize=1)
def _frozen_model():
    """The default model without indexers (each run attaches fresh ones), loaded once per process."""
    from hisparse.models.loader import load_llama

    return load_llama(_model_files(), indexer=False)


def _tokenizer():
    """The default model's tokenizer (before the model: it checks the flags)."""
    return _model_files().tokenizer()


PROG = "python -m hisparse.train_indexer"
# Caps on flags the model does not bound; far above any useful run, they stop runs that could never end or
# would fill the disk (each retrieval sequence is one more chunk captured to <out>).
MAX_EPOCHS = 1000
MAX_RETRIEVAL_CHUNKS = 100
MAX_HEADS = 64
MAX_HEAD_DIM = 256
MAX_THREADS = 1024


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=output_dir, default="runs/indexer",
                   help="run folder (captures, checkpoint, log), created if missing")
    p.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint.pt")
    p.add_argument("--export", type=output_file, default=None,
                   help="where to write the final bf16 safetensors (default <out>/smollm2_indexer.safetensors)")
    p.add_argument("--epochs", type=int_in(1, MAX_EPOCHS), default=12, help=f"at most {MAX_EPOCHS}")
    p.add_argument("--seq-len", type=positive_int, default=2048,
                   help="tokens per training chunk (positions 0..seq_len-1; at most the model's context)")
    p.add_argument("--queries", type=positive_int, default=512,
                   help="query rows per chunk and layer, drawn each epoch (all rows from --min-row on when fewer)")
    p.add_argument("--min-row", type=int_in(0), default=64,
                   help="query rows are drawn from positions >= this (below --seq-len)")
    p.add_argument("--lr", type=positive_float, default=3e-3, help="peak Adam learning rate (cosine decay to 5%%)")
    p.add_argument("--heads", type=int_in(1, MAX_HEADS), default=4, help=f"at most {MAX_HEADS}")
    p.add_argument("--head-dim", type=int_in(1, MAX_HEAD_DIM), default=64, help=f"at most {MAX_HEAD_DIM}")
    p.add_argument("--rope-dim", type=positive_int, default=32,
                   help="even, dividing the model's head dim, at most --head-dim")
    p.add_argument("--top-k", type=positive_int, default=256,
                   help="the top_k stored in the weights and used for recall (below --seq-len)")
    p.add_argument("--layers", type=comma_list(int_in(0)), default=None,
                   help="train only these layers, e.g. '0,5,29' (pilots)")
    p.add_argument("--max-chunks", type=positive_int, default=None,
                   help="use only the first N training chunks (pilots; default all)")
    p.add_argument("--init", type=existing_file, default=None,
                   help="start from these indexer weights (e.g. to train some --layers further)")
    p.add_argument("--capture-only", action="store_true", help="stop after capturing the layer inputs")
    p.add_argument("--stop-after", type=positive_int, default=None,
                   help="end this invocation after N epochs (checkpointed; continue with --resume)")
    p.add_argument("--target", choices=["mean", "max"], default="mean",
                   help="head reduction of the attention target: DSA's sum (mean) or the per-key max over heads")
    p.add_argument("--loss", choices=["kl", "kl+topk"], default="kl",
                   help="DSA's KL alone, or plus the top-k margin term (topk_margin_loss) weighted by --topk-weight")
    p.add_argument("--topk-weight", type=float_in(0), default=1.0)
    p.add_argument("--retrieval-chunks", type=int_in(0, MAX_RETRIEVAL_CHUNKS), default=0,
                   help=f"extra passkey-style training sequences built from the training text (see above; at most "
                        f"{MAX_RETRIEVAL_CHUNKS})")
    p.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0)
    p.add_argument("--threads", type=int_in(1, MAX_THREADS), default=2)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def check_args(args: argparse.Namespace, config) -> None:
    """Refuse, from the model's config alone, what would fail only after the minutes-long capture."""
    if args.seq_len > config.max_position_embeddings:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the model's context of {config.max_position_embeddings}")
    for flag, value, why in (("--top-k", args.top_k, "the held-out recall ranks rows from position top_k on"),
                             ("--min-row", args.min_row, "query rows are drawn from it to the chunk's end")):
        if value >= args.seq_len:
            raise ValueError(f"{flag} {value} must be below --seq-len {args.seq_len}: {why}")
    if args.layers and max(args.layers) >= config.num_layers:
        raise ValueError(f"--layers: layer {max(args.layers)} does not exist; the model has layers "
                         f"0..{config.num_layers - 1}")
    if args.rope_dim % 2 or config.head_dim % args.rope_dim or args.rope_dim > args.head_dim:
        raise ValueError(f"--rope-dim {args.rope_dim} must be even, divide the model's head dim ({config.head_dim}) "
                         f"and be at most --head-dim ({args.head_dim})")
    try:
        output_file(str(args.export or args.out / "smollm2_indexer.safetensors"))
    except argparse.ArgumentTypeError as error:
        raise ValueError(f"--export: {error}") from None
    if args.init is not None:
        try:
            check_indexer_weights(args.init, config.num_layers)
        except ValueError as error:
            raise ValueError(f"--init {error}") from None


def _weights_history(path: Path) -> list[dict]:
    """Every run that shaped the weights in `path`, oldest first (its `history` or `trained_with` metadata)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        metadata = f.metadata() or {}
    history = json.loads(metadata.get("history", "[]"))
    return history or ([json.loads(metadata["trained_with"])] if "trained_with" in metadata else [])


def main(argv=None) -> list[dict]:
    """Returns one summary per epoch run by this invocation (train loss, held-out KL, top-k mass, worst-head
    miss)."""
    from hisparse.data.pydoc_corpus import corpus_tokens

    args = parse_args(argv)
    check_args(args, _model_files().config)
    history = [] if args.init is None else _weights_history(args.init)  # every run that shaped these weights
    tokenizer = _tokenizer()
    retrieval_made = []
    if args.retrieval_chunks:  # built before any work: a --seq-len too short for a passkey sequence fails here
        from hisparse.data.retrieval_sequences import retrieval_sequence

        rng = np.random.default_rng(args.seed + 7919)
        filler = corpus_tokens(tokenizer, "train")
        try:
            retrieval_made = [retrieval_sequence(tokenizer, filler, args.seq_len, rng)
                              for _ in range(args.retrieval_chunks)]
        except ValueError as error:
            raise ValueError(f"--seq-len {args.seq_len} is too short for --retrieval-chunks: {error}") from None
    torch.set_num_threads(args.threads)
    log = (args.out / "train.log").open("a")

    def say(message: str) -> None:
        tqdm.write(message)
        log.write(message + "\n")
        log.flush()

    model = _frozen_model()
    train_chunks = _chunks(corpus_tokens(tokenizer, "train"), args.seq_len)
    heldout_chunks = _chunks(corpus_tokens(tokenizer, "heldout"), args.seq_len)[:1]
    n_chunks = min(args.max_chunks or len(train_chunks), len(train_chunks))  # None: all of them
    say(f"train: {n_chunks} of {len(train_chunks)} chunks of {args.seq_len} tokens; held-out eval: 1 chunk")
    started = time.perf_counter()
    train_store = capture_to_memmap(model, train_chunks, args.out, f"train_{args.seq_len}", n_chunks)
    retrieval_store, answer_rows = None, []
    if retrieval_made:
        answer_rows = [n for _, n in retrieval_made]
        retrieval_store = capture_to_memmap(model, [torch.tensor(ids) for ids, _ in retrieval_made], args.out,
                                            f"retrieval_{args.seq_len}_seed{args.seed}", len(retrieval_made))
    heldout_store = capture_to_memmap(model, heldout_chunks, args.out, f"heldout_{args.seq_len}", 1)
    say(f"capture: {time.perf_counter() - started:.0f} s")
    if args.capture_only:
        return []

    config = IndexerConfig(args.heads, args.head_dim, args.rope_dim, args.top_k)
    torch.manual_seed(args.seed)
    indexers = attach_indexers(model, config)
    if args.init is not None:
        config = load_indexer_weights(model, args.init)
        indexers = [layer.attn.indexer.requires_grad_(True).train() for layer in model.layers]
    layers = list(range(len(indexers))) if args.layers is None else args.layers
    params = [p for i in layers for p in indexers[i].parameters()]
    optimizer = torch.optim.Adam(params, lr=args.lr)
    n_items = n_chunks + args.retrieval_chunks  # text chunks first, then retrieval sequences
    total_steps = args.epochs * n_items
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)))
    first_epoch = 0
    checkpoint = args.out / "checkpoint.pt"
    if args.resume and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        for indexer, sd in zip(indexers, state["indexers"], strict=True):
            indexer.load_state_dict(sd)
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        first_epoch = state["epoch"] + 1
        started -= state.get("seconds", 0.0)  # the epoch lines count the time of every invocation
        say(f"resumed after epoch {state['epoch']}")

    t = args.seq_len
    cos, sin = model.rotary.cos_sin(torch.arange(t))
    summaries = []
    last_epoch = args.epochs if args.stop_after is None else min(args.epochs, first_epoch + args.stop_after)
    for epoch in range(first_epoch, last_epoch):
        order = torch.randperm(n_items, generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
        bar = tqdm(order.tolist(), desc=f"epoch {epoch + 1}/{args.epochs}")
        losses = []
        for chunk in bar:
            gen = torch.Generator().manual_seed((args.seed * 1000 + epoch) * 100_000 + chunk)
            optimizer.zero_grad(set_to_none=True)
            chunk_loss = 0.0
            for layer in layers:
                if chunk < n_chunks:
                    rows = _sample_rows(gen, t, args.queries, args.min_row)
                    x = torch.from_numpy(np.asarray(train_store[chunk, layer])).float()
                else:
                    item = chunk - n_chunks
                    rows = _retrieval_rows(gen, t, args.queries, args.min_row, answer_rows[item])
                    x = torch.from_numpy(np.asarray(retrieval_store[item, layer])).float()
                target = attention_target(model, layer, x, rows, args.target)
                logits = indexer_logits(indexers[layer], x, rows, cos, sin)
                loss = kl_loss(target, logits)
                if args.loss == "kl+topk":
                    loss = loss + args.topk_weight * topk_margin_loss(target, logits, args.top_k)
                loss.backward()
                chunk_loss += loss.item()
            optimizer.step()
            schedule.step()
            losses.append(chunk_loss / len(layers))
            bar.set_postfix(loss=f"{np.mean(losses[-10:]):.3f}", lr=f"{schedule.get_last_lr()[0]:.2e}")
        report = evaluate(model, indexers, heldout_store, 256, args.top_k, args.top_k, layers)
        ratio = np.mean([r["mass"] / r["oracle"] for r in report])
        mass = np.mean([r["mass"] for r in report])
        worst = float(np.mean([r["worst_head_miss"] for r in report]))
        say(f"epoch {epoch + 1}: train loss {np.mean(losses):.4f} | held-out kl "
            f"{np.mean([r['kl'] for r in report]):.4f}, top-{args.top_k} mass {mass:.3f}"
            f" vs oracle {np.mean([r['oracle'] for r in report]):.3f} (ratio {ratio:.3f}), worst-head miss "
            f"{worst:.4f} | {time.perf_counter() - started:.0f} s")
        say("  per layer mass/oracle, worst-head miss: " + " ".join(
            f"{r['layer']}:{r['mass']:.2f}/{r['oracle']:.2f},{r['worst_head_miss']:.3f}" for r in report))
        summaries.append({"epoch": epoch + 1, "train_loss": float(np.mean(losses)),
                          "heldout_kl": float(np.mean([r["kl"] for r in report])), "mass_ratio": float(ratio),
                          "worst_head_miss": worst, "seconds": time.perf_counter() - started})
        torch.save({"indexers": [ix.state_dict() for ix in indexers], "optimizer": optimizer.state_dict(),
                    "schedule": schedule.state_dict(), "epoch": epoch, "args": vars(args),
                    "seconds": summaries[-1]["seconds"]}, checkpoint)
    if last_epoch < args.epochs:
        say(f"stopped after epoch {last_epoch}; continue with --resume")
        return summaries
    export = args.export or args.out / "smollm2_indexer.safetensors"
    trained_with = {k: str(v) for k, v in vars(args).items()}
    if args.layers is not None:
        trained_with["layers"] = ",".join(map(str, args.layers))  # as typed, like the other flags
    save_indexer_weights(export, indexers, config, extra={
        "trained_with": json.dumps(trained_with, sort_keys=True),
        "history": json.dumps([*history, trained_with], sort_keys=True)})
    say(f"wrote {export} after {time.perf_counter() - started:.0f} s")
    return summaries


if __name__ == "__main__":
    sys.exit(run_main(main, prog=PROG))
