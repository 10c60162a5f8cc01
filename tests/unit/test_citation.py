"""CITATION.cff is valid Citation File Format 1.2.0 (the check ``cffconvert --validate`` makes, against the
format's own JSON schema, tests/fixtures/cff/) and its preferred citation is the paper's, as the
README's BibTeX entry (the release's ``varlamov2026memtoc``) gives it."""
from __future__ import annotations

import copy
import json
import re

import jsonschema
import pytest
import yaml

from memtoc.core.project import REPO_ROOT

SCHEMA = json.loads((REPO_ROOT / "tests" / "fixtures" / "cff" / "schema-1.2.0.json").read_text(encoding="utf-8"))


def _cff() -> dict:
    return yaml.safe_load((REPO_ROOT / "CITATION.cff").read_text(encoding="utf-8"))


def _errors(doc: dict) -> list[str]:
    v = jsonschema.Draft7Validator(SCHEMA)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in v.iter_errors(doc)]


def test_citation_cff_is_valid_cff_1_2_0():
    assert _errors(_cff()) == []


@pytest.mark.parametrize("damage", ["no authors", "bad version", "unknown reference type"])
def test_the_schema_check_can_fail(damage):
    doc = copy.deepcopy(_cff())
    if damage == "no authors":
        del doc["authors"]
    elif damage == "bad version":
        doc["cff-version"] = "9.9"
    else:
        doc["preferred-citation"]["type"] = "preprint-of-sorts"
    assert _errors(doc)


def test_the_preferred_citation_is_the_papers_bibtex_entry():
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"@misc\{varlamov2026memtoc,(.*?)\n\}", readme, re.S)
    assert m, "the README carries the release's BibTeX entry varlamov2026memtoc"
    bib = dict(re.findall(r"(\w+)\s*=\s*\{(.*?)\},?\n", m.group(1) + "\n"))
    pc = _cff()["preferred-citation"]
    authors = " and ".join(f"{a['family-names']}, {a['given-names']}" for a in pc["authors"])
    assert authors == bib["author"]
    assert pc["title"] == bib["title"] and str(pc["year"]) == bib["year"]
    assert bib["eprint"] in pc["url"] and pc["url"] == bib["url"]
