"""Transfer beyond MemToC (notebook 06): an external multiple-choice counterfactual set, forward and
reverse transfer. ``data`` (format, validation, import, the built-in plumbing set), ``matcher``
(multiple-choice matcher, ``memtoc transfer score``), ``core`` (episodes, metrics, the stage),
``tables`` (tables and the figure); the ``transfer`` block: ``memtoc.config.blocks.TransferConfig``.

    memtoc transfer validate FILE
    memtoc transfer import --counterfactual CF --arc ARC [--unanswerable UN] -o OUT.jsonl
    memtoc transfer import --hub [--cache-dir DIR] [--revision ROLE=REV ...] -o OUT.jsonl   # or --from-dir DIR
    memtoc transfer score IN.jsonl -o OUT.jsonl
    memtoc transfer builtin [-o OUT.jsonl]          # path of (or a copy of) the built-in set
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys

from memtoc.stages.transfer.core import (
    METRICS,
    TransferConfig,
    TransferEpisode,
    TransferError,
    build_episodes,
    check_no_memtoc_leak,
    metric_units,
    read_summary,
    reverse_examples,
    run,
    score_replies,
    select_items,
)
from memtoc.stages.transfer.data import (
    PLUMBING_NOTE,
    TransferDataError,
    TransferItem,
    builtin_path,
    import_faitheval,
    load_items,
    validate_file,
    validate_lines,
    write_items,
)
from memtoc.stages.transfer.hub import HUB_SOURCES, add_hub_arguments, import_hub, import_hub_cli
from memtoc.stages.transfer.source import load as load_dataset
from memtoc.stages.transfer.matcher import ABSTAIN, ChoiceMatch, match_choice, score_cli, score_lines, score_record
from memtoc.stages.transfer.tables import forward_table, plot, published_table, rates_table, reverse_table

USAGE = __doc__


def _validate_cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="memtoc transfer validate",
                                 description="Check a transfer JSONL file; each error names file:line:field.")
    ap.add_argument("file")
    a = ap.parse_args(argv)
    v = validate_file(a.file)
    for e in v.errors:
        print(e, file=sys.stderr)
    cf = sum(i.kind == "counterfactual" for i in v.items)
    print(f"memtoc transfer validate: {a.file}: {len(v.items)} valid rows ({cf} counterfactual, "
          f"{len(v.items) - cf} unanswerable), {len(v.errors)} error(s)", file=sys.stderr)
    return 0 if v.ok else 1


def _import_cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="memtoc transfer import",
        description="Build a transfer JSONL file from local copies of FaithEval counterfactual (+ ARC-Challenge "
                    "for the world-true key) and/or FaithEval unanswerable (.jsonl, .json or .parquet). Rows "
                    "that fail validation (e.g. answerKey not among the choice labels) are reported and left out.")
    ap.add_argument("--counterfactual", help="FaithEval-counterfactual file (id, question, choices, answerKey, context)")
    ap.add_argument("--arc", help="ARC-Challenge file (HF or AI2 layout) with the world-true answerKey")
    ap.add_argument("--unanswerable", help="FaithEval-unanswerable file (qid/id, question, context, answers)")
    ap.add_argument("--verified-ids", help="optional text file: ids of human-verified rows, one a line")
    ap.add_argument("-o", "--output", required=True)
    add_hub_arguments(ap)
    a = ap.parse_args(argv)
    if a.hub or a.from_dir:
        return import_hub_cli(a)
    if not a.counterfactual and not a.unanswerable:
        raise TransferDataError("give --counterfactual (with --arc) and/or --unanswerable, or --hub / --from-dir DIR")
    ver = []
    if a.verified_ids:
        with open(a.verified_ids, encoding="utf-8") as fh:
            ver = [ln.strip() for ln in fh if ln.strip()]
    rows, notes = import_faitheval(a.counterfactual, a.arc, a.unanswerable, ver)
    v = validate_lines([json.dumps(r, ensure_ascii=False) for r in rows], "<imported>")
    for n in notes + v.errors:
        print(f"memtoc transfer import: left out: {n}", file=sys.stderr)
    write_items(v.items, a.output)
    print(f"memtoc transfer import: {len(v.items)} rows -> {a.output} ({len(notes) + len(v.errors)} left out)",
          file=sys.stderr)
    return 0


def _builtin_cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="memtoc transfer builtin", description=PLUMBING_NOTE)
    ap.add_argument("-o", "--output", help="copy the built-in set here (default: print its path)")
    a = ap.parse_args(argv)
    if a.output:
        shutil.copyfile(builtin_path(), a.output)
    print(a.output or builtin_path())
    return 0


SUBCOMMANDS = {"validate": _validate_cli, "import": _import_cli, "score": score_cli, "builtin": _builtin_cli}


def cli(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if argv[0] not in SUBCOMMANDS:
        print(f"memtoc transfer: unknown subcommand {argv[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    return SUBCOMMANDS[argv[0]](argv[1:])
