"""`python -m repro.traces.import INPUT --out DIR`: a tabular routing trace (CSV, JSONL, Parquet) -> trace directory.

The work is done by repro.traces.tabular.import_table_to_dir (columns, validation, defaults, the streaming and
the external sort are described there): the file is read in batches of at most --batch-rows rows and the trace
written as it goes, so memory is bounded by --batch-rows whatever the file's size. On bad input this prints one
sentence naming the first bad row and exits with status 2; nothing is written. With surface-string tokens the
vocabulary built on import is saved as DIR/vocab.json (a JSON list: entry i is the string of token id i).

DIR must be new or an empty folder; a folder already holding a routing trace is replaced only with --overwrite
(atomically: readers see the old trace or the new one). Anything else there, and any DIR that holds the input
file, is refused before the input is read: the importer never deletes what is not a trace.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from repro import cli
from repro.errors import ReproError
from repro.traces.format import check_trace_destination, trace_dir_state
from repro.traces.tabular import DEFAULT_BATCH_ROWS, import_table_to_dir


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m repro.traces.import", description=__doc__.splitlines()[0])
    p.add_argument("input", type=Path, help="CSV, JSONL or Parquet file, one row per (request, position, layer)")
    p.add_argument("--out", type=Path, required=True, help="trace directory to write (new or empty)")
    p.add_argument("--overwrite", action="store_true", help="replace the routing trace already at --out")
    p.add_argument("--format", choices=["csv", "jsonl", "parquet"], help="default: from the file suffix")
    p.add_argument("--model", default="", help="model name for meta.model (default: 'imported')")
    p.add_argument("--num-experts", type=cli.positive, help="experts per layer (default: largest expert id + 1)")
    p.add_argument("--top-k", type=cli.positive, help="experts per token (default: the length of the first row's list)")
    p.add_argument("--vocab-size", type=cli.positive, help="tokenizer vocabulary size (default: largest token id + 1)")
    p.add_argument("--dataset", help="dataset name (default: the input file's stem)")
    p.add_argument("--tokenizer", default="", help="tokenizer the token ids come from, for meta.tokenizer")
    p.add_argument("--token-col", help="default: token_id if present (ids), else token (surface strings)")
    p.add_argument("--request-col", default="request_id")
    p.add_argument("--position-col", default="position")
    p.add_argument("--layer-col", default="layer")
    p.add_argument("--experts-col", default="experts")
    p.add_argument("--weights-col", help="default: weights if present")
    p.add_argument("--label-col", help="default: label if present")
    p.add_argument("--phase-col", help="prefill/decode per token; default: phase if present")
    p.add_argument("--prefill-len-col", help="prompt length per request; default: prefill_len if present")
    p.add_argument("--arrival-col", help="arrival time per request (seconds, requests in arrival order); "
                   "default: arrival_time if present")
    p.add_argument("--batch-rows", type=cli.positive, default=DEFAULT_BATCH_ROWS,
                   help=f"rows read and checked at once; bounds memory (default {DEFAULT_BATCH_ROWS:,})")
    return p


def check_out(out: Path, input_file: Path, if_exists: str) -> None:
    """Refuse, before any work, an --out that holds the input or that write_trace(if_exists) may not write."""
    if input_file.resolve().is_relative_to(out.resolve()):
        raise ReproError(
            f"--out {out} contains the input file {input_file}, which writing the trace there would delete; "
            "choose an --out folder outside it."
        )
    if trace_dir_state(out)[0] == "trace" and if_exists == "error":
        raise ReproError(f"--out {out} already holds a routing trace; pass --overwrite to replace it or choose another folder.")
    check_trace_destination(out, if_exists)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if_exists = "replace" if args.overwrite else "error"
    try:
        check_out(args.out, args.input, if_exists)
        result = import_table_to_dir(
            args.input,
            args.out,
            if_exists=if_exists,
            batch_rows=args.batch_rows,
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
            phase_col=args.phase_col,
            prefill_len_col=args.prefill_len_col,
            arrival_col=args.arrival_col,
        )
    except ReproError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    m, vocab = result.meta, result.vocab
    for name in m.extra.get("inferred", []):
        print(f"note: --{name.replace('_', '-')} not given; using {getattr(m, name)} from the data.", file=sys.stderr)
    print(
        f"wrote {args.out}: {result.num_requests} requests, {result.num_tokens} tokens, layers {list(m.layer_ids)}, "
        f"{m.num_experts} experts, top-{m.top_k}" + (f", vocabulary of {len(vocab)} strings in vocab.json" if vocab else "")
        + ("" if result.sorted_input else " (rows were not in (request, position, layer) order: sorted on disk)")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
