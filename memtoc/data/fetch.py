"""`memtoc data fetch` / `memtoc data where`: get the MemToC benchmark release, verify it, install it.

    memtoc data fetch                          # the official release at the pinned commit
    memtoc data fetch --source ~/Downloads/memtoc-cd7d7cf.tar.gz
    memtoc data fetch --source ../shared/memtoc-release --dest /data/memtoc-release
    memtoc data where                          # which release memtoc will read, and why

Where memtoc finds the release (``config.resolve_release``; the first rule that names a folder
decides, and a named folder that does not exist is an error):

1. ``--release DIR`` on the command line (an explicit ``release_dir`` argument);
2. the parameter ``release_dir`` of the params file;
3. the environment variable ``MEMTOC_RELEASE``;
4. the newest verified copy installed by ``memtoc data fetch`` under ``$MEMTOC_DATA_DIR``
   (default ``~/.cache/memtoc/release``), i.e. a folder whose ``memtoc-release.json`` stamp
   records a passed verification;
5. ``../shared/memtoc-release`` beside the repository (or the working directory).

``memtoc run`` records the folder and the rule in the run's ``config.json`` (``release``).

What ``fetch`` does. The default source is the GitHub archive of ``ArceniyVarlamov/memtoc`` at
commit ``cd7d7cf21cfbe00b6568bd0a10d0e9d039318f94`` (:data:`DEFAULT_SOURCE`); ``--source`` also
takes any http(s) URL, a local ``.tar.gz``/``.tar``/``.zip`` archive, or a local folder, in the
official layout (``benchmark/*.json`` + ``results/...``) or the compact one
(``questions_575.jsonl`` + ``qc_lists.json`` + ...). The archive is downloaded (progress on a
terminal's stderr) and unpacked into a temporary folder beside the destination, its single top
folder stripped, and the copy is verified before anything is installed:

- every ``.json`` file parses (and every line of every ``.jsonl``); an episode file's
  ``summary.n_episodes`` equals its number of episodes;
- ``memtoc.data.benchmark.load_benchmark`` on the copy gives the release's counts: 575 questions in the
  pool, 542 in the analysis set, 33 excluded, 39 repaired, 443 far values in the analysis set,
  309 chains;
- the checksums the release records about itself, where they can be recomputed from the shipped
  files (:func:`official_checksums`, :func:`compact_checksums`); each one that cannot is listed in
  the stamp as ``not recomputable`` with the reason;
- at the pinned commit, the sha256 of the release files whose exact content is known
  (:data:`PINNED_SHA256`).

Only then is the verified folder moved into place in one ``os.replace`` (``<cache>/<commit>``, or
``<cache>/local-<sha12>`` / ``url-<sha12>`` when the commit is unknown, named after the content;
``--dest DIR`` chooses the folder), with a ``memtoc-release.json`` stamp: source, commit, date,
the sha256 of every file and the verification results. A damaged or altered copy stops with one
line naming the file and what is wrong; nothing is installed and the temporary folder is removed.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gzip
import hashlib
import http.client
import json
import os
import re
import shutil
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
import zipfile
import zlib
from pathlib import Path
from typing import Any, Callable, Optional

from memtoc import __version__
from memtoc.config.params import RELEASE_STAMP, fetched_release, release_cache_root, resolve_release
from memtoc.core.errors import DataError
from memtoc.core.io import sha256_file, sha256_json, write_json
from memtoc.data.benchmark import load_benchmark

OFFICIAL_REPO = "ArceniyVarlamov/memtoc"
PINNED_COMMIT = "cd7d7cf21cfbe00b6568bd0a10d0e9d039318f94"
DEFAULT_SOURCE = f"https://codeload.github.com/{OFFICIAL_REPO}/tar.gz/{PINNED_COMMIT}"
STAMP_FORMAT = 1
EXPECTED_COUNTS = {"pool": 575, "analysis": 542, "excluded": 33, "repaired": 39, "far_analysis": 443, "chains": 309}
COUNT_LABELS = {"pool": ("table", "questions in the pool"), "analysis": ("qc", "questions in the analysis set"),
                "excluded": ("qc", "excluded questions"), "repaired": ("qc", "repaired questions"),
                "far_analysis": ("table", "far values in the analysis set"),
                "chains": ("table", "chains (ToolHop instances)")}
# sha256 of release files at PINNED_COMMIT (the files the layout sample copies exactly).
PINNED_SHA256 = {
    "results/quality_control/repair_list_39.json":
        "985712b9d2d573573a6e51be64eff627401da5ec1ac65db465f86381398662ac",
    "results/quality_control/analysis_set_lists.json":
        "fa5522fc530dcf982c96a8a35a142c9ab01d4e18c109fd10369ab1eb2a121995",
    "results/quality_control/crossfit_verification.json":
        "1011743010649e17b68b19fecc77ef3b3003d9852e5fbfd5a71fa264a91272f6",
    "results/quality_control/derived_arms_verification.json":
        "30d552286ab2d9f6b5b6e2803975ac5ddb3427554b97a93d3432896910a78238",
    "results/quality_control/materialization_report.json":
        "76985bad1f119cb6110645f4f0bf9c3ad1530d03d6f622fdd719da1986e25fc9",
    "results/distractor_distance/summary.json":
        "f158fb0c28d487ad97e35c547482cdf64d891e5087b45f829bed9f1bf3921df6",
    "results/summaries/pooled_across_formulations.json":
        "25225451ddff0a563415f6e1aa3fec42ca9d2c2ee199be2910b7cbabe37f56e5",
    "results/summaries/arm_metrics.json":
        "d621c95878c2e00d615779d54bb83c526eebc41d0c44a4b42e6fa011f086c718",
    "results/acknowledgment/annotation_round.json":
        "a6a6d17a99f4c6591a2f98ef7d0d74f70d07b8194e65a1d252069c254019ec32",
}
# results/quality_control/crossfit_folds.json "split_content_sha256" of the official release; the
# compact copy's crossfit_folds.json + questions_575.jsonl must reproduce it.
OFFICIAL_SPLIT_CONTENT_SHA256 = "6b60097d2ae9b600c781a24801b16ec709f6548516fda7759ed6d3bdd7729bcd"
FOLDS = "results/quality_control/crossfit_folds.json"
MAPPING = "results/construction/distractor_mapping_575.json"
CROSSFIT_VERIFICATION = "results/quality_control/crossfit_verification.json"
SEMANTIC_REVIEW = "results/quality_control/semantic_review_575.json"
EPISODE_FILES = tuple(f"benchmark/{f}.json" for f in ("reference", "paraphrase_a", "paraphrase_b"))
# Checksums the official release records that cannot be recomputed from the shipped files, and why.
NOT_RECOMPUTABLE = {
    "distractor_mapping_575.json content_sha256_575":
        "the recipe for the 575-row mapping is not in the release code (the v3 recipe of "
        "code/scripts/build_repair_overlay.py does not reproduce it)",
    "mapping_sha256 (benchmark/*.json summary, crossfit_folds.json, crossfit_verification.json, "
    "semantic_review_575.json)":
        "hash of the mapping before six fields were redacted for release (README.md of the release); "
        "checked here for agreement between the files only",
    "split_sha256 (crossfit_verification.json, semantic_review_575.json)":
        "hash of crossfit_folds.json as built; the shipped file does not reproduce it; checked for "
        "agreement between the files only",
    "materialization_report.json arms.*.sha256":
        "hashes of build files (episodes_e096_v3_*.json) that the release does not ship under those names",
    "derived_arms_verification.json arms.*.sha256, build_report_sha256, verifier_sha256":
        "the derived arms, the build report and the verifier are not in the release",
    "benchmark/*.json summary v2_sha256, patch_sha256":
        "the pre-repair build is not shipped, and the overlay files as shipped are not established to be "
        "byte-identical to the patch files hashed at build time",
    "builder_sha256, code_commit":
        "hashes of the builder scripts at internal commits, not of shipped files",
}

Echo = Callable[[str], None]


# ----------------------------------------------------------------------------------------------
# sources: download, unpack, copy

def _is_url(spec: str) -> bool:
    return bool(re.match(r"^https?://", spec, re.I))


def commit_of_url(url: str) -> Optional[str]:
    """The commit a GitHub archive URL names (codeload ``/tar.gz/<sha>`` or ``/archive/<sha>.tar.gz``)."""
    m = re.search(r"/(?:tar\.gz|zip|archive)/([0-9a-f]{40})(?:\.tar\.gz|\.zip)?/?$", url)
    return m.group(1) if m else None


class _Progress:
    """Download progress on stderr, only on a terminal (one line, rewritten, erased at the end)."""

    def __init__(self, label: str):
        self.on = sys.stderr.isatty()
        self.label = label

    def __call__(self, got: int, total: int) -> None:
        if self.on:
            of = f" of {total / 2**20:.1f} MiB ({100 * got / total:.0f}%)" if total else ""
            sys.stderr.write(f"\r{self.label}: {got / 2**20:.1f} MiB{of}\033[K")
            sys.stderr.flush()

    def close(self) -> None:
        if self.on:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def download(url: str, to: Path, timeout: float = 60.0) -> Path:
    """Stream ``url`` into the file ``to``; a cut-short or failed download is a DataError."""
    req = urllib.request.Request(url, headers={"User-Agent": f"memtoc/{__version__}"})
    bar = _Progress(f"downloading {url}")
    got = total = 0
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r, open(to, "wb") as f:
            total = int(r.headers.get("Content-Length") or 0)
            while True:
                chunk = r.read(1 << 20)
                if not chunk:
                    break
                f.write(chunk)
                got += len(chunk)
                bar(got, total)
    except urllib.error.HTTPError as e:
        raise DataError(f"{url}: HTTP {e.code} {e.reason}; check the address, or download the archive "
                        "yourself and run `memtoc data fetch --source FILE`") from None
    except urllib.error.URLError as e:
        raise DataError(f"{url}: cannot download ({e.reason}); check the network, or download the archive "
                        "yourself and run `memtoc data fetch --source FILE`") from None
    except (http.client.HTTPException, ConnectionError, TimeoutError) as e:
        raise DataError(f"{url}: the download broke off after {got} bytes ({type(e).__name__}); "
                        "run the command again") from None
    finally:
        bar.close()
    if total and got != total:
        raise DataError(f"{url}: the download was cut short ({got} of {total} bytes); run the command again")
    return to


def _safe_name(name: str) -> bool:
    parts = Path(name).parts
    return bool(parts) and not Path(name).is_absolute() and ".." not in parts


def unpack(archive: Path, into: Path, label: str) -> Optional[str]:
    """Unpack a .tar(.gz) or .zip ``archive`` into the folder ``into``; returns the commit id git
    records in the archive (tar pax comment / zip comment), if any. Damaged archives: DataError."""
    with open(archive, "rb") as f:
        magic = f.read(4)
    try:
        if magic.startswith(b"PK"):
            with zipfile.ZipFile(archive) as zf:
                bad = next((n for n in zf.namelist() if not _safe_name(n)), None)
                if bad is not None:
                    raise DataError(f"{label}: archive member {bad!r} points outside the archive; not extracted")
                broken = zf.testzip()
                if broken is not None:
                    raise zipfile.BadZipFile(f"bad CRC in {broken}")
                zf.extractall(into)
                comment = zf.comment.decode("ascii", "replace").strip()
        else:
            with tarfile.open(archive, "r:*") as tf:
                members = tf.getmembers()   # reads to the end: a truncated archive fails here
                bad = next((m.name for m in members if not _safe_name(m.name)), None)
                if bad is not None:
                    raise DataError(f"{label}: archive member {bad!r} points outside the archive; not extracted")
                safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}   # Python >= 3.11.4
                tf.extractall(into, members=[m for m in members if m.isfile() or m.isdir()], **safe)
                comment = str(tf.pax_headers.get("comment", "")).strip()
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise DataError(f"{label}: damaged or unreadable archive ({' '.join(str(e).split()) or type(e).__name__}); "
                        "download it again") from None
    return comment if re.fullmatch(r"[0-9a-f]{40}", comment) else None


def strip_top(folder: Path) -> Path:
    """The single top folder of an unpacked archive (GitHub archives have one), else ``folder``."""
    entries = [p for p in folder.iterdir()]
    return entries[0] if len(entries) == 1 and entries[0].is_dir() else folder


def tree_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (posix relative path -> hex), the stamp left out."""
    return {p.relative_to(root).as_posix(): sha256_file(p) for p in sorted(root.rglob("*"))
            if p.is_file() and p.relative_to(root).as_posix() != RELEASE_STAMP}


# ----------------------------------------------------------------------------------------------
# verification

def layout_of(root: Path) -> str:
    if (root / MAPPING).is_file():
        return "official"
    if (root / "questions_575.jsonl").is_file():
        return "compact"
    raise DataError(f"no MemToC release files found ({MAPPING} for the official layout, questions_575.jsonl "
                    "for the compact one); is this the MemToC release?")


def check_json(root: Path) -> tuple[int, dict[str, Any]]:
    """Parse every .json / .jsonl file; check episode files' ``summary.n_episodes``. Returns the
    number of files parsed and the ``summary`` block of each episode file (by relative path)."""
    n, summaries = 0, {}
    for p in sorted(root.rglob("*.json*")):
        rel = p.relative_to(root).as_posix()
        if not p.is_file() or p.suffix not in (".json", ".jsonl") or rel == RELEASE_STAMP:
            continue
        try:
            text = p.read_text(encoding="utf-8")
            docs = [json.loads(text)] if p.suffix == ".json" else \
                [json.loads(line) for line in text.splitlines() if line.strip()]
        except UnicodeDecodeError as e:
            raise DataError(f"{rel}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise DataError(f"{rel}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
        n += 1
        doc = docs[0] if p.suffix == ".json" else None
        if isinstance(doc, dict) and isinstance(doc.get("summary"), dict) and isinstance(doc.get("episodes"), list):
            want = doc["summary"].get("n_episodes")
            if want is not None and want != len(doc["episodes"]):
                raise DataError(f"{rel}: summary.n_episodes is {want} but the file holds "
                                f"{len(doc['episodes'])} episodes")
            summaries[rel] = doc["summary"]
    return n, summaries


def check_counts(root: Path) -> dict[str, int]:
    """The release's counts through ``load_benchmark``; a difference names the file it comes from."""
    try:
        bench = load_benchmark(root)
        counts = bench.counts(episodes=False)
    except DataError as e:
        raise DataError(str(e).replace(str(root) + os.sep, "")) from None
    for key, want in EXPECTED_COUNTS.items():
        if counts[key] != want:
            which, label = COUNT_LABELS[key]
            path = Path(bench.files.get(which, root))
            rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
            raise DataError(f"{rel}: {counts[key]} {label}, the MemToC release has {want}; "
                            "the copy is incomplete or altered")
    return {k: counts[k] for k in EXPECTED_COUNTS}


def canonical_sha256(value: Any) -> str:
    """The release's content hash (code/scripts/build_crossfit_folds.py ``canonical_sha256``):
    sha256 of sorted-key, compact-separator JSON with non-ASCII kept."""
    payload = json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def _result(check: str, status: str, detail: str = "") -> dict[str, str]:
    return {"check": check, "status": status, "detail": detail}


def _load(root: Path, rel: str) -> Any:
    p = root / rel
    return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else None


def _agree(name: str, recorded: dict[str, Any]) -> dict[str, str]:
    """Recorded copies of one checksum in several files must be equal (absent files are skipped)."""
    present = {k: v for k, v in recorded.items() if v is not None}
    if len(present) < 2:
        return _result(name, "absent", "fewer than two files of the copy record it")
    (first, value), *rest = present.items()
    for label, other in rest:
        if other != value:
            raise DataError(f"{label} is {other}, but {first} is {value}; the copy is altered")
    return _result(name, "ok", f"{len(present)} files agree")


def official_checksums(root: Path, summaries: dict[str, Any]) -> list[dict[str, str]]:
    """The checksums the official release records about itself, recomputed or cross-checked."""
    out = []
    folds = _load(root, FOLDS) or {}
    if "split_content_sha256" in folds:
        got = canonical_sha256({"assignments": folds.get("assignments"), "rows": folds.get("rows")})
        if got != folds["split_content_sha256"]:
            raise DataError(f"{FOLDS}: split_content_sha256 is {folds['split_content_sha256']}, but the file's "
                            f"assignments and rows hash to {got}; the copy is altered")
        out.append(_result(f"{FOLDS} split_content_sha256", "ok", "recomputed (canonical JSON of assignments + rows)"))
    else:
        out.append(_result(f"{FOLDS} split_content_sha256", "absent", "not in the copy"))
    mapping = _load(root, MAPPING) or {}
    review = _load(root, SEMANTIC_REVIEW) or {}
    verification = _load(root, CROSSFIT_VERIFICATION) or {}
    source = folds.get("source") or {}
    out.append(_agree("mapping content_sha256_575", {
        f"{MAPPING} content_sha256_575": mapping.get("content_sha256_575"),
        f"{FOLDS} source.mapping_content_sha256": source.get("mapping_content_sha256")}))
    recorded = {f"{rel} summary.mapping_sha256": (summaries.get(rel) or {}).get("mapping_sha256")
                for rel in EPISODE_FILES}
    recorded.update({f"{FOLDS} source.mapping_sha256": source.get("mapping_sha256"),
                     f"{CROSSFIT_VERIFICATION} mapping_sha256": verification.get("mapping_sha256"),
                     f"{SEMANTIC_REVIEW} mapping_sha256": review.get("mapping_sha256")})
    out.append(_agree("mapping_sha256", recorded))
    out.append(_agree("split_sha256", {f"{CROSSFIT_VERIFICATION} split_sha256": verification.get("split_sha256"),
                                       f"{SEMANTIC_REVIEW} split_sha256": review.get("split_sha256")}))
    return out


def pinned_checksums(root: Path, commit: Optional[str]) -> list[dict[str, str]]:
    """sha256 of the files whose content at :data:`PINNED_COMMIT` is known (official layout)."""
    name = f"pinned sha256 of {len(PINNED_SHA256)} files at commit {PINNED_COMMIT[:7]}"
    if commit != PINNED_COMMIT:
        return [_result(name, "not applicable", f"the copy's commit is {commit or 'unknown'}")]
    for rel, want in PINNED_SHA256.items():
        if not (root / rel).is_file():
            raise DataError(f"{rel}: missing from the copy of commit {PINNED_COMMIT[:7]}")
        got = sha256_file(root / rel)
        if got != want:
            raise DataError(f"{rel}: sha256 {got} differs from the release file's {want} at commit "
                            f"{PINNED_COMMIT[:7]}; the copy is damaged or altered")
    return [_result(name, "ok")]


def compact_checksums(root: Path) -> list[dict[str, str]]:
    """The compact copy records no checksums of its own; its folds and questions must reproduce the
    official ``split_content_sha256`` (:data:`OFFICIAL_SPLIT_CONTENT_SHA256`)."""
    out = [_result("checksums recorded by the copy", "not recomputable", "the compact layout records none")]
    folds = _load(root, "crossfit_folds.json")
    if folds is None:
        return out + [_result("crossfit_folds.json split content", "absent", "not in the copy")]
    text = (root / "questions_575.jsonl").read_text(encoding="utf-8")
    try:
        fold = {a["instance_id"]: a["fold"] for a in folds["assignments"]}
        assignments = [{"instance_id": a["instance_id"], "fold": a["fold"], "n_questions": len(a["qkeys"]),
                        "qkeys": a["qkeys"]} for a in sorted(folds["assignments"], key=lambda a: a["instance_id"])]
        rows = [{"id": q["id"], "qkey": q["qkey"], "instance_id": q["instance_id"], "hop_idx": q["hop_idx"],
                 "fold": fold.get(q["instance_id"])} for q in map(json.loads, filter(str.strip, text.splitlines()))]
    except (KeyError, TypeError) as e:
        raise DataError(f"crossfit_folds.json: cannot rebuild the split content (missing or mistyped field "
                        f"{e}); every assignment needs instance_id, fold and qkeys") from None
    got = canonical_sha256({"assignments": assignments, "rows": rows})
    if got != OFFICIAL_SPLIT_CONTENT_SHA256:
        raise DataError(f"crossfit_folds.json: its fold assignments with questions_575.jsonl hash to {got}, the "
                        f"official release's split_content_sha256 is {OFFICIAL_SPLIT_CONTENT_SHA256}; the copy is altered")
    return out + [_result("crossfit_folds.json split content", "ok", "reproduces the official split_content_sha256")]


def verify(root: Path, commit: Optional[str] = None) -> dict[str, Any]:
    """Everything :mod:`memtoc.data.fetch` checks before installing ``root``; raises DataError
    (one line naming the file) on the first problem, else returns the results for the stamp."""
    layout = layout_of(root)
    n_json, summaries = check_json(root)
    counts = check_counts(root)
    if layout == "official":
        checks = official_checksums(root, summaries) + pinned_checksums(root, commit)
        checks += [_result(name, "not recomputable", why) for name, why in NOT_RECOMPUTABLE.items()]
    else:
        checks = compact_checksums(root)
    return {"status": "PASS", "layout": layout, "json_files": n_json, "counts": counts, "checksums": checks}


# ----------------------------------------------------------------------------------------------
# install

def read_stamp(folder: Path) -> Optional[dict[str, Any]]:
    """The stamp of a verified copy in ``folder``, or None (no stamp, unreadable, not passed)."""
    try:
        s = json.loads((folder / RELEASE_STAMP).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = isinstance(s, dict) and isinstance(s.get("verification"), dict) and s["verification"].get("status") == "PASS"
    return s if ok else None


def write_stamp(root: Path, source: str, commit: Optional[str], verification: dict[str, Any],
                hashes: dict[str, str]) -> Path:
    return write_json(root / RELEASE_STAMP, {
        "format": STAMP_FORMAT, "source": source, "commit": commit,
        "repository": OFFICIAL_REPO if commit else None,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "memtoc_version": __version__, "verification": verification, "files": hashes})


def install(staged: Path, target: Path, force: bool, scratch: Path) -> None:
    """Move the verified folder ``staged`` to ``target`` in one rename (same file system); an
    existing ``target`` is replaced only with ``force`` (and restored if the rename fails)."""
    old = None
    if target.exists() or target.is_symlink():
        if not force:
            raise DataError(f"{target} already exists and is not a verified copy; pass --force to replace it, "
                            "or choose another --dest")
        old = scratch / "replaced"
        os.replace(target, old)
    try:
        os.replace(staged, target)
    except OSError:
        if old is not None:
            os.replace(old, target)
        raise


def _stage(spec: str, local: Optional[Path], scratch: Path) -> tuple[Path, Optional[str]]:
    """Copy or download + unpack the source into ``scratch``; returns the copy's root and the
    commit recorded in the archive, if any."""
    if local is not None and local.is_dir():
        staged = scratch / "copy"
        shutil.copytree(local, staged, ignore=shutil.ignore_patterns(RELEASE_STAMP, ".git"))
        return staged, None
    archive = local if local is not None else download(spec, scratch / "download")
    into = scratch / "unpacked"
    into.mkdir()
    found = unpack(archive, into, str(local) if local is not None else spec)
    return strip_top(into), found


def fetch(source: Optional[str] = None, dest: Optional[str | os.PathLike] = None, force: bool = False,
          echo: Echo = print) -> Path:
    """Get, verify and install a release (see the module docstring); returns the installed folder."""
    spec = str(source or DEFAULT_SOURCE)
    local = None if _is_url(spec) else Path(spec).expanduser()
    if local is not None and not local.exists():
        raise DataError(f"{spec}: no such file or folder; --source takes an http(s) URL, a .tar.gz/.zip "
                        "archive or a release folder")
    commit = commit_of_url(spec) if local is None else None
    target = Path(dest).expanduser().absolute() if dest else (release_cache_root() / commit if commit else None)
    parent = target.parent if target is not None else release_cache_root()
    if target is not None and not force and read_stamp(target):
        echo(f"already installed: {target} (pass --force to fetch it again)")
        return target
    parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".memtoc-fetch-", dir=parent))
    try:
        try:
            staged, found = _stage(spec, local, scratch)
        except DataError as e:
            raise DataError(f"{e}; nothing was installed") from None
        commit = commit or found
        hashes = tree_hashes(staged)
        if target is None:
            name = commit or f"{'local' if local is not None else 'url'}-{sha256_json(hashes)[:12]}"
            target = parent / name
            if not force and read_stamp(target):
                echo(f"already installed: {target} (pass --force to install it again)")
                return target
        try:
            verification = verify(staged, commit)
        except DataError as e:
            raise DataError(f"{e} (source {spec}); nothing was installed") from None
        write_stamp(staged, spec, commit, verification, hashes)
        install(staged, target, force, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    echo(f"installed the MemToC release ({verification['layout']} layout, commit {commit or 'unknown'}, "
         f"{len(hashes)} files, verified) at {target}")
    if dest and fetched_release() != target.resolve():
        echo(f"memtoc reads it with --release {target} or MEMTOC_RELEASE={target}")
    return target


# ----------------------------------------------------------------------------------------------
# command line

def cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="memtoc data", description="get the MemToC benchmark release "
                                 "(the resolution order is in the docstring of memtoc/data/fetch.py)")
    sub = ap.add_subparsers(dest="action", required=True)
    f = sub.add_parser("fetch", help="download, verify and install the release")
    f.add_argument("--source", default=None, help=f"http(s) URL, .tar.gz/.zip archive or release folder "
                                                  f"(default: {DEFAULT_SOURCE})")
    f.add_argument("--dest", default=None, help="install folder (default: $MEMTOC_DATA_DIR or "
                                                "~/.cache/memtoc/release, then /<commit>)")
    f.add_argument("--force", action="store_true", help="fetch again and replace an installed copy")
    w = sub.add_parser("where", help="print the release memtoc reads and the rule that found it")
    w.add_argument("--release", default=None, help="an explicit release folder (as --release elsewhere)")
    a = ap.parse_args(argv)
    if a.action == "fetch":
        fetch(a.source, a.dest, a.force)
        return 0
    path, rule = resolve_release(a.release)
    stamp = read_stamp(path)
    print(path)
    print(f"found by: {rule}" + (f" (commit {stamp.get('commit') or 'unknown'}, fetched {stamp.get('date')} "
                                 f"from {stamp.get('source')})" if stamp else ""))
    return 0
