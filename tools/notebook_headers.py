"""Write the standard "about" block (what the notebook reproduces, reads, writes, how long it takes,
how to run it) into the first cell of each numbered notebook, below its title and description.

    python tools/notebook_headers.py            # rewrites notebooks/NN_*.ipynb in place (idempotent)

The block sits between two marker lines, so a rerun replaces it instead of adding another.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- about: start -->", "<!-- about: end -->"

ABOUT = {
    "01": ("Section 3.2 and App. B: the construction counts (575 questions, 542 analysed, 33 excluded, "
           "39 repaired, 309 chains), the blinded review's repairs, the cross-fitting folds",
           "the MemToC release (`memtoc data where`)",
           "`episodes/<formulation>.jsonl`, `summaries/construction.json`",
           "a few seconds", "a few seconds"),
    "02": ("the closed-book answers m behind every table (memory correctness per model and formulation)",
           "`episodes/`", "`generations/<model>/closed_book_*`, `scored/<model>/closed_book_*.jsonl`, "
           "`summaries/elicitation.json`, `figures/elicitation_cells.png`",
           "~5 min", "~8 min for the five models"),
    "03": ("Table 1 (original-checkpoint rows), Table 4 (Reference formulation, prompting strategies), the "
           "prompting, distractor-distance, presentation-frame and protocol-sentence contrasts, formulation "
           "stability, base vs instruction-tuned (App. E)",
           "`episodes/`, 02's closed-book answers",
           "`generations/`, `scored/<model>/<arm>.jsonl`, `summaries/evaluation.json`, `figures/*.png`",
           "~13 min", "~1.5 h for the five models (plus the judged layer)"),
    "04": ("Table 1 (SFT and DPO rows as paired changes) and the fine-tuning success criterion",
           "`episodes/`, 02/03's replies of the untreated model",
           "`adapters/<model>/<objective>/fold<k>/`, `summaries/finetuning.json`, `figures/finetuning_*.png`",
           "~4 min (2 training steps per adapter: a pipeline check)", "~2.5 h for the four instruction-tuned models"),
    "05": ("App. H (Table 8, the Jacobian-lens availability probe) and App. C (SAE steering)",
           "02/03's outputs of the same run",
           "`probes/<model>/`, `summaries/probes.json`, `figures/probes_*.png`",
           "~2 min", "~5 h per 8B model (the exact lens fit dominates; published lenses named in `probes.lens_files` skip it)"),
    "06": ("App. F.1 (Table 6): transfer to an external counterfactual set, and reverse transfer",
           "04's adapters, 03's replies, the external set (`transfer.dataset`; default: a built-in plumbing set)",
           "`transfer/<model>/`, `summaries/transfer.json`, `figures/transfer_deltas.png`",
           "~2 min", "minutes per model"),
    "07": ("App. G (Table 7): tool-choice protocols in an executed agent loop",
           "02's closed-book answers (the memory-right slice)",
           "`agent/<model>/traces.jsonl`, `summaries/agent.json`, `figures/agent_agreement_execution.png`",
           "~2 min", "~3 h per model at most (the dry run's bound over all 542 questions)"),
    "08": ("the run's report: every table and figure above, each number resolved from its file",
           "every summary of the run, `paper/claims.yaml`", "`paper/report.md`, `paper/claims.json`",
           "seconds", "seconds"),
    "09": ("the verification: every claim of the report re-derived from its file, and the paper's printed "
           "numbers (`paper/published/`) compared with the release",
           "`paper/claims.json`, the summaries, the release", "nothing (it raises on any failure)",
           "seconds", "seconds"),
}


#: the notebooks that run models (a GPU for the paper's): their block says how to start on Colab
GPU_NOTEBOOKS = ("02", "03", "04", "05", "06", "07")
COLAB = ("**On Colab:** open `notebooks/colab_setup.ipynb` first (it installs memtoc and the lock for the "
         "runtime's GPU, makes the project folder on Drive and fetches the data), then run `!memtoc run "
         "params/paper.yaml` from the project folder it prints (`--only` with {nn} and the notebooks before it; "
         "docs/gpu.md).")


def block(nn: str, stem: str) -> str:
    what, reads, writes, t_default, t_paper = ABOUT[nn]
    colab = [COLAB.format(nn=nn) + "  "] if nn in GPU_NOTEBOOKS else []
    return "\n".join([
        START,
        f"**Reproduces:** {what}.  ",
        f"**Reads:** {reads}. **Writes** (under `outputs/<run_name>/`): {writes}.  ",
        f"**Time:** {t_default} in the default run on 2 CPU cores (`docs/measurements.md`); "
        f"`params/paper.yaml`: {t_paper} on one A100-80GB by the dry run's estimate.  ",
        f"**Run it:** `memtoc run params/default.yaml --only {nn}` (with the notebooks before it), or "
        f"`papermill notebooks/{stem}.ipynb out.ipynb -f params/default.yaml`." + ("  " if colab else ""),
        *[c.rstrip() for c in colab],
        END,
    ])


def update(path: Path) -> bool:
    nb = json.loads(path.read_text(encoding="utf-8"))
    cell = nb["cells"][0]
    src = "".join(cell["source"])
    if START in src:
        src = src[:src.index(START)].rstrip("\n")
    new = src.rstrip("\n") + "\n\n" + block(path.name[:2], path.stem)
    lines = new.split("\n")
    cell["source"] = [ln + "\n" for ln in lines[:-1]] + [lines[-1]]
    text = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
    changed = text != path.read_text(encoding="utf-8")
    path.write_text(text, encoding="utf-8")
    return changed


def main(argv: list[str]) -> int:
    only = set(argv)
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        if only and path.name[:2] not in only:
            continue
        print(f"{path.name}: {'updated' if update(path) else 'unchanged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
