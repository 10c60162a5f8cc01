"""Generation cache: keys, append + fsync, truncated last line, sibling reuse (pure, no model)."""
import json
import warnings

import pytest
from conftest import ScriptedGenerator

from memtoc.generation import cache


def rec(k, text="t"):
    return {"key": k, "prompt_sha256": "p", "text": text, "n_prompt_tokens": 3, "n_new_tokens": 2,
            "seconds": 0.1}


def test_request_key_depends_on_identity_and_prompt():
    a = cache.request_key({"model": "m", "decoding": {"max_new_tokens": 8}}, "hello")
    assert a == cache.request_key({"decoding": {"max_new_tokens": 8}, "model": "m"}, "hello")  # order-free
    assert a != cache.request_key({"model": "m", "decoding": {"max_new_tokens": 9}}, "hello")
    assert a != cache.request_key({"model": "m2", "decoding": {"max_new_tokens": 8}}, "hello")
    assert a != cache.request_key({"model": "m", "decoding": {"max_new_tokens": 8}}, "hello ")


def test_append_and_read(tmp_path):
    p = tmp_path / "g" / "arm.jsonl"
    cache.append_records(p, [rec("a"), rec("b")])
    cache.append_records(p, [rec("c", "ü")])
    got = cache.read_cache(p)
    assert list(got) == ["a", "b", "c"] and got["c"]["text"] == "ü"
    assert p.read_text(encoding="utf-8").count("\n") == 3


def test_truncated_last_line_ignored_then_repaired(tmp_path):
    p = tmp_path / "arm.jsonl"
    cache.append_records(p, [rec("a"), rec("b")])
    with open(p, "ab") as f:
        f.write(b'{"key": "c", "text": "half')  # a kill in the middle of a write
    with pytest.warns(UserWarning, match="truncated last line"):
        got = cache.read_cache(p)
    assert set(got) == {"a", "b"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache.append_records(p, [rec("d")])
    lines = p.read_text().splitlines()
    assert [json.loads(x)["key"] for x in lines] == ["a", "b", "d"]  # the broken tail is gone
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning any more
        assert set(cache.read_cache(p)) == {"a", "b", "d"}


def test_damaged_middle_line_is_dropped_into_rejected_file_others_kept(tmp_path):
    p = tmp_path / "arm.jsonl"
    p.write_text(json.dumps(rec("a")) + "\nnot json\n" + json.dumps(rec("b")) + "\n")
    with pytest.warns(UserWarning, match=r"memtoc cache: .*dropped 1 damaged line\(s\) \(line 2"):
        got = cache.read_cache(p)
    assert set(got) == {"a", "b"}                      # the good lines stay (the file is not moved aside)
    assert cache.rejected_path(p).read_text() == "not json\n"
    assert [json.loads(x)["key"] for x in p.read_text().splitlines()] == ["a", "b"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # repaired: no warning any more
        assert set(cache.read_cache(p)) == {"a", "b"}


def test_record_without_text_names_file_and_line(tmp_path):
    p = tmp_path / "arm.jsonl"
    p.write_text(json.dumps(rec("a")) + "\n" + json.dumps({"key": "b", "prompt_sha256": "p"}) + "\n")
    with pytest.raises(cache.CacheError, match=rf"{p.name}:2: cache record has no 'text'"):
        cache.read_cache(p)
    g = CountingGenerator()
    with pytest.raises(cache.CacheError, match=":2:"):   # not a bare KeyError from the generator
        g.generate(["x"], cache_path=p)


def CountingGenerator(batch=2):
    """A deterministic fake backend (upper-cases the prompt) that records what it generated (``seen``)."""
    return ScriptedGenerator(str.upper, identity={"model": "fake", "decoding": {"max_new_tokens": 4}}, batch=batch,
                             n_prompt_tokens=1, n_new_tokens=1)


def test_generate_skips_cached_and_dedups(tmp_path):
    g = CountingGenerator()
    p = tmp_path / "m" / "arm.jsonl"
    r1 = g.generate(["a", "b", "a", "c"], cache_path=p)
    assert [r.text for r in r1] == ["A", "B", "A", "C"]
    assert g.seen == ["a", "b", "c"]  # duplicates generated once
    r2 = g.generate(["c", "d", "a"], cache_path=p)
    assert [r.text for r in r2] == ["C", "D", "A"]
    assert [r.cached for r in r2] == [True, False, True]
    assert g.seen == ["a", "b", "c", "d"]
    assert len(p.read_text().splitlines()) == 4


def test_generate_reuses_sibling_file_and_copies(tmp_path):
    g = CountingGenerator()
    g.generate(["x", "y"], cache_path=tmp_path / "m" / "closed_book_forced__reference.jsonl")
    other = tmp_path / "m" / "untreated__reference.jsonl"
    r = g.generate(["y", "z"], cache_path=other)
    assert [x.cached for x in r] == [True, False]
    assert g.seen == ["x", "y", "z"]
    assert len(cache.read_cache(other)) == 2  # the reused reply was copied: each arm file is complete


def test_identity_change_regenerates(tmp_path):
    p = tmp_path / "m" / "arm.jsonl"
    g = CountingGenerator()
    g.generate(["a"], cache_path=p)
    g2 = CountingGenerator()
    g2.identity = {"model": "fake", "decoding": {"max_new_tokens": 5}}
    r = g2.generate(["a"], cache_path=p)
    assert not r[0].cached and g2.seen == ["a"]


def test_parsable_last_line_without_newline_is_kept(tmp_path):
    p = tmp_path / "arm.jsonl"
    p.write_text(json.dumps(rec("a")) + "\n" + json.dumps(rec("b")))  # complete, newline lost
    with pytest.warns(UserWarning, match="no newline"):
        assert set(cache.read_cache(p)) == {"a", "b"}
    cache.append_records(p, [rec("c")])
    assert [json.loads(x)["key"] for x in p.read_text().splitlines()] == ["a", "b", "c"]


def test_truncated_only_line(tmp_path):
    p = tmp_path / "arm.jsonl"
    p.write_bytes(b'{"key": "a", "te')
    cache.append_records(p, [rec("b")])
    assert [json.loads(x)["key"] for x in p.read_text().splitlines()] == ["b"]
