"""Tool-choice protocols (paper App. G) as episode state machines, and the loop that runs them.

One episode = one question × formulation × schema variant × protocol. The conversation opens with
the agentic system prompt (PROTOCOL §8, verbatim for the Reference formulation) and the bare question
as the user turn; the fixture tool returns the episode's frozen observation (the overwritten tool
return: the near distractor on ``tool_wrong``).

Protocols (only the tool choice varies; ``max_calls`` calls at most, default 1 as the paper's a1/a2/o1)
    ``guided``            a1: the first turn is a *named* call of the tool (vLLM's named
                          ``tool_choice``; in-process, schema-constrained arguments); then
                          ``tool_choice="none"``.
    ``auto``              a2: free choice (``tool_choice="auto"``); after the call, "none".
    ``two_stage``         a4: decide, then call. Stage one asks whether to call the tool (one word,
                          YES or NO; memtoc's wording, :data:`DECISION_PROMPT`) in a request of its
                          own; YES -> a named call on the original conversation, then "none"; NO ->
                          the answer without the tool ("none"); an unreadable decision (T3) is
                          treated as NO.
    ``oracle``            o1: the runtime injects one synthetic call built from the schema
                          (``tools.oracle_arguments``), executes it, and the model answers ("none").
    ``auto_constrained``  the repair arm: ``auto``'s weights and prompt, the call's arguments decoded
                          under the schema grammar (``ChatRequest.constrained``).

Terminations (one per episode; PROTOCOL §8's loop termination, :data:`TERMINATION_RULES`)
    ``final``         an assistant turn without a call: its content is the answer. Exception (§8):
                      a1 - the guided protocol, ``tool_choice`` "required" before any call - with the
                      tool available and no call made yet ends ``invalid_call``; two_stage after YES
                      asks for the same forced call and ends the same way.
    ``invalid_call``  a call that does not parse (T2), more than one call in a turn, a call that
                      fails validation (name, JSON object, ``jsonschema``), or the §8 exception above;
                      no recovery turn (only the paper's a3 recovers, and memtoc does not run a3).
    ``max_calls``     a call after the call budget was spent (a runtime that does not enforce "none").
    ``max_tokens``    the episode's output tokens reached ``max_tokens_per_episode`` (checked first,
                      after every turn; PROTOCOL §8).

Mechanisms (flags per episode; several may hold)
    ``T1``  argument type coercion: a call rejected with at least one type error (``type_errors``
            counts them per call, ``coercible`` those that are strings of the right type).
    ``T2``  unparseable call: a call region that is not JSON / not a call object, or arguments that
            are not a JSON object.
    ``T3``  two-stage decision parse failure (stage one's reply is neither YES nor NO).
    ``T4``  no call where one was expected: the episode ended without any call attempt (every
            protocol but oracle; not counted again when T3 explains it).
    ``other_invalid``  an invalid call that is none of T1/T2 (wrong name, missing argument, several calls).

Scoring: the final answer's FINAL span (``scoring.extract_final``) against the executed return's
value (``answer_agreement``; the tool value whether or not the tool ran, so an episode that never
calls can agree) and the closed-book span; non-final terminations have no answer (agreement 0).
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Sequence

from memtoc.core.prompts import FINAL_LINE
from memtoc.core.scoring import score_reply
from memtoc.core.vocab import PROTOCOLS
from memtoc.generation.cache import canonical_json, sha256_text
from memtoc.stages.agent.parsers import ToolCall
from memtoc.stages.agent.runtime import (
    ChatRequest,
    ChatResponse,
    Runtime,
    assistant_call_message,
    call_id,
    named_choice,
)
from memtoc.stages.agent.tools import FixtureTool, function_tool, name_of, oracle_arguments, validate_call
from memtoc.stages.agent.traces import Trace, messages_sha256

TERMINATIONS = ("final", "invalid_call", "max_calls", "max_tokens")
#: the termination rules an episode was run under (part of its key: traces written under memtoc's
#: earlier rules, which ended a forced call that never came as ``no_call``, are run again)
TERMINATION_RULES = "protocol-s8"
MECHANISMS = ("T1", "T2", "T3", "T4", "other_invalid")

#: PROTOCOL §8's system prompt of the agentic runtime (verbatim).
AGENT_SYSTEM = ("You are a tool-using question-answering agent. Use only tools that are provided, never invent a "
                "tool result, and decide when enough evidence is available. When you answer, end with one line "
                "beginning 'FINAL: ' followed by the answer.")
_AGENT_LEAD = AGENT_SYSTEM[: AGENT_SYSTEM.index("When you answer")].rstrip()
#: Stage one of two_stage (memtoc's wording; the paper does not print its a4 prompt).
DECISION_PROMPT = ("{question}\n\nBefore you answer, decide whether to call the tool {name}. Reply with one word: "
                   "YES to call it, or NO to answer without it.")
_DECISION = re.compile(r"^[\s\W_]*(yes|no)\b", re.IGNORECASE)


def system_prompt(formulation: str) -> str:
    """The agent's system turn: PROTOCOL §8 for the Reference formulation; the paraphrases swap its
    last sentence for their own FINAL-line sentence (memtoc's choice; the paper's agent loop reports
    two instruction wordings without printing them)."""
    if formulation == "reference":
        return AGENT_SYSTEM
    return f"{_AGENT_LEAD} When you answer, {FINAL_LINE[formulation][0].lower()}{FINAL_LINE[formulation][1:]}"


def parse_decision(text: str) -> Optional[str]:
    """``yes`` / ``no`` from stage one's reply (its first word), else None (T3)."""
    m = _DECISION.match(text or "")
    return m.group(1).lower() if m else None


@dataclass(frozen=True)
class EpisodeSpec:
    """Everything one agent episode depends on."""
    model: str
    protocol: str
    formulation: str
    schema_variant: str
    schema_kind: str
    question_id: str
    qkey: str
    instance_id: int
    question: str
    gold: str
    gold_kind: str
    condition: str
    tool_value: Optional[str]
    observation: Any
    schema: dict
    memory_span: str = ""
    memory_correct: Optional[bool] = None
    mem_absent: bool = False
    max_calls: int = 1
    max_tokens_per_call: int = 64
    max_tokens_per_episode: int = 192
    matcher: str = "paper"
    runtime: str = ""                  # the runtime's identity hash: a changed runtime is a new episode
    termination_rules: str = TERMINATION_RULES

    @property
    def episode_id(self) -> str:
        return f"{self.question_id}|{self.formulation}|{self.schema_variant}|{self.protocol}|{self.condition}"

    @property
    def key(self) -> str:
        return sha256_text(canonical_json(asdict(self)))

    @property
    def tools(self) -> list[dict]:
        return [function_tool(self.schema)]

    def messages(self) -> list[dict]:
        return [{"role": "system", "content": system_prompt(self.formulation)},
                {"role": "user", "content": self.question}]


class EpisodeRun:
    """The state machine of one episode: ``next_request()`` / ``feed(response)`` until ``done``."""

    def __init__(self, spec: EpisodeSpec, attempt: str = ""):
        self.spec = spec
        self.tool = FixtureTool(spec.schema, spec.observation)
        self.name = name_of(spec.schema)
        self.messages: list[dict] = spec.messages()
        self.turn = 0
        self.tokens = 0
        self.calls_made = 0            # executed calls
        self.call_attempts = 0         # validated (parsed) calls + unparseable call regions
        self.type_errors: list[int] = []
        self.coercible = 0
        self.flags = {m: False for m in MECHANISMS}
        self.stage = "decide" if spec.protocol == "two_stage" else "act"
        self.decision: Optional[str] = None
        self.forced_next = spec.protocol == "guided"
        self.pending: Optional[ChatRequest] = None
        self.record: Optional[dict] = None
        self.events: list[dict] = []
        self.seconds = 0.0
        self._start()

    # -- events ------------------------------------------------------------------------------------
    def _ev(self, _event: str, **kw) -> None:
        self.events.append({"event": _event, "episode": self.spec.key, "episode_id": self.spec.episode_id,
                            "turn": self.turn, **kw})

    def take_events(self) -> list[dict]:
        ev, self.events = self.events, []
        return ev

    @property
    def done(self) -> bool:
        return self.record is not None

    def _start(self) -> None:
        s = self.spec
        self._ev("start", model=s.model, protocol=s.protocol, formulation=s.formulation,
                 schema_variant=s.schema_variant, schema_kind=s.schema_kind, question_id=s.question_id,
                 qkey=s.qkey, condition=s.condition, tool_value=s.tool_value, schema=s.schema,
                 observation=s.observation, messages=self.messages, tools_sha256=messages_sha256(s.tools),
                 budgets={"max_calls": s.max_calls, "max_tokens_per_call": s.max_tokens_per_call,
                          "max_tokens_per_episode": s.max_tokens_per_episode})
        if s.protocol == "oracle":
            args = oracle_arguments(s.schema, s.question)
            call = ToolCall(self.name, args, json.dumps({"name": self.name, "arguments": args}, ensure_ascii=False))
            self._ev("response", source="oracle", text="", content="", calls=[call.to_dict()], parse_error=None,
                     n_new_tokens=0)
            if not self._handle_calls([call], raw=None, content=""):
                return
        self._queue()

    # -- requests ------------------------------------------------------------------------------------
    def _tool_choice(self) -> Any:
        if self.stage == "decide":
            return "none"
        if self.forced_next:
            return named_choice(self.name)
        if self.stage == "answer" or self.calls_made >= self.spec.max_calls or self.spec.protocol == "oracle":
            return "none"
        if self.spec.protocol in ("auto", "auto_constrained"):
            return "auto"
        return "none"      # guided / two_stage after their call; oracle

    def _queue(self) -> None:
        s = self.spec
        remaining = s.max_tokens_per_episode - self.tokens
        limit = max(1, min(s.max_tokens_per_call, remaining))
        if self.stage == "decide":
            msgs = [self.messages[0], {"role": "user", "content": DECISION_PROMPT.format(question=s.question,
                                                                                        name=self.name)}]
        else:
            msgs = list(self.messages)
        choice = self._tool_choice()
        self.pending = ChatRequest(msgs, s.tools, choice, limit,
                                   constrained=(s.protocol == "auto_constrained" and choice == "auto"))
        self.turn += 1
        self._ev("request", stage=self.stage, tool_choice=choice, max_tokens=limit,
                 constrained=self.pending.constrained, n_messages=len(msgs), messages_sha256=messages_sha256(msgs),
                 last_message_sha256=messages_sha256(msgs[-1]), tools_sha256=messages_sha256(s.tools))

    def next_request(self) -> Optional[ChatRequest]:
        return None if self.done else self.pending

    # -- responses -----------------------------------------------------------------------------------
    def feed(self, r: ChatResponse) -> None:
        if self.done or self.pending is None:
            raise RuntimeError("feed() on a finished episode")
        req, self.pending = self.pending, None
        self.tokens += int(r.n_new_tokens)
        self.seconds += float(r.seconds)
        self._ev("response", stage=self.stage, text=r.text, content=r.content, calls=[c.to_dict() for c in r.calls],
                 parse_error=r.parse_error, opened=r.opened, n_prompt_tokens=r.n_prompt_tokens,
                 n_new_tokens=r.n_new_tokens, tokens_so_far=self.tokens, finish=r.finish, cached=r.cached,
                 prompt_sha256=r.prompt_sha256, constrained_tokens=r.constrained_tokens,
                 call_text_ignored=r.call_text_ignored, seconds=round(r.seconds, 6))
        if self.tokens >= self.spec.max_tokens_per_episode:
            self._finish("max_tokens", r)
            return
        if self.stage == "decide":
            self.decision = parse_decision(r.text)
            self._ev("decision", parsed=self.decision, text=r.text)
            if self.decision is None:
                self.flags["T3"] = True
            if self.decision == "yes":
                self.stage, self.forced_next = "act", True
            else:
                self.stage = "answer"
            self._queue()
            return
        if r.parse_error is not None:
            self.call_attempts += 1
            self.flags["T2"] = True
            self._finish("invalid_call", r, why=f"unparseable call: {r.parse_error}")
            return
        if r.calls:
            if self.calls_made >= self.spec.max_calls:
                self.call_attempts += len(r.calls)
                self._finish("max_calls", r, why="a call after the call budget was spent")
                return
            if req.tool_choice == "none":
                self.call_attempts += len(r.calls)
                self.flags["other_invalid"] = True
                self._finish("invalid_call", r, why="a call where tool_choice was none")
                return
            self._handle_calls(r.calls, raw=r.text, content=r.content)
            if not self.done:
                self._queue()
            return
        if self.forced_next:     # PROTOCOL §8: a1 with a tool available and no call made yet
            self._finish("invalid_call", r, why="no call where the protocol requires one (PROTOCOL §8: a1 "
                                                "before any call ends invalid_call)")
            return
        self._finish("final", r)

    def _handle_calls(self, calls, raw: Optional[str], content: str) -> bool:
        """Validate and execute a turn's calls; False (and a termination) when they are rejected."""
        self.call_attempts += len(calls)
        if len(calls) > 1:
            self.flags["other_invalid"] = True
            for c in calls:
                chk = validate_call(c.name, c.arguments, self.spec.schema)
                self.type_errors.append(chk.type_errors)
                self._ev("validation", name=c.name, arguments=c.arguments, **chk.to_dict())
            self._finish("invalid_call", None, why=f"{len(calls)} calls in one turn (one allowed)")
            return False
        c = calls[0]
        chk = validate_call(c.name, c.arguments, self.spec.schema)
        self.type_errors.append(chk.type_errors)
        self.coercible += chk.coercible
        self._ev("validation", name=c.name, arguments=c.arguments, **chk.to_dict())
        if not chk.ok:
            if chk.type_errors:
                self.flags["T1"] = True
            elif chk.kind == "not_object":
                self.flags["T2"] = True
            else:
                self.flags["other_invalid"] = True
            self._finish("invalid_call", None, why="; ".join(chk.errors))
            return False
        res = self.tool.execute(c.arguments)
        self.calls_made += 1
        cid = call_id(self.calls_made - 1)
        self.messages.append(assistant_call_message(content, [c], raw, first_id=self.calls_made - 1))
        self.messages.append({"role": "tool", "tool_call_id": cid, "name": self.name, "content": res.content})
        self._ev("execution", name=c.name, arguments_sha256=sha256_text(canonical_json(c.arguments)), **res.to_dict())
        self.forced_next = False
        return True

    # -- the end ------------------------------------------------------------------------------------
    def _finish(self, termination: str, r: Optional[ChatResponse], why: str = "") -> None:
        s = self.spec
        final_text = r.content if (termination == "final" and r is not None) else ""
        sc = score_reply(final_text if termination == "final" else "", s.gold, s.tool_value, s.memory_span,
                         matcher=s.matcher, gold_kind=s.gold_kind)
        attempted = self.call_attempts > 0
        if not attempted and s.protocol != "oracle" and not self.flags["T3"]:
            self.flags["T4"] = True
        if termination == "invalid_call" and attempted and not (self.flags["T1"] or self.flags["T2"]):
            self.flags["other_invalid"] = True
        self.pending = None
        self.record = {
            "model": s.model, "protocol": s.protocol, "formulation": s.formulation, "schema_variant": s.schema_variant,
            "schema_kind": s.schema_kind, "question_id": s.question_id, "qkey": s.qkey, "instance_id": s.instance_id,
            "condition": s.condition, "gold": s.gold, "tool_value": s.tool_value, "memory_span": s.memory_span,
            "memory_correct": s.memory_correct, "mem_absent": s.mem_absent,
            "termination": termination, "why": why, "final_text": final_text, "extracted": sc["extracted"],
            "agreement": bool(termination == "final" and sc["followed_tool"]),
            "kept_memory": bool(termination == "final" and sc["kept_memory"]),
            "final_correct": bool(termination == "final" and sc["final_correct"]),
            "abstain": bool(termination == "final" and sc["abstain"]),
            "executed": self.calls_made > 0, "n_calls_executed": self.calls_made, "call_attempted": attempted,
            "n_call_attempts": self.call_attempts, "decision": self.decision,
            "mechanisms": dict(self.flags), "type_errors": list(self.type_errors),
            "n_type_errors": int(sum(self.type_errors)), "coercible": self.coercible,
            "turns": self.turn, "tokens": self.tokens, "seconds": round(self.seconds, 6),
        }
        self._ev("termination", **self.record)


def run_episodes(runtime: Runtime, specs: Sequence[EpisodeSpec], trace: Trace,
                 progress: Optional[Callable[[int, int], None]] = None) -> dict[str, Any]:
    """Run every episode not finished in ``trace``, in rounds (one request of every live episode per
    round, batched by the runtime); events are appended after each round. Returns
    ``{"records": [termination records of every spec, in order], "resume": ..., "ran": n}``."""
    finished = trace.open()
    resume = dict(trace.resume_info)
    todo = [EpisodeRun(s, trace.attempt) for s in specs if s.key not in finished]
    if todo:
        trace.append(ev for run in todo for ev in run.take_events())
    live = [r for r in todo if not r.done]
    total, n_done = len(todo), len(todo) - len(live)
    if progress:
        progress(n_done, total)
    while live:
        reqs = [r.next_request() for r in live]
        resps = runtime.chat_many(reqs)
        events = []
        for r, resp in zip(live, resps):
            r.feed(resp)
            events += r.take_events()
        trace.append(events)
        live = [r for r in live if not r.done]
        if progress:
            progress(total - len(live), total)
    fresh = {r.spec.key: r.record for r in todo}
    records = []
    for s in specs:
        rec = fresh.get(s.key)
        if rec is None:
            rec = {k: v for k, v in finished[s.key].items()
                   if k not in ("event", "episode", "episode_id", "turn", "attempt", "time")}
        records.append(dict(rec, episode_id=s.episode_id))
    return {"records": records, "resume": resume, "ran": len(todo)}
