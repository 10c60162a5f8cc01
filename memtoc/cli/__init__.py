"""`memtoc` command line: thin dispatch to the module that owns each stage.

Each subcommand lives in its stage's module as ``cli(argv: list[str]) -> int`` so that the
parsing sits next to the code it drives. Errors derived from MemtocError, and operating-system
errors (a full or read-only disk), print one clear line (no traceback) and exit with status 2.
"""
from __future__ import annotations

import importlib
import sys

from memtoc.core.errors import MemtocError
from memtoc.generation.hardware import passive_openmp_waits

passive_openmp_waits()   # before a command imports torch

COMMANDS = {
    "run": ("memtoc.cli.run", "execute the numbered notebooks with papermill: memtoc run PARAMS.yaml "
                               "[--only NB] [--set K=V] [--list] [--dry-run]"),
    "benchmark": ("memtoc.data.benchmark", "print benchmark and episode counts: memtoc benchmark [--release DIR] [--json]"),
    "score": ("memtoc.core.scoring", "re-score replies offline: memtoc score IN.jsonl [-o OUT] [--matcher paper|strict]"),
    "model": ("memtoc.generation.models", "model registry: memtoc model prepare NAME | memtoc model list"),
    "bench": ("memtoc.run.bench", "speed benchmarks: memtoc bench generation|stats [--json]"),
    "gpucheck": ("memtoc.run.gpucheck", "check the transformers path on this GPU (tiny random models + an 8B DPO step): memtoc gpucheck [--tiny]; "
                                    "which GPU lock fits: memtoc gpucheck --env"),
    "merge": ("memtoc.run.merge", "one run from runs that each ran some models (one per GPU): memtoc merge OUT RUN_A RUN_B ..."),
    "export": ("memtoc.run.export", "a run's scored replies as a dataset (Parquet + card): memtoc export RUN_DIR OUT"),
    "import-inspect": ("memtoc.run.inspect_import", "an Inspect log of the memtoc task as a run directory (01-03 "
                                                    "summaries, report): memtoc import-inspect LOG RUN_DIR"),
    "verify": ("memtoc.cli.verify", "re-derive every claim of a run: memtoc verify RUN_DIR"),
    "transfer": ("memtoc.stages.transfer", "external MC set: memtoc transfer validate|import|score|builtin ..."),
    "init": ("memtoc.cli.init", "make a project folder (notebooks, params, paper) for an installed memtoc: memtoc init DIR"),
    "data": ("memtoc.data.fetch", "the benchmark release: memtoc data fetch [--source URL|PATH] [--dest DIR] "
                                 "[--force] | memtoc data where"),
}


def _usage() -> str:
    lines = ["usage: memtoc COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"memtoc: unknown command {cmd!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[cmd][0])
    try:
        return int(module.cli(rest) or 0)
    except MemtocError as e:
        print(f"memtoc {cmd}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a disk that is full or read-only, a path that is a folder: one line too
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        print(f"memtoc {cmd}: error: {e.strerror or e}{where}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
