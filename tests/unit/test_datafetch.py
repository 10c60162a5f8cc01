"""`memtoc data fetch` / `memtoc data where` and the release resolution order (memtoc/data/fetch.py,
config.resolve_release). Offline: archives are built from the compact release in a temp folder and
served from 127.0.0.1."""
from __future__ import annotations

import functools
import http.server
import json
import shutil
import tarfile
import threading
import zipfile
from pathlib import Path

import pytest

from memtoc.cli import main
from memtoc.config import params as config
from memtoc.config.params import RELEASE_STAMP, resolve_release, resolve_release_dir
from memtoc.config.runconfig import RunConfig
from memtoc.core.errors import DataError
from memtoc.data import fetch as datafetch
from memtoc.run import pipeline

SRC = resolve_release_dir(None)          # the compact release ($MEMTOC_RELEASE or ../shared/memtoc-release)
SAMPLE = SRC.parent / "memtoc-release-official-sample"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty release cache and home; no MEMTOC_RELEASE."""
    monkeypatch.setenv("MEMTOC_DATA_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MEMTOC_RELEASE", raising=False)
    return tmp_path / "cache"


@pytest.fixture
def tree(tmp_path):
    """A copy of the compact release under a top folder, as GitHub archives have one."""
    top = tmp_path / "src" / "memtoc-0123abc"
    shutil.copytree(SRC, top)
    return top


def _tar(top: Path, out: Path) -> Path:
    with tarfile.open(out, "w:gz") as tf:
        tf.add(top, arcname=top.name)
    return out


def _zip(top: Path, out: Path) -> Path:
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for p in sorted(top.rglob("*")):
            zf.write(p, f"{top.name}/{p.relative_to(top).as_posix()}")
    return out


def _fetch(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["data", "fetch", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def _installed(cache: Path) -> list[Path]:
    return sorted(cache.iterdir()) if cache.is_dir() else []


def _assert_refused(rc: int, err: str, cache: Path, *words: str) -> None:
    assert rc != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "nothing was installed" in lines[0] or "damaged" in lines[0]
    for w in words:
        assert w in lines[0], lines[0]
    assert _installed(cache) == [], "a refused copy was installed or its temporary folder left behind"


# ------------------------------------------------------------------------------------ fetch


@pytest.mark.parametrize("kind", ["tar.gz", "zip"])
def test_fetch_local_archive_installs_a_verified_copy(cache, tree, tmp_path, capsys, kind):
    archive = (_tar if kind == "tar.gz" else _zip)(tree, tmp_path / f"release.{kind}")
    rc, out, err = _fetch(capsys, "--source", str(archive))
    assert rc == 0 and err == ""
    [dest] = _installed(cache)
    assert dest.name.startswith("local-") and len(dest.name) == len("local-") + 12
    stamp = json.loads((dest / RELEASE_STAMP).read_text())
    assert stamp["source"] == str(archive) and stamp["commit"] is None
    v = stamp["verification"]
    assert v["status"] == "PASS" and v["layout"] == "compact"
    assert v["counts"] == {"pool": 575, "analysis": 542, "excluded": 33, "repaired": 39,
                           "far_analysis": 443, "chains": 309}
    assert {"check": "crossfit_folds.json split content", "status": "ok",
            "detail": "reproduces the official split_content_sha256"} in v["checksums"]
    assert stamp["files"] == datafetch.tree_hashes(dest) and "questions_575.jsonl" in stamp["files"]
    assert not (dest / tree.name).exists()          # the archive's top folder was stripped
    # the same content from a folder lands on the same name: already installed, nothing fetched
    rc, out, _ = _fetch(capsys, "--source", str(tree))
    assert rc == 0 and "already installed" in out and _installed(cache) == [dest]


def test_fetch_folder_to_dest_and_force(cache, tree, tmp_path, capsys):
    dest = tmp_path / "mine" / "release"
    rc, out, err = _fetch(capsys, "--source", str(tree), "--dest", str(dest))
    assert rc == 0 and (dest / "questions_575.jsonl").is_file() and f"--release {dest}" in out
    assert datafetch.read_stamp(dest)["verification"]["status"] == "PASS"
    rc, out, _ = _fetch(capsys, "--source", str(tree), "--dest", str(dest))
    assert "already installed" in out
    (dest / "extra.txt").write_text("x")
    rc, out, _ = _fetch(capsys, "--source", str(tree), "--dest", str(dest), "--force")
    assert rc == 0 and not (dest / "extra.txt").exists()
    assert sorted(p.name for p in dest.parent.iterdir()) == ["release"]   # no temporary folder left
    # an existing folder that is not a verified copy is not replaced without --force
    other = tmp_path / "other"
    other.mkdir()
    rc, _, err = _fetch(capsys, "--source", str(tree), "--dest", str(other))
    assert rc != 0 and "--force" in err and list(other.iterdir()) == []


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep stderr clean
        pass


@pytest.fixture
def http_dir(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_fetch_over_http(cache, tree, http_dir, capsys):
    root, base = http_dir
    _tar(tree, root / "release.tar.gz")
    rc, out, err = _fetch(capsys, "--source", f"{base}/release.tar.gz")
    assert rc == 0 and err == ""            # no progress lines when stderr is not a terminal
    [dest] = _installed(cache)
    assert dest.name.startswith("url-") and datafetch.read_stamp(dest)["source"] == f"{base}/release.tar.gz"
    rc, _, err = _fetch(capsys, "--source", f"{base}/missing.tar.gz")
    assert rc != 0 and "HTTP 404" in err and len(err.strip().splitlines()) == 1
    assert _installed(cache) == [dest]
    # a damaged download is refused like a damaged file
    data = (root / "release.tar.gz").read_bytes()
    (root / "cut.tar.gz").write_bytes(data[: len(data) // 2])
    rc, _, err = _fetch(capsys, "--source", f"{base}/cut.tar.gz")
    assert rc != 0 and "damaged" in err and _installed(cache) == [dest]


def test_truncated_archive_is_refused(cache, tree, tmp_path, capsys):
    archive = _tar(tree, tmp_path / "release.tar.gz")
    data = archive.read_bytes()
    archive.write_bytes(data[: len(data) - 4000])
    rc, _, err = _fetch(capsys, "--source", str(archive))
    _assert_refused(rc, err, cache, str(archive), "damaged")


def _drop_question(top: Path) -> str:
    p = top / "questions_575.jsonl"
    lines = p.read_text().splitlines(keepends=True)
    p.write_text("".join(lines[:10] + lines[11:]))
    return "questions_575.jsonl"


def _rename_excluded_qkey(top: Path) -> str:
    p = top / "qc_lists.json"
    d = json.loads(p.read_text())
    d["exclude_qkeys"][0] = d["exclude_qkeys"][0] + " x"
    p.write_text(json.dumps(d))
    return "qc_lists.json"


def _break_json(top: Path) -> str:
    p = top / "published_other.json"
    p.write_text(p.read_text()[:-20])
    return "published_other.json: not valid JSON"


def _flip_fold(top: Path) -> str:
    p = top / "crossfit_folds.json"
    d = json.loads(p.read_text())
    d["assignments"][0]["fold"] = "A" if d["assignments"][0]["fold"] == "B" else "B"
    p.write_text(json.dumps(d))
    return "crossfit_folds.json"


@pytest.mark.parametrize("tamper", [_drop_question, _rename_excluded_qkey, _break_json, _flip_fold])
def test_tampered_copy_is_refused(cache, tree, tmp_path, capsys, tamper):
    names = tamper(tree)
    rc, _, err = _fetch(capsys, "--source", str(_tar(tree, tmp_path / "release.tar.gz")))
    _assert_refused(rc, err, cache, names)
    assert "Traceback" not in err


def test_unsafe_and_foreign_archives(cache, tree, tmp_path, capsys):
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tf:
        tf.add(tree / "NOTICE", arcname="../NOTICE")
    rc, _, err = _fetch(capsys, "--source", str(evil))
    _assert_refused(rc, err, cache, "outside the archive")
    assert not (tmp_path / "NOTICE").exists() and not (cache.parent / "NOTICE").exists()
    empty = tmp_path / "empty"
    (empty / "docs").mkdir(parents=True)
    rc, _, err = _fetch(capsys, "--source", str(empty))
    _assert_refused(rc, err, cache, "no MemToC release files")
    rc, _, err = _fetch(capsys, "--source", str(tmp_path / "nope.tar.gz"))
    assert rc != 0 and "no such file or folder" in err


def test_commit_of_url():
    c = datafetch.PINNED_COMMIT
    assert datafetch.commit_of_url(datafetch.DEFAULT_SOURCE) == c
    assert datafetch.commit_of_url(f"https://github.com/{datafetch.OFFICIAL_REPO}/archive/{c}.tar.gz") == c
    assert datafetch.commit_of_url("https://example.org/release.tar.gz") is None


# ------------------------------------------------------------------------------ official layout


def _official_folds() -> dict:
    """The official crossfit_folds.json rebuilt in full: the sample's text with the compact copy's
    assignments and rows (the sample keeps only the first records)."""
    d = json.loads((SAMPLE / datafetch.FOLDS).read_text())
    compact = json.loads((SRC / "crossfit_folds.json").read_text())
    fold = {a["instance_id"]: a["fold"] for a in compact["assignments"]}
    d["assignments"] = [{"instance_id": a["instance_id"], "fold": a["fold"], "n_questions": len(a["qkeys"]),
                         "qkeys": a["qkeys"]} for a in sorted(compact["assignments"], key=lambda a: a["instance_id"])]
    qs = [json.loads(line) for line in (SRC / "questions_575.jsonl").read_text().splitlines() if line.strip()]
    d["rows"] = [{"id": q["id"], "qkey": q["qkey"], "instance_id": q["instance_id"], "hop_idx": q["hop_idx"],
                  "fold": fold[q["instance_id"]]} for q in qs]
    return d


@pytest.mark.skipif(not SAMPLE.is_dir(), reason="the official layout sample is not beside the release")
def test_official_checksums(tmp_path):
    root = tmp_path / "official"
    shutil.copytree(SAMPLE, root)
    (root / datafetch.FOLDS).write_text(json.dumps(_official_folds(), ensure_ascii=False, indent=2) + "\n")
    # the sample keeps 5 of each formulation's 2,875 episodes: the count check sees that
    with pytest.raises(DataError, match=r"benchmark/paraphrase_a.json: summary.n_episodes is 2875 but the file holds 5"):
        datafetch.check_json(root)
    summaries = {rel: json.loads((root / rel).read_text())["summary"] for rel in datafetch.EPISODE_FILES}
    checks = {c["check"]: c for c in datafetch.official_checksums(root, summaries)}
    assert checks[f"{datafetch.FOLDS} split_content_sha256"]["status"] == "ok"
    assert checks["mapping_sha256"] == {"check": "mapping_sha256", "status": "ok", "detail": "6 files agree"}
    assert checks["split_sha256"]["status"] == "ok" and checks["mapping content_sha256_575"]["status"] == "ok"
    # the sample's exact copies are the pinned release files
    assert datafetch.pinned_checksums(root, datafetch.PINNED_COMMIT)[0]["status"] == "ok"
    assert datafetch.pinned_checksums(root, None)[0]["status"] == "not applicable"
    # altered: a fold, a recorded hash, a pinned file
    d = _official_folds()
    d["rows"][3]["fold"] = "A" if d["rows"][3]["fold"] == "B" else "B"
    (root / datafetch.FOLDS).write_text(json.dumps(d, indent=2))
    with pytest.raises(DataError, match="crossfit_folds.json: split_content_sha256"):
        datafetch.official_checksums(root, summaries)
    p = root / datafetch.SEMANTIC_REVIEW
    p.write_text(p.read_text().replace("560dea277c73", "560dea277c74", 1))
    (root / datafetch.FOLDS).write_text(json.dumps(_official_folds(), indent=2))
    with pytest.raises(DataError, match="semantic_review_575.json mapping_sha256"):
        datafetch.official_checksums(root, summaries)
    p = root / "results/summaries/arm_metrics.json"
    p.write_text(p.read_text() + " ")
    with pytest.raises(DataError, match="arm_metrics.json: sha256"):
        datafetch.pinned_checksums(root, datafetch.PINNED_COMMIT)


# ------------------------------------------------------------------------- resolution order


def _stamp(folder: Path, date: str, status: str = "PASS") -> Path:
    folder.mkdir(parents=True)
    (folder / RELEASE_STAMP).write_text(json.dumps({"date": date, "commit": None, "source": "test",
                                                    "verification": {"status": status}}))
    return folder


def test_resolution_order(cache, tmp_path, monkeypatch, capsys):
    repo = tmp_path / "repo"
    beside = tmp_path / "shared" / "memtoc-release"
    for d in (repo, beside, tmp_path / "arg", tmp_path / "par", tmp_path / "env"):
        d.mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(config, "REPO_ROOT", repo)
    monkeypatch.chdir(repo)
    fetched = _stamp(cache / "old", "2026-01-01T00:00:00+00:00")
    _stamp(cache / "failed", "2026-12-01T00:00:00+00:00", status="FAIL")   # never chosen
    monkeypatch.setenv("MEMTOC_RELEASE", str(tmp_path / "env"))
    P = {"release_dir": "../par"}                                        # relative: from the working directory
    assert resolve_release(tmp_path / "arg", P) == ((tmp_path / "arg").resolve(), "argument")
    assert resolve_release(None, P) == ((tmp_path / "par").resolve(), "params:release_dir")
    assert resolve_release(None, {"release_dir": None}) == ((tmp_path / "env").resolve(), "env:MEMTOC_RELEASE")
    monkeypatch.delenv("MEMTOC_RELEASE")
    assert resolve_release() == (fetched.resolve(), "fetched")
    newer = _stamp(cache / "new", "2026-06-01T00:00:00+00:00")
    assert resolve_release() == (newer.resolve(), "fetched")
    shutil.rmtree(cache)
    assert resolve_release() == (beside.resolve(), "beside-repository")
    assert resolve_release_dir() == beside.resolve()
    # a named folder that does not exist is an error, not a fall-through
    with pytest.raises(DataError, match="params:release_dir"):
        resolve_release(None, {"release_dir": str(tmp_path / "absent")})
    shutil.rmtree(beside)
    with pytest.raises(DataError, match="memtoc data fetch"):
        resolve_release()
    # HOME decides the default cache when MEMTOC_DATA_DIR is not set
    monkeypatch.delenv("MEMTOC_DATA_DIR")
    home_copy = _stamp(tmp_path / "home" / ".cache" / "memtoc" / "release" / "abc", "2026-02-01T00:00:00+00:00")
    assert resolve_release() == (home_copy.resolve(), "fetched")
    assert main(["data", "where"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == str(home_copy.resolve()) and out[1].startswith("found by: fetched (commit unknown")
    assert main(["data", "where", "--release", str(tmp_path / "arg")]) == 0
    assert capsys.readouterr().out.splitlines() == [str((tmp_path / "arg").resolve()), "found by: argument"]
    shutil.rmtree(tmp_path / "home")
    assert main(["data", "where"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "memtoc data fetch" in err


def test_run_records_how_the_release_was_found(cache, tmp_path):
    nb = tmp_path / "notebooks"
    nb.mkdir()
    P = RunConfig.load(None, {"output_root": str(tmp_path / "out"), "release_dir": str(SRC), "run_name": "r"})
    cfg = pipeline.run(P, None, notebook_dir=nb, executor=lambda *a: None, echo=lambda m: None)
    assert cfg["release"] == {"dir": str(SRC), "found_by": "params:release_dir"}
    written = json.loads((tmp_path / "out" / "r" / "config.json").read_text())
    assert written["release"] == cfg["release"]
