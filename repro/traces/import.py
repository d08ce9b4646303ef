"""`python -m repro.traces.import INPUT --out DIR`: a tabular routing trace (CSV, JSONL, Parquet) -> trace directory.

The work is done by repro.traces.tabular.import_table_with_vocab (columns, validation, defaults are described
there). On bad input this prints one sentence naming the first bad row and exits with status 2; nothing is
written. With surface-string tokens the vocabulary built on import is saved as DIR/vocab.json (a JSON list:
entry i is the string of token id i).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from repro.atomic import atomic_write_text
from repro.errors import ReproError
from repro.traces.format import write_trace
from repro.traces.tabular import import_table_with_vocab


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m repro.traces.import", description=__doc__.splitlines()[0])
    p.add_argument("input", type=Path, help="CSV, JSONL or Parquet file, one row per (request, position, layer)")
    p.add_argument("--out", type=Path, required=True, help="trace directory to write (replaced if it exists)")
    p.add_argument("--format", choices=["csv", "jsonl", "parquet"], help="default: from the file suffix")
    p.add_argument("--model", default="", help="model name for meta.model (default: 'imported')")
    p.add_argument("--num-experts", type=int, help="experts per layer (default: largest expert id + 1)")
    p.add_argument("--top-k", type=int, help="experts per token (default: the length of the first row's list)")
    p.add_argument("--vocab-size", type=int, help="tokenizer vocabulary size (default: largest token id + 1)")
    p.add_argument("--dataset", help="dataset name (default: the input file's stem)")
    p.add_argument("--tokenizer", default="", help="tokenizer the token ids come from, for meta.tokenizer")
    p.add_argument("--token-col", help="default: token_id if present (ids), else token (surface strings)")
    p.add_argument("--request-col", default="request_id")
    p.add_argument("--position-col", default="position")
    p.add_argument("--layer-col", default="layer")
    p.add_argument("--experts-col", default="experts")
    p.add_argument("--weights-col", help="default: weights if present")
    p.add_argument("--label-col", help="default: label if present")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        trace, vocab = import_table_with_vocab(
            args.input,
            format=args.format,
            model=args.model,
            num_experts=args.num_experts,
            top_k=args.top_k,
            vocab_size=args.vocab_size,
            dataset=args.dataset,
            tokenizer=args.tokenizer,
            token_col=args.token_col,
            request_col=args.request_col,
            position_col=args.position_col,
            layer_col=args.layer_col,
            experts_col=args.experts_col,
            weights_col=args.weights_col,
            label_col=args.label_col,
        )
        write_trace(trace, args.out)
        if vocab is not None:
            atomic_write_text(args.out / "vocab.json", json.dumps(vocab, ensure_ascii=False))
    except ReproError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    m = trace.meta
    for name in m.extra.get("inferred", []):
        print(f"note: --{name.replace('_', '-')} not given; using {getattr(m, name)} from the data.", file=sys.stderr)
    print(
        f"wrote {args.out}: {trace.num_requests} requests, {trace.num_tokens} tokens, layers {list(m.layer_ids)}, "
        f"{m.num_experts} experts, top-{m.top_k}" + (f", vocabulary of {len(vocab)} strings in vocab.json" if vocab else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
