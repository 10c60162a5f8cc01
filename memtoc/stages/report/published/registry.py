"""The generic ops of the registry's ``published:`` section (``paper/claims.yaml``): bookkeeping
counts of the release files (construction, review, acknowledgment). The files are named as in
the compact copy; :meth:`memtoc.stages.report.published.release.ReleaseData.registry_file` resolves them in
either layout. Each op is a function of this module; a check's ``via`` is the op that ran."""
from __future__ import annotations

import math
import re
import string
from typing import Any, Callable, Optional

from memtoc.core import stats
from memtoc.stages.report import claims
from memtoc.stages.report.published.release import ReleaseData
from memtoc.stages.report.published.result import Collector, MissingInput, PublishedCheckError
from memtoc.stages.report.published.via import PIPELINE_MODULES, Traced, trace, via_pipeline

OP_MODULES = PIPELINE_MODULES + (__name__,)


class _Fmt(dict):
    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


def _fill(template: str, env: dict, escape: bool = False) -> str:
    vals = {k: (_esc(v) if escape else v) for k, v in env.items()}
    return string.Formatter().vformat(template, (), _Fmt(vals))


def _esc(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _esc(x) for k, x in v.items()}
    if isinstance(v, str) and v.startswith("/"):
        return v
    return claims.escape_token(v)


class _Files:
    def __init__(self, rd: ReleaseData):
        self.rd = rd

    def load(self, rel: str) -> Any:
        return self.rd.registry_file(rel)

    def get(self, rel: str, pointer: str) -> Any:
        return claims.json_pointer(self.load(rel), pointer, where=str(self.rd.dir / rel))


def op_value(spec: dict, env: dict, files: _Files) -> Any:
    node = files.get(_fill(spec["file"], env), _fill(spec.get("pointer", ""), env, escape=True))
    if "regex" in spec:
        pattern = spec["regex"]
        m = re.fullmatch(r"\{(\w+)\[(\w+)\]\}", pattern)
        if m:
            pattern = env[m.group(1)][m.group(2)]
        hit = re.search(pattern, node if isinstance(node, str) else "")
        if not hit:
            raise claims.MissingSource(f"{spec['file']}: pattern {pattern!r} not found")
        node = hit.group(spec.get("group", 1))
        if re.fullmatch(r"[\d,]+", node):
            node = int(node.replace(",", ""))
        elif re.fullmatch(r"\d*\.\d+", node):
            node = float(node)
    if spec.get("sum_values"):
        node = sum(node.values())
    if spec.get("len"):
        node = len(node)
    return node


def _rows(d: dict, env: dict, files: _Files) -> list[dict]:
    rows = files.load(_fill(d["file"], env))
    for cond in d.get("where", []):
        f = cond["field"]
        if "equals" in cond:
            rows = [r for r in rows if r.get(f) == cond["equals"]]
        if "not_equals" in cond:
            rows = [r for r in rows if r.get(f) != cond["not_equals"]]
        if "prefix" in cond:
            rows = [r for r in rows if str(r.get(f, "")).startswith(cond["prefix"])]
        if cond.get("not_null"):
            rows = [r for r in rows if r.get(f) is not None]
        if "not_in" in cond:
            ref = cond["not_in"]
            vals = set(files.get(ref["file"], ref["pointer"]))
            rows = [r for r in rows if r.get(f) not in vals]
    return rows


def op_count_rows(d: dict, env: dict, files: _Files) -> int:
    rows = _rows(d, env, files)
    return len({r.get(d["distinct"]) for r in rows}) if d.get("distinct") else len(rows)


def op_len(d: dict, env: dict, files: _Files) -> int:
    return len(files.get(_fill(d["file"], env), _fill(d.get("pointer", ""), env, escape=True)))


def op_arithmetic(d: dict, env: dict, files: _Files) -> Any:
    parts = [derive(x, env, files) for x in d["of"]]
    return {"product": math.prod, "sum": sum, "difference": lambda p: p[0] - p[1],
            "ratio": lambda p: p[0] / p[1]}[d["op"]](parts)


def op_sum_over(d: dict, env: dict, files: _Files) -> Any:
    """The sum of <pointer>/<key><tail> over the keys at <pointer>."""
    rel_, ptr = _fill(d["file"], env), _fill(d["pointer"], env, escape=True)
    return sum(files.get(rel_, f"{ptr}/{claims.escape_token(k)}{d.get('tail', '')}") for k in files.get(rel_, ptr))


def op_clopper_pearson(d: dict, env: dict, files: _Files) -> list[float]:
    return stats.clopper_pearson(int(derive(d["k"], env, files)), int(derive(d["n"], env, files)))


def op_from_env(d: dict, env: dict, files: _Files) -> Any:
    return derive(env[d["key"]]["derived"], env, files)


OPS: dict[str, Callable[[dict, dict, _Files], Any]] = {
    "value": op_value, "count_rows": op_count_rows, "len": op_len, "product": op_arithmetic,
    "difference": op_arithmetic, "ratio": op_arithmetic, "sum": op_arithmetic, "sum_over": op_sum_over,
    "clopper_pearson": op_clopper_pearson, "from_env": op_from_env}


def derive(d: dict, env: dict, files: _Files) -> Any:
    if d["op"] not in OPS:
        raise PublishedCheckError(f"paper/claims.yaml published: unknown op {d['op']!r}; one of {', '.join(OPS)}")
    return OPS[d["op"]](d, env, files)


def _envs(foreach: Optional[dict]) -> list[dict]:
    envs: list[dict] = [{}]
    for var, dom in (foreach or {}).items():
        if not isinstance(dom, list):
            raise PublishedCheckError(f"paper/claims.yaml published: foreach {var} must be a list")
        envs = [{**e, var: v} for e in envs for v in dom]
    return envs


def registry_checks(rd: ReleaseData, specs: list[dict], out: Collector) -> None:
    """The registry's ``published:`` specs, in either layout; an absent input is ABSENT."""
    files = _Files(rd)
    for spec in specs:
        for env in _envs(spec.get("foreach")):
            cid = _fill(spec["id"], env)
            fam = spec.get("family", cid.split(".")[0])
            try:
                pub = op_value(spec["published"], env, files)
                der: Traced = trace(derive, spec["derived"], env, files, modules=OP_MODULES)
                der = Traced(der.value, tuple(c for c in der.calls if c.startswith(f"{__name__}.op_") or via_pipeline([c])))
            except (claims.MissingSource, MissingInput) as e:
                out.absent(cid, fam, e if isinstance(e, MissingInput) else MissingInput(str(e), ""))
                continue
            out.add(cid, fam, pub, der, spec.get("rounding", "exact"), _fill(spec.get("describe", ""), env),
                    tolerance=spec.get("tolerance"), published_rule=spec.get("published_rounding"))
