"""Every extraction / normalisation / matching / abstention rule of PROTOCOL.md §1-§5, with the
concrete examples the protocol gives, plus the opt-in strict matcher's rules."""
from __future__ import annotations

import pytest

from memtoc.core.scoring import (
    canon,
    canon_strict,
    extract_final,
    find_dates,
    is_abstain,
    match,
    memory_status,
    normalize,
    normalize_strict,
    score_reply,
)

# ------------------------------------------------------------------------------------------ §1
EXTRACT_CASES = [
    # 1. empty / None
    (None, ""),
    ("", ""),
    # 2. marker: case-insensitive, anywhere, spaces before the colon, newlines eaten
    ("Some reasoning.\nFINAL: Paris", "Paris"),
    ("final: paris", "paris"),
    ("Final:Paris", "Paris"),
    ("FINAL : Paris", "Paris"),
    ("FINAL:\n\n  Paris  \n", "Paris"),
    ("The semifinal: X", "X"),                         # no word boundary
    ("semifinal: X", "X"),
    # 4. the LAST hit; one line only
    ("FINAL: Rome\nOn reflection:\nFINAL: Paris", "Paris"),
    ("FINAL: Paris\nThis is because ...", "Paris"),
    ("Answer below.\nFINAL:", ""),                     # nothing follows the marker
    ("FINAL:   \n \n", ""),
    # 3. quoted-marker filter: a hit right after a quote char is a mention
    ("I must end with 'FINAL: ' and my answer.\nFINAL: Rome", "Rome"),
    ("FINAL: Rome\nas asked, the line starts with 'FINAL: answer'", "Rome"),
    ('FINAL: Rome\nthe prompt said "FINAL: x"', "Rome"),
    ("FINAL: Rome\nthe prompt said \u2018FINAL: x\u2019", "Rome"),
    ("FINAL: Rome\nthe prompt said \u2019FINAL: x", "Rome"),
    ("FINAL: Rome\nthe prompt said \u201cFINAL: x\u201d", "Rome"),
    ("FINAL: Rome\nthe prompt said \u201dFINAL: x", "Rome"),
    ("FINAL: Rome\nthe prompt said `FINAL: x`", "Rome"),
    ("The format is 'FINAL: x'", "x'"),               # every hit quoted: all kept
    ("(FINAL: Rome", "Rome"),                          # '(' is not a quote char
    # 7. markdown is not cleaned here
    ("**FINAL:** Jewel", "** Jewel"),
    ("FINAL: **Jewel Staite**.", "**Jewel Staite**."),
    # 5. placeholder echo
    ("FINAL: <answer> Paris", "Paris"),
    ("FINAL: <ANSWER>Paris", "Paris"),
    ("It is Paris.\nFINAL: <answer>", "It is Paris."),
    ("It is Paris. FINAL: <answer>", "It is Paris."),   # same line, before the marker
    ("FINAL: <answer>", ""),                           # nothing before the marker
    ("FINAL: <answer>\nParis", ""),                    # the line after is not consulted
    ("Paris\n\nFINAL: <answer>   ", "Paris"),
    # 6. no marker: last line, loop-truncation fix
    ("Paris", "Paris"),
    ("I think...\n\n  Paris  \n\n", "Paris"),
    ("   \n  \t", ""),                                 # no non-empty line: the stripped text
    ("The answer is Jewel Staite\nThe answer is Jewel Staite\nThe answer is Jew",
     "The answer is Jewel Staite"),
    ("Jewel Staite plays\nJewel Staite plays Kaylee\nJewel Staite", "Jewel Staite plays Kaylee"),
    ("Paris\nParis", "Paris"),                          # identical lines are skipped
    ("Paris is big\nRome", "Rome"),                     # not a prefix: last line kept
    ("ab\nxyz\na", "ab"),                              # the first match scanning bottom-up
]


@pytest.mark.parametrize("text,expected", EXTRACT_CASES)
def test_extract_final(text, expected):
    assert extract_final(text) == expected


@pytest.mark.parametrize("text,expected", [
    # gemma-3-270m (a base model, first-line replies) labels its answer
    ("Answer: 1851", "1851"),
    ("Answer: The film was directed by", "The film was directed by"),
    ("answer:1851", "1851"),
    ("A: Paris", "A: Paris"),                        # an option label in multiple choice; canon drops "a"
    ("Final answer: Paris", "Paris"),               # not a FINAL marker (the colon must follow "final")
    ("FINAL ANSWER : Paris", "Paris"),
    ("**Answer:** Paris", "** Paris"),               # markdown stays (PROTOCOL §1.7), the label goes
    ("Reasoning.\nFINAL: Answer: Paris", "Paris"),   # behind the marker too
    ("Answer:", ""),                                 # a label alone is no answer
    ("Answers: many", "Answers: many"),              # only the exact labels
    ("Answering machine", "Answering machine"),
    ("Alabama: the state", "Alabama: the state"),
])
def test_extract_final_drops_a_leading_answer_label(text, expected):
    assert extract_final(text) == expected


def test_answer_label_reaches_every_span_consumer():
    """The base model's labelled closed-book reply: the memory span, memory correctness and the
    kept-memory match all see the answer without its label (memory_status / score_reply share
    extract_final); a with-tool reply that is only the label does not 'keep' that memory."""
    span, absent, correct = memory_status("Answer: 1851", "1851")
    assert (span, absent, correct) == ("1851", False, True)
    assert memory_status("Answer:", "1851") == ("", True, None)
    s = score_reply("Answer:", "1851", "1850", span)
    assert s["extracted"] == "" and not s["kept_memory"] and s["outcome"] == "neither"
    s = score_reply("Answer: 1851", "1851", "1850", span)
    assert s["extracted"] == "1851" and s["kept_memory"] and not s["followed_tool"]


# ------------------------------------------------------------------------------------------ §2
@pytest.mark.parametrize("raw,expected", [
    (None, ""),
    ("Pérez", "pe rez"),
    ("naïve", "nai ve"),
    ("Ōsaka", "o saka"),
    ("José", "jose"),                       # a final accent just disappears
    ("Sørensen", "sørensen"),               # no decomposition: kept
    ("Œuvre", "œuvre"),
    ("\ufb01ne", "fine"),                   # ligature expanded
    ("O'Brien", "o brien"),
    ("Sci-fi", "sci fi"),
    ("1,000", "1 000"),
    ("St. Louis", "st louis"),
    ("Sing (2016 American film)", "sing 2016 american film"),
    ("  Hello,   WORLD!! ", "hello world"),
    ("snake_case", "snake_case"),           # '_' is a word character
])
def test_normalize(raw, expected):
    assert normalize(raw) == expected


@pytest.mark.parametrize("raw,expected", [
    ("The Beatles", "beatles"),
    ("A", ""), ("the", ""), ("An", ""),
    ("St. Louis", "saint louis"),
    ("Mt. Everest", "mount everest"),
    ("Mount Everest", "mount everest"),
    ("Street", "street"),                   # only the st / mt tokens are aliased
    ("Anne of the Island", "anne of island"),
])
def test_canon(raw, expected):
    assert canon(raw) == expected


# ------------------------------------------------------------------------------------------ §3
@pytest.mark.parametrize("answer,target,expected", [
    # (a) character-level bidirectional containment on canonical forms
    ("Paris", "Parish", True),
    ("Parish", "Paris", True),
    ("Jo", "John Smith", True),
    ("Ann", "Joanne", True),
    ("Sing 2", "Sing (2016 American film)", True),
    ("Blackpool", "Stanley Park, Blackpool", True),
    ("Blackpool", "Moor Park, Blackpool", True),
    ("1950", "March 3, 1950", True),
    ("The park was designed by Thomas Mawson in 1908.", "Thomas Mawson", True),
    ("the beatles", "Beatles", True),
    ("St Louis", "Saint Louis", True),
    ("Pérez", "Perez", False),               # accent splitting: "pe rez" vs "perez"
    ("Perez", "Pérez", False),
    ("José", "Jose", True),                  # a final accent disappears
    ("Rome", "Paris", False),
    ("Paris", "The", False),                 # the target canonicalises to ""
    ("A", "Anna", False),                    # an article-only answer never matches
    ("", "Paris", False),
    (None, "Paris", False),
    ("Paris", None, False),
    # (b) parenthetical alias in the ANSWER, alias prefixes stripped
    ("Samuel Clemens (Mark Twain)", "Mark Twain Jr.", True),
    ("Norma Jeane (born Marilyn Monroe)", "Marilyn Monroe Estate", True),
    ("Norma Jeane (Born  Marilyn Monroe)", "Marilyn Monroe Estate", True),
    ("N. J. (née Marilyn Monroe)", "Marilyn Monroe Estate", True),
    ("N. J. (nee Marilyn Monroe)", "Marilyn Monroe Estate", True),
    ("N. J. (formerly Marilyn Monroe)", "Marilyn Monroe Estate", True),
    ("N. J. (aka Marilyn Monroe)", "Marilyn Monroe Estate", True),
    ("N. J. (a.k.a. Marilyn Monroe)", "Marilyn Monroe Estate", True),
    ("N. J. (also known as Marilyn Monroe)", "Marilyn Monroe Estate", True),
    ("N. J. (known as Marilyn Monroe)", "Marilyn Monroe Estate", False),   # not an alias prefix
    ("Norma ((Marilyn Monroe))", "Marilyn Monroe Estate", True),           # innermost group
    ("Mark Twain", "Samuel Clemens (Mark Twain)", True),                    # plain containment
    # (c) inverted "Name, Title" target: head of >= 2 tokens
    ("George Villiers, Duke", "George Villiers, 1st Duke of Buckingham", True),
    ("Stanley Park, Vancouver", "Stanley Park, Blackpool", True),
    ("Paris, Texas", "Paris, France", False),                              # 1-token head
    ("Villiers Duke", "George Villiers, 1st Duke of Buckingham", False),
    # (d) bare-date equivalence
    ("1950-03-03", "March 3, 1950", True),
    ("3 March 1950", "March 3, 1950", True),
    ("March 3, 1950", "1950-03-03", True),
    ("3 March 1950", "1950-3-3", True),
    ("3rd March, 1950", "1950-03-03", True),
    ("Mar. 3rd 1950", "1950-03-03", True),
    ("MARCH 3, 1950", "1950-03-03", True),
    ("Born 1950-03-03, died 1999-01-01", "March 3, 1950", True),            # extra dates are fine
    ("1950-03-04", "March 3, 1950", False),
    ("March 3,1950", "1950-03-03", False),    # no whitespace after the comma: not a date
    ("1950-03-03", "March 3,1950", False),    # ... nor as a target
    ("Sept 3, 1950", "1950-09-03", False),    # "Sept" is not a month
    ("Sep 3, 1950", "1950-09-03", True),
    ("September 3, 1950", "1950-09-03", True),
    ("1673-05-01", "May 1673", False),        # month-year is not a date
    ("1950-03-03", "March 3, 1950 in Paris", False),                        # target not bare
    ("1950-03-03", "The 3 March 1950", True),                               # rest canon "" (article)
])
def test_match_paper(answer, target, expected):
    assert match(answer, target) is expected
    assert match(answer, target, "paper") is expected


@pytest.mark.parametrize("text,expected", [
    ("1950-03-03", [(1950, 3, 3)]),
    ("March 3, 1950", [(1950, 3, 3)]),
    ("3 March 1950", [(1950, 3, 3)]),
    ("March 3 1950", [(1950, 3, 3)]),
    ("Mar 3 , 1950", [(1950, 3, 3)]),
    ("March 3,1950", []),
    ("Sept 3, 1950", []),
    ("March 32, 1950", []),              # day outside 1..31
    ("February 31, 1950", [(1950, 2, 31)]),   # no calendar check
    ("1950-13-01", []),                  # ISO month must resolve
    ("Monday 3, 1950", []),              # a word that is not a month is left in place
    ("May 1673", []),
    ("1950", []),
    ("x1950-03-03", []),                 # ISO needs word boundaries
    ("3 Mar. 1950 and 1960-01-02", [(1960, 1, 2), (1950, 3, 3)]),   # ISO pattern runs first
])
def test_find_dates(text, expected):
    assert find_dates(text)[0] == expected


def test_find_dates_replaces_recognised_dates_by_space():
    dates, rest = find_dates("on 1950-03-03 in Paris")
    assert dates == [(1950, 3, 3)] and canon(rest) == "on in paris"
    dates, rest = find_dates("Monday 3, 1950")
    assert dates == [] and rest == "Monday 3, 1950"


def test_unknown_matcher_is_a_clear_error():
    from memtoc.core.errors import ConfigError
    with pytest.raises(ConfigError, match="valid matchers are: paper, strict"):
        match("a", "a", "fuzzy")


# ------------------------------------------------------------------------------------------ §4a
ABSTAIN_TRUE = [
    # A1 (word-bounded, anywhere)
    "UNKNOWN", "unknown", "Unknown Soldier", "It is unknown.",
    "I don't know", "I dont know", "I do not know", "She doesn't know", "does not know",
    "I cannot answer that", "I can't determine", "I cant provide it", "cannot say", "can't tell",
    "no information", "No answer", "no idea",
    "not available", "Not sure", "unavailable", "Please rerun the tool", "re-run the tool",
    "I am unable to help", "unable to",
    "NA", "na", "N/A", "n/a.",
    # A2 at the very start
    "I need more information", "need more information to answer", "More information is needed",
    "more information is required",
    # A2 anywhere (word boundary in front)
    "The date cannot be determined", "It can not be found", "could not be verified",
    "cannot be retrieved", "cannot be identified", "cannot be established",
    "The tool does not provide a date", "The output did not specify", "does not mention it",
    "did not contain", "does not allow", "did not state", "did not answer", "does not include",
    "does not identify", "The year is not provided", "not specified", "not mentioned", "not found",
    "not determined", "not known", "not possible to determine",
    "insufficient information", "insufficient data", "the information is insufficient",
    "data is insufficient", "insufficient to answer", "insufficient to determine",
    "The tool does not have enough information", "I do not have enough information",
    "This is not relevant to the question", "no exact match",
    # B at the start
    "I encountered an error while calling the tool", "Unfortunately, I ran into a problem",
    "unfortunately i encountered an issue", "  I ran into an error",
    "Unfortunately, I couldn't find any information", "I could not find any information on that",
    "I cannot find any information", "I can't find any information", "I was unable to find any information",
    "I'm sorry, but I don't have information about that", "Im sorry, I do not have any information",
    "Q: who built it?", "Question: who built it?", "  q: echo",
]
ABSTAIN_FALSE = [
    None, "", "Paris", "Thomas Mawson",
    "stale",                                  # deliberately not an abstention
    "The cached value may be stale",
    "I don\u2019t know",                      # curly apostrophe does not match
    "DNA", "Nathan", "Anna", "banana",
    "no answers",                             # A1 is word-bounded on both sides
    "Sorry, I need more information",         # "need more information" only at the very start
    "The question: who?",                     # B is anchored at the start
    "I'm sorry. I don't have information",    # B3 must stay inside one sentence
    "Later, I encountered an error",          # B1 anchored at the start
    "knownunknowns",
    "not provable",
]


@pytest.mark.parametrize("text", ABSTAIN_TRUE)
def test_is_abstain_true(text):
    assert is_abstain(text) is True


@pytest.mark.parametrize("text", ABSTAIN_FALSE)
def test_is_abstain_false(text):
    assert is_abstain(text) is False


# ------------------------------------------------------------------------------------------ §3-§5
def test_score_followed_tool():
    r = score_reply("The tool says so.\nFINAL: Moor Park, Blackpool", gold="Stanley Park, Blackpool",
                    tool_value="Moor Park, Blackpool", memory="Stanley Park")
    assert r == {"extracted": "Moor Park, Blackpool", "followed_tool": True, "kept_memory": False,
                 "final_correct": False, "abstain": False, "outcome": "followed_tool",
                 "neither_subtype": None}


def test_score_both_is_never_resolved():
    r = score_reply("FINAL: Blackpool", "Stanley Park, Blackpool", "Moor Park, Blackpool",
                    "Stanley Park, Blackpool")
    assert (r["followed_tool"], r["kept_memory"], r["final_correct"], r["outcome"]) == (True, True, True, "both")


def test_score_kept_memory():
    r = score_reply("I recall it.\nFINAL: Thomas Mawson", "Thomas Mawson", "Alfred Perlès", "Thomas Mawson")
    assert r["outcome"] == "kept_memory" and r["final_correct"] and not r["followed_tool"]


def test_score_neither_subtypes():
    r = score_reply("FINAL: UNKNOWN", "Thomas Mawson", "Alfred Perlès", "Thomas Mawson")
    assert (r["outcome"], r["neither_subtype"], r["abstain"]) == ("neither", "abstain", True)
    r = score_reply("FINAL: Bob", "Thomas Mawson", "Alfred Perlès", "Thomas Mawson")
    assert (r["outcome"], r["neither_subtype"], r["abstain"]) == ("neither", "other", False)


def test_score_abstain_is_computed_for_every_outcome():
    r = score_reply("FINAL: Tomb of the Unknown Soldier", "Arlington", "Tomb of the Unknown Soldier", "")
    assert r["outcome"] == "followed_tool" and r["abstain"] is True and r["neither_subtype"] is None


def test_score_tool_error_never_follows_tool():
    r = score_reply("FINAL: upstream database temporarily unavailable", "Paris", None, "Paris")
    assert r["followed_tool"] is False and r["abstain"] is True and r["outcome"] == "neither"


def test_score_absent_memory_is_empty_span():
    r = score_reply("FINAL: UNKNOWN", "Paris", None, "UNKNOWN")
    assert r["kept_memory"] is False and r["outcome"] == "neither"
    r = score_reply("FINAL: Paris", "Paris", "Rome", "")
    assert r["kept_memory"] is False
    r = score_reply("FINAL: Paris", "Paris", "Rome", None)
    assert r["kept_memory"] is False and r["final_correct"] is True


def test_score_kept_memory_depends_on_wording():
    mem = "Jewel Staite plays Kaylee Frye in the series 'Firefly'."
    assert score_reply("FINAL: Jewel Staite", "Jewel Staite", "Summer Glau", mem)["kept_memory"]
    r = score_reply("FINAL: The actress that plays Kaylee Frye in Firefly is Jewel Staite.",
                    "Jewel Staite", "Summer Glau", mem)
    assert r["kept_memory"] is False and r["final_correct"] is True


@pytest.mark.parametrize("reply,gold,expected", [
    ("Thinking...\nFINAL: Mawson", "Thomas Mawson", ("Mawson", False, True)),   # surname counts
    ("FINAL: Alfred", "Thomas Mawson", ("Alfred", False, False)),
    ("FINAL: UNKNOWN", "Thomas Mawson", ("UNKNOWN", True, None)),
    ("FINAL: Not sure, maybe Paris", "Paris", ("Not sure, maybe Paris", True, None)),
    ("FINAL:", "Paris", ("", True, None)),
    ("", "Paris", ("", True, None)),
    (None, "Paris", ("", True, None)),
])
def test_memory_status(reply, gold, expected):
    assert memory_status(reply, gold) == expected


# ------------------------------------------------------------------------------------------ strict
def test_strict_s1_accent_folding():
    assert normalize_strict("Pérez") == "perez" and normalize_strict("Sørensen") == "sorensen"
    assert normalize_strict("Straße") == "strasse" and normalize_strict("Ōsaka") == "osaka"
    assert canon_strict("The Æther") == "aether"
    assert match("Perez", "Pérez", "strict") and match("Pérez", "Perez", "strict")
    assert match("Sorensen", "Sørensen", "strict")
    assert not match("Perez", "Pérez", "paper")


@pytest.mark.parametrize("answer,target,expected", [
    ("Paris", "Parish", False),                  # S2 word boundaries
    ("Jo", "John Smith", False),
    ("Ann", "Joanne", False),
    ("Paris", "Paris", True),
    ("the beatles", "Beatles", True),
    ("It was Jewel Staite.", "Jewel Staite", True),          # S3 verbose complete answer
    ("Jewel", "Jewel Staite", False),                        # S4 partial
    ("Blackpool", "Stanley Park, Blackpool", False),
    ("Stanley Park", "Stanley Park, Blackpool", True),       # S4a head
    ("Paris", "Paris, France", True),                        # S4a: any head length
    ("Paris, Texas", "Paris, France", False),
    ("Sing", "Sing (2016 American film)", True),             # S4b disambiguator
    ("Sing 2", "Sing (2016 American film)", False),
    ("1950", "1950", True),                                  # S6 years and dates
    ("1950", "March 3, 1950", False),
    ("March 1950", "March 3, 1950", False),
    ("March 3, 1950", "1950", True),
    ("3 March 1950", "1950-03-03", True),
    ("March 3,1950", "1950-03-03", True),
    ("Sept 3, 1950", "1950-09-03", True),
    ("1950-03-04", "1950-03-03", False),
    ("Samuel Clemens (Mark Twain)", "Mark Twain", True),     # S7 alias
    ("N. J. (born Marilyn Monroe)", "Marilyn Monroe", True),
    ("", "Paris", False),
    ("Paris", "", False),
])
def test_strict_match(answer, target, expected):
    assert match(answer, target, "strict") is expected


@pytest.mark.parametrize("answer,target,expected", [
    ("Mawson", "Thomas Mawson", True),                   # surname = last token
    ("Thomas", "Thomas Mawson", False),                  # first name alone does not
    ("Smith", "John Michael Smith", True),
    ("Michael", "John Michael Smith", False),
    ("John Smith", "John Michael Smith", True),          # middle names dropped
    ("Michael Smith", "John Michael Smith", False),      # first token missing
    ("Villiers", "George Villiers, 1st Duke of Buckingham", True),   # surname of the head
    ("Mawson", "Mawson", True),
])
def test_strict_person_rule(answer, target, expected):
    assert match(answer, target, "strict", kind="person") is expected


def test_strict_person_rule_needs_the_kind():
    assert not match("Mawson", "Thomas Mawson", "strict")
    assert not match("York", "New York", "strict", kind="place")
    assert match("Mawson", "Thomas Mawson", "paper", kind="place")   # paper ignores kind


def test_score_reply_strict_changes_decisions():
    args = ("FINAL: Paris", "Parish", "Parisville", "")
    assert score_reply(*args)["final_correct"] and score_reply(*args)["followed_tool"]
    r = score_reply(*args, matcher="strict")
    assert not r["final_correct"] and not r["followed_tool"] and r["outcome"] == "neither"
    assert memory_status("FINAL: Mawson", "Thomas Mawson", "strict", gold_kind="person") == ("Mawson", False, True)
    assert memory_status("FINAL: Mawson", "Thomas Mawson", "strict") == ("Mawson", False, False)


# ------------------------------------------------------------------------------------------ data
def test_every_benchmark_gold_matches_itself_and_is_not_an_abstention():
    import json

    from memtoc.config.params import resolve_release_dir
    path = resolve_release_dir() / "questions_575.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert len(rows) == 575
    for r in rows:
        g = r["gold_answer"]
        assert match(g, g), g
        assert match(g, g, "strict", kind=r["gold_kind"]), g
        assert not is_abstain(g), g
        assert extract_final(f"Reasoning.\nFINAL: {g}\n") == g.strip()


def test_paper_alias_rule_lets_a_shared_disambiguator_match():
    """A surprising consequence of rule (b) on the real benchmark: the answer's "(film)" group is an
    alias whose canonical form "film" is contained in the target. strict does not do this."""
    assert match("The Children Act (film)", "On Chesil Beach (film)")
    assert not match("The Children Act (film)", "On Chesil Beach (film)", "strict", kind="work")
    # the release labels "Boy (album)" as a person: the person rule must not accept "album"
    assert not match("October (album)", "Boy (album)", "strict", kind="person")
