"""Record and inspect top-k trace files (`hisparse.engine.topk_trace` says what a trace holds).

    python -m hisparse.tools.topk_trace record --length 4096 --max-tokens 64 --out trace.npz
    python -m hisparse.tools.topk_trace show trace.npz

`record` decodes greedily with the default model and its shipped indexers (held-out Python-documentation
text by default, or `--prompt-file`).
"""

from __future__ import annotations

import argparse
import sys
import time
import zipfile
from pathlib import Path

from hisparse.cli_args import OneLineParser, existing_file, output_file, positive_int, run_main
from hisparse.engine.topk_trace import TopkTrace, load_topk_trace, save_topk_trace, trace_from_request


def record(prompt_ids: list[int], max_tokens: int, out: str | Path, **engine_args) -> TopkTrace:
    """Greedy-decode `max_tokens` tokens after `prompt_ids` with the real engine, recording the top-k."""
    from hisparse.engine.engine_config import EngineConfig
    from hisparse.engine.llm_engine import LLMEngine
    from hisparse.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(**engine_args))
    if engine.cache.sparse is None:
        raise ValueError("the model has no lightning indexer: there is no top-k to record")
    request = engine.add_request(prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                            ignore_eos=True), record_topk=True)
    while not request.finished:
        engine.step()
    trace = trace_from_request(request, engine.cache.sparse)
    save_topk_trace(out, trace)
    return trace


PROG = "python -m hisparse.tools.topk_trace"


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    rec = sub.add_parser("record", help="decode with the real model and record the selected positions")
    rec.add_argument("--prompt-file", type=existing_file, help="prompt text (default: held-out Python documentation)")
    rec.add_argument("--length", type=positive_int, default=4096,
                     help="prompt tokens (the text is cut or repeated; with --max-tokens, at most the model's context)")
    rec.add_argument("--max-tokens", type=positive_int, default=64, help="decode steps to record")
    rec.add_argument("--top-k", type=positive_int, default=256, help="at most the model's context")
    rec.add_argument("--dense", action="store_true", help="decode densely (record what the indexer would pick)")
    rec.add_argument("--out", type=output_file, required=True)
    show = sub.add_parser("show", help="summarise a trace file")
    show.add_argument("path", type=existing_file)
    args = parser.parse_args(argv)

    if args.command == "show":
        try:
            trace = load_topk_trace(args.path)
        except (KeyError, EOFError, ValueError, TypeError, zipfile.BadZipFile) as error:
            # an .npz of other arrays, an .npy (no archive to open), text, a cut file
            raise ValueError(f"{args.path}: not a top-k trace file ({str(error).splitlines()[0]})") from None
        print(f"{args.path}: {trace.num_layers} layers, {trace.num_steps} steps, top_k {trace.top_k}, "
              f"prompt {trace.prompt_len}, seq_len {trace.seq_lens.min()}..{trace.seq_lens.max()}, "
              f"dense layers {list(trace.dense_layers)}, sparse {trace.sparse_attention}")
        return
    from hisparse.models.loader import open_model

    files = open_model(None)
    context = files.config.max_position_embeddings
    if args.length + args.max_tokens > context:
        rec.error(f"--length + --max-tokens is {args.length + args.max_tokens}, beyond the model's context of "
                  f"{context} tokens")
    if args.top_k > context:
        rec.error(f"--top-k {args.top_k} is beyond the model's context of {context} tokens")
    from hisparse.data.pydoc_corpus import heldout_tokens

    tokenizer = files.tokenizer()
    if args.prompt_file is not None:
        ids = tokenizer.encode(args.prompt_file.read_text())
        if not ids:  # repeating nothing would never reach --length
            raise ValueError(f"--prompt-file {args.prompt_file}: the text has no tokens")
        while len(ids) < args.length:
            ids = ids + ids
        ids = ids[:args.length]
    else:
        ids = heldout_tokens(tokenizer, args.length)
    started = time.perf_counter()
    trace = record(ids, args.max_tokens, args.out, top_k=args.top_k, sparse_attention=not args.dense,
                   chunked_prefill_size=1024)
    print(f"wrote {args.out}: {trace.num_layers} layers x {trace.num_steps} steps x top_k {trace.top_k} "
          f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    sys.exit(run_main(main, prog=PROG))
