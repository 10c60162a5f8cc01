"""``memtoc verify [RUN_DIR] [--published] [--json]``: the run's claims (:mod:`memtoc.stages.report.claims`) and the
published paper's derivable numbers (:mod:`memtoc.stages.report.published`), re-derived and diffed."""
from __future__ import annotations

import argparse
import json

from memtoc.stages.report import claims, published


def cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="memtoc verify", description=
                                 "Re-derive every claim of a run's report from its files (and/or the "
                                 "published paper's numbers from the release data).")
    ap.add_argument("run_dir", nargs="?", help="run directory, e.g. outputs/default")
    ap.add_argument("--published", action="store_true",
                    help="also (or, without RUN_DIR, only) check the published paper's derivable numbers")
    ap.add_argument("--release", default=None, help="release directory, compact or official layout "
                    "(default: $MEMTOC_RELEASE, then ../shared/memtoc-release)")
    ap.add_argument("--registry", default=None, help="claim registry (default paper/claims.yaml)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args(argv)
    if not args.run_dir and not args.published:
        ap.error("give RUN_DIR (e.g. outputs/default) and/or --published")
    results = []
    if args.run_dir:
        results.append(claims.verify(args.run_dir, registry=args.registry))
    if args.published:
        results.append(published.verify_published(args.release, args.registry))
    if args.json:       # --published alone: one object {"checks": [...], "summary": {...}}
        doc = results[0].to_dict() if (args.published and not args.run_dir) else [r.to_dict() for r in results]
        print(json.dumps(doc, indent=1, ensure_ascii=False))
    else:
        for r in results:
            print(f"== {'run ' + r.target if r.kind == 'run' else f'published paper vs {r.target} ({r.layout} layout)'}")
            print(r.table())
            print(r.summary())
    return 0 if all(r.ok for r in results) else 1
