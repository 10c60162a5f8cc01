"""``memtoc run PARAMS.yaml [--only NB ...] [--set K=V] [--list] [--dry-run]``: the command line of
:mod:`memtoc.run.pipeline` (and of :mod:`memtoc.run.dryrun`, which builds on the pipeline's plan)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from memtoc.config.params import load_params
from memtoc.config.runconfig import RunConfig
from memtoc.run import pipeline
from memtoc.run.dryrun import dry_run, dry_run_json
from memtoc.run.servers import server_report


def cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="memtoc run", description=pipeline.__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("params", help="parameter file, e.g. params/default.yaml")
    ap.add_argument("--only", nargs="+", action="extend", metavar="NB",
                    help="run only these notebooks (stem like 03_evaluation, or number like 03)")
    ap.add_argument("--set", dest="sets", action="append", metavar="KEY=VALUE",
                    help="override a parameter (YAML value; dotted keys for mappings), repeatable")
    ap.add_argument("--list", action="store_true", help="print the plan and exit without running")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the plan with request counts and GPU memory / time estimates; loads no weights")
    ap.add_argument("--release", default=None, metavar="DIR",
                    help="the MemToC release folder (either layout); first in the resolution order (docs/data.md)")
    ap.add_argument("--json", action="store_true",
                    help="with --dry-run: one JSON object (stages, requests, seconds, GPU memory) instead of text")
    ap.add_argument("--log-output", action="store_true", help="stream the notebooks' output to the terminal")
    a = ap.parse_args(argv)
    overrides = pipeline.parse_set(a.sets)
    if a.release:
        overrides["release_dir"] = str(Path(a.release).expanduser().resolve())
    if overrides:   # a bad block value names the file when the file has it, --set when only --set does
        RunConfig.of(load_params(a.params), a.params)
        cfg = RunConfig.of(load_params(a.params, overrides=overrides), f"--set (over {a.params})")
    else:
        cfg = RunConfig.load(a.params)
    if a.list:
        for s in pipeline.plan(cfg, a.only):
            print(f"{s.name:<24} {'run' if s.run else 'skip: ' + s.reason}")
        st = pipeline.effective_status(cfg.run_dir)
        print(f"run directory {cfg.run_dir}: " + (f"last run {st}" if st else "no run yet"))
        return 0
    if a.dry_run and a.json:
        plan = dry_run_json(cfg, a.only, source=a.params)
        plan["servers"] = server_report(cfg)
        print(json.dumps(plan, indent=1))
        return 0
    if a.dry_run:
        print(dry_run(cfg, a.only, source=a.params))
        for line in server_report(cfg):
            print(line)
        return 0
    try:
        pipeline.run(cfg, a.only, log_output=a.log_output, source=a.params)
    except KeyboardInterrupt:
        return 130
    return 0
