"""transformers backend: greedy, batched, left-padded, shared prefixes computed once; replies that
do not depend on the batch (float32 on CPU, with a canonical tie-break).

Batch invariance (``dtype="auto"`` on CPU = float32, ``tie_margin``): a reply must not depend on
which other prompts share its batch (batch size, order, a resume, a cache repair), since the cache
key ignores the batch. No CPU kernel guarantees bit-identical rows across batch shapes: measured
here, a float32 ``linear`` row differs in its last bits between 1, 2-15 and 16+ rows, a bf16 one
between <=32 and 33+ rows (lm head), and attention reductions shift with the left padding. In bf16
this moves logits by up to 1.0 (same prompts, different batches) and flips greedy tokens (18 of 90
closed-book replies with ``batch_size=8`` vs ``auto``); in float32 by at most ~4e-5. So float32 is
the CPU default, and a greedy step whose top-2 logit margin is below ``tie_margin`` (default 2e-3
in float32, ~50x the measured batch noise; 0 = off, the default in bf16/fp16, whose noise is too
large to guard) is decided by the *canonical* computation instead: one forward of that row's
prompt + reply so far alone (batch 1, no padding, no cache), which does not depend on the batch.
Every other step has a margin far above the noise, so every composition picks the same token; by
induction the replies are identical (tested: batch sizes, orders, the loop, a repaired cache).
``decode_stats["tie_recomputes"]`` counts the canonical forwards. GPU ``auto`` stays bf16/fp16,
which is not batch-invariant.

Batching: prompts are tokenized once and cut into batches, in token order when shared-prefix
prefill is on (the default with the compact loop: prompts that share a prefix - a formulation's
instruction, a relation's tool schema, a question's conditions - land in the same batch), else
longest first (ties by original order). ``batch_size=int`` fixes the number of prompts per batch;
``batch_size="auto"`` uses a token-budget rule: a batch takes prompts while ``n * (longest prompt +
max_new_tokens)`` stays within ``token_budget`` (default 24576 on CPU, 131072 on GPU) and ``n <=
max_batch`` (64 CPU, 256 GPU); the batches are then evened out (same count, near-equal sizes). Why
large batches on a CPU too: a decode step streams all weights and the live keys / values from
memory whatever the batch, so bigger batches amortize it (and share more prefixes); the budget
bounds memory and the padding / finished-row waste.

Shared-prefix prefill (``share_prefix=True``, compact loop only): the batch's prompts are cut into
the segments of a radix tree (:mod:`memtoc.backends.prefix`), each shared run of at least
``min_shared_tokens`` tokens is computed once and its keys / values are copied to every row that
has it (see :meth:`TransformersGenerator._prefill_shared`). On the 64 bench prompts 75 of 191
prompt tokens per episode are computed; on a headline arm (20 questions x 4 conditions x 3
formulations) 37% of them, 1.6x faster end to end. Same maths as the plain prefill, so float32
replies are identical (tested); in bfloat16 the different matrix shapes round differently and flip
near-tie greedy tokens about as often as changing the batch composition does (measured on 120
episodes: 86 of 120 plain-bf16 and 88 of 120 shared-bf16 replies equal the float32 reply). Like the
batch size it is therefore not part of the cache identity.

Attention (``attention="auto"``, :func:`memtoc.backends.attention.attention_implementation`): SDPA on GPU; on
CPU ``memtoc_cpu`` = SDPA for the prefill and a plain grouped-query matmul for one-token decode
steps (see :func:`cpu_decode_attention`); ``eager`` on every device for models that soft-cap their
attention logits (gemma-2), as SDPA cannot.

transformers versions: the KV cache is passed under the keyword the loaded model's ``forward``
takes (``cache`` from transformers 5.24, ``past_key_values`` before; an older forward swallows an
unknown ``cache=`` in its ``**kwargs`` and runs without one), and every forward checks that the
cache grew by its input length (:class:`GenerationError` otherwise), so a mismatch can never
silently produce garbage replies.

Sliding-window models (gemma-2, gemma-3: ``layer_types`` with ``sliding_attention``): the compact
loop keeps every key and passes explicit per-layer-type masks (position-based, the window applied
exactly as transformers' ``sliding_window_overlay``: a key is seen when ``q - k < window``) for
the prefills and decode steps. Architectures the compact loop does not reimplement (logits
processors in the generation config, other cache layer kinds, an attention kernel that takes no
4-D mask) use ``model.generate``: logged once at load and recorded in ``info["decode_path"]``.

Early stop (``stop_at_final=True``, part of the decoding settings and so of the cache key): a
sequence is finished once its reply holds a completed ``FINAL:`` answer line (marker, non-empty
answer, newline) or EOS; the batch ends when all its sequences are finished. The protocol's
extractor takes the *last* FINAL marker, so text after the first completed FINAL line could only
matter if a model wrote a second, different FINAL line; ``memtoc bench generation`` measures how
often that changes an extracted answer. ``stop_at_first_line=True`` (the default for base models,
set by ``models.load_generator``): a sequence also ends once its first non-empty line is complete,
the paper's completions default for its base model (``stop=["\\n"]``); a base model otherwise
goes on writing the next "Question: ... Answer: ..." pair and the extractor takes its last line.

Decode loop (``decode="compact"``, the default; ``decode="generate"`` is the former path): greedy
``model.generate`` on a left-padded batch keeps every row decoding until the last row ends (the few
replies that run to ``max_new_tokens`` keep a whole batch of 64 decoding), and its dynamic cache
re-allocates and copies all keys and values at every step. The compact loop does the same greedy
maths by hand: one prefill of the left-padded batch (same inputs, position ids, mask and attention
as ``generate``; or the shared-prefix prefill above), then one token per step, keys and values
written in place into a buffer sized once (see :func:`_compact_layer_class`); after each step the
finished rows leave the batch (their cache rows, mask rows and position ids). Same tokens, same stop
rule, same ``Reply`` fields, so it is not part of the cache identity:
``tests/test_backends_hf.py`` checks token equality with ``generate`` (float32), and
``memtoc bench generation --compare-decode`` counts the replies that differ in bfloat16.
"""
from __future__ import annotations

import inspect
import logging
import math
import time
from pathlib import Path
from typing import Iterator, Optional

from tqdm.auto import tqdm
from transformers import LogitsProcessor, StoppingCriteria

from ..config import ConfigError, MemtocError
from ..decoding import policy_from_config
from ..gpuenv import release_memory
from ..render import render_prompt
from ..weights import adapter_hash, weights_hash
from .attention import attention_implementation
from .base import Generator, Reply, line_stop
from .prefix import leaves_by_row, prefix_segments
from .prefix import path as prefix_path

log = logging.getLogger(__name__)


CPU_ATTENTION = "memtoc_cpu"
DECODE_LOOPS = ("compact", "generate")
MASK_KERNELS = ("sdpa", CPU_ATTENTION, "eager")   # attention kernels that take the loop's 4-D masks
FLOAT32_TIE_MARGIN = 2e-3   # ~50x the largest float32 logit change between batch compositions (4.4e-5)


class GenerationError(MemtocError):
    """The installed transformers does not run memtoc's decode loop as expected."""


def cache_keyword(model) -> str:
    """The keyword under which ``model.forward`` takes the KV cache: ``cache`` (transformers >= 5.24)
    or ``past_key_values`` (earlier). Read from the signature, never guessed: an unknown keyword
    would land in ``**kwargs`` and the forward would run without a cache."""
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    import transformers
    raise GenerationError(f"{type(model).__name__}.forward (transformers {transformers.__version__}) takes "
                          "neither `cache` nor `past_key_values`; set the transformers backend option "
                          "decode: generate, or install transformers >= 5.20")


def cpu_decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                         scaling=None, is_causal=None, **kwargs):
    """Attention for CPU generation: SDPA for prefill, a plain grouped matmul for one-token decode.

    torch's CPU SDPA kernels are slow for a single query row with a padding mask (measured ~5-14x
    slower than two small matmuls for batch 64, 9 query / 3 key-value heads, 240 keys), and decode
    steps are most of the wall time of short replies. Same maths: scores = q k^T * scale (+ mask),
    softmax in fp32, times v; grouped-query heads share their key/value head without copies.
    """
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (query.shape[2] != 1 or dropout or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None or kwargs.get("sliding_window")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    B, H, _, D = query.shape
    KV, L = key.shape[1], key.shape[2]
    G = H // KV
    scale = scaling if scaling is not None else D ** -0.5
    q = query.reshape(B, KV, G, D)
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * scale          # B, KV, G, L
    if attention_mask is not None:
        m = attention_mask[..., -L:]
        m = m.reshape(B, KV, G, L) if m.shape[1] == H else m.reshape(B, 1, 1, L)
        if m.dtype == torch.bool:
            scores = scores.masked_fill(~m, float("-inf"))
        else:
            scores = scores + m.float()
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)                                          # B, KV, G, D
    return out.reshape(B, H, 1, D).transpose(1, 2).contiguous(), None


def register_cpu_attention() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(CPU_ATTENTION, cpu_decode_attention)
    AttentionMaskInterface.register(CPU_ATTENTION, sdpa_mask)
    return CPU_ATTENTION


def resolve_dtype(dtype: str, device: str):
    import torch
    if dtype == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32  # batch-invariant replies (module docstring); bf16 is faster but is not
    return {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]


def _compact_layer_class():
    """A ``DynamicLayer`` whose keys / values live in one buffer allocated at the prefill (prompt +
    ``max_new_tokens`` columns, the unfilled ones zero); a decode step writes its column in place.
    ``DynamicLayer`` instead concatenates, i.e. allocates and copies the whole cache at every step
    and every layer (60 concatenations of 64 x 3 x 230 x 64 bf16 took ~190 ms on one thread of this
    CPU, on a busy machine).

    A one-token step gets the *whole* buffer of the live rows back, ``buf[:rows]``: contiguous,
    because a view of only the filled columns is strided and the CPU bf16 batched matmul copies a
    strided operand first (measured: 1.48 ms vs 0.54 ms for one layer's decode attention at batch
    64 x 220 keys, i.e. ~28 ms of a ~108 ms step). The compact loop passes a 4-D boolean mask of the
    same width whose unfilled columns are False, and the unfilled keys / values are zeros (a masked
    column then adds exactly nothing). Longer inputs (the prefill, the shared-prefix levels) get the
    filled part, as ``DynamicLayer`` returns it. Finished rows are dropped by moving kept rows into
    their places in place (so ``buf[:rows]`` stays contiguous)."""
    import torch
    from transformers.cache_utils import DynamicLayer

    class CompactLayer(DynamicLayer):
        def __init__(self, capacity: int):
            super().__init__()
            self.capacity = capacity
            self.rows = self.end = 0
            self.buf_k = self.buf_v = None

        def _views(self):
            self.keys = self.buf_k[: self.rows, :, : self.end]
            self.values = self.buf_v[: self.rows, :, : self.end]

        def preload(self, buf_k, buf_v, filled: int) -> None:
            """Start from ready buffers (rows, heads, capacity, dim) whose first ``filled`` columns
            hold the keys / values of the past (the shared-prefix prefill builds them)."""
            buf_k[:, :, filled:].zero_()
            buf_v[:, :, filled:].zero_()
            self.buf_k, self.buf_v = buf_k, buf_v
            self.rows, self.end = buf_k.shape[0], filled
            self.device, self.is_initialized = buf_k.device, True
            self._views()

        def update(self, key_states, value_states, *args, **kwargs):
            T = key_states.shape[-2]
            if self.buf_k is None:  # the prefill: the prompt's keys / values first, the rest zero
                if not self.is_initialized:
                    self.lazy_initialization(key_states, value_states)
                cap = max(self.capacity, T)
                bk = key_states.new_empty(key_states.shape[:2] + (cap, key_states.shape[-1]))
                bv = value_states.new_empty(value_states.shape[:2] + (cap, value_states.shape[-1]))
                bk[:, :, :T] = key_states
                bv[:, :, :T] = value_states
                self.preload(bk, bv, T)
            else:
                if self.end + T > self.buf_k.shape[2]:
                    raise RuntimeError("compact decode cache: capacity exceeded")  # a bug, never user input
                self.buf_k[: self.rows, :, self.end:self.end + T] = key_states
                self.buf_v[: self.rows, :, self.end:self.end + T] = value_states
                self.end += T
                self._views()
            if T == 1:
                return self.buf_k[: self.rows], self.buf_v[: self.rows]
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.end if self.buf_k is not None else 0

        def batch_select_indices(self, indices) -> None:
            """Keep rows ``indices`` (new row j = old row indices[j]). Moves in place when no row
            is both read and overwritten (the hole-filling order of ``_fill_holes``), else copies."""
            if self.buf_k is None:
                return
            order = [int(i) for i in indices]
            moves = [(j, a) for j, a in enumerate(order) if a != j]
            if {j for j, _ in moves} & {a for _, a in moves}:
                idx = torch.tensor(order, device=self.buf_k.device)
                self.buf_k = self.buf_k.index_select(0, idx)
                self.buf_v = self.buf_v.index_select(0, idx)
            else:
                for j, a in moves:
                    self.buf_k[j, :, : self.end].copy_(self.buf_k[a, :, : self.end])
                    self.buf_v[j, :, : self.end].copy_(self.buf_v[a, :, : self.end])
            self.rows = len(order)
            self._views()

    return CompactLayer


def _sliding_window(config) -> Optional[int]:
    """The window of a model with sliding-window layers (``layer_types`` has ``sliding_attention``:
    gemma-2, gemma-3, ...), else None."""
    kinds = getattr(config, "layer_types", None) or []
    w = getattr(config, "sliding_window", None)
    return int(w) if w and "sliding_attention" in kinds else None


def _fill_holes(keep: list[int]) -> list[int]:
    """Old batch positions for the new rows 0..n-1 (``keep`` sorted, n = len(keep)): kept rows below
    n stay where they are, the kept rows at n or above move into the freed places below n. Only as
    many cache rows move as rows finished (each row's maths does not depend on its place in the
    batch)."""
    n = len(keep)
    kept = set(keep)
    movers = iter(a for a in keep if a >= n)
    return [p if p in kept else next(movers) for p in range(n)]


class _StopCriteria(StoppingCriteria):
    """Per-sequence stop: EOS, or a completed FINAL line. Records where each sequence ended."""

    def __init__(self, tokenizer, prompt_len: int, eos_ids: set[int], newline_ids: set[int],
                 check_final: bool, check_first_line: bool = False):
        self.tok = tokenizer
        self.prompt_len = prompt_len
        self.eos_ids = eos_ids
        self.newline_ids = newline_ids
        self.check_final = check_final
        self.check_first_line = check_first_line
        self.end: Optional[list[Optional[int]]] = None
        self.reason: Optional[list[str]] = None

    def __call__(self, input_ids, scores, **kwargs):
        import torch
        B, L = input_ids.shape
        if self.end is None:
            self.end = [None] * B
            self.reason = ["length"] * B
        last = input_ids[:, -1].tolist()
        for i in range(B):
            if self.end[i] is not None:
                continue
            t = last[i]
            if t in self.eos_ids:
                self.end[i] = L - 1
                self.reason[i] = "eos"
            elif (self.check_final or self.check_first_line) and t in self.newline_ids:
                text = self.tok.decode(input_ids[i, self.prompt_len:], skip_special_tokens=True)
                rule = line_stop(text, self.check_final, self.check_first_line)
                if rule:
                    self.end[i] = L
                    self.reason[i] = rule
        return torch.tensor([e is not None for e in self.end], dtype=torch.bool, device=input_ids.device)


class _TieGuard(LogitsProcessor):
    """``generate``'s version of the compact loop's canonical tie-break: a row whose top-2 scores
    are closer than the generator's ``tie_margin`` gets the canonical token (all other scores -inf).
    ``prompts``: each row's prompt ids without padding; ``P``: the padded prompt width."""

    def __init__(self, gen, prompts: list[list[int]], P: int, stop: _StopCriteria):
        self.gen, self.prompts, self.P, self.stop = gen, prompts, P, stop

    def __call__(self, input_ids, scores):
        for i in self.gen._near_ties(scores):
            if self.stop.end is not None and self.stop.end[i] is not None:
                continue  # a finished row: its later tokens are discarded
            t = self.gen._canonical_next(self.prompts[i] + input_ids[i, self.P:].tolist())
            scores[i] = float("-inf")
            scores[i, t] = 0.0
        return scores


class TransformersGenerator(Generator):
    backend = "transformers"

    def __init__(self, spec, path: Path, adapter=None, batch_size="auto", dtype="auto",
                 max_new_tokens: int = 48, cache_dir=None, stop_at_final: bool = True,
                 stop_at_first_line: bool = False, device: Optional[str] = None, token_budget: Optional[int] = None,
                 max_batch: Optional[int] = None, num_threads: Optional[int] = None,
                 attention: str = "auto", show_progress: bool = True, decode: str = "compact",
                 share_prefix: bool = True, min_shared_tokens: int = 8, prefill_tokens: Optional[int] = None,
                 tie_margin: Optional[float] = None):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


        if num_threads:
            torch.set_num_threads(int(num_threads))
        self.spec = spec
        self.path = Path(path)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.torch_dtype = resolve_dtype(dtype, self.device)
        self.batch_size = batch_size
        self.max_new_tokens = int(max_new_tokens)
        self.stop_at_final = bool(stop_at_final)
        self.stop_at_first_line = bool(stop_at_first_line)
        gpu = self.device.startswith("cuda")
        self.token_budget = int(token_budget or (131072 if gpu else 24576))
        self.max_batch = int(max_batch or (256 if gpu else 64))
        self.show_progress = show_progress
        if decode not in DECODE_LOOPS:
            raise ConfigError(f"transformers backend option decode must be one of {list(DECODE_LOOPS)}, "
                              f"got {decode!r}")
        self.decode = decode
        # counters of the compact loop, summed over calls: batches, decode steps, decoded row-steps,
        # prompt tokens actually run (fewer than given when prefixes are shared), prefill forward calls
        self.decode_stats = {"batches": 0, "row_steps": 0, "steps": 0,
                             "prompt_tokens_computed": 0, "prefill_calls": 0, "tie_recomputes": 0}
        if tie_margin is None:
            tie_margin = FLOAT32_TIE_MARGIN if self.torch_dtype == torch.float32 else 0.0
        if not isinstance(tie_margin, (int, float)) or isinstance(tie_margin, bool) or tie_margin < 0:
            raise ConfigError(f"transformers backend option tie_margin must be a number >= 0, got {tie_margin!r}")
        self.tie_margin = float(tie_margin)
        self.share_prefix = bool(share_prefix)
        self.min_shared_tokens = int(min_shared_tokens)
        self.prefill_tokens = int(prefill_tokens or (32768 if gpu else 8192))

        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        config = AutoConfig.from_pretrained(self.path)
        attention = attention_implementation(config, attention, self.device)
        if attention == CPU_ATTENTION:
            register_cpu_attention()
        self.attention = attention
        model = AutoModelForCausalLM.from_pretrained(self.path, dtype=self.torch_dtype,
                                                     attn_implementation=attention)
        a_hash = None
        if adapter is not None:
            from peft import PeftModel
            model = PeftModel.from_pretrained(model, str(adapter))
            model = model.merge_and_unload()
            a_hash = adapter_hash(adapter)
        self.model = model.to(self.device).eval()
        self.policy = policy_from_config(self.model.generation_config, str(self.path / "generation_config.json"))
        gc = self.model.generation_config
        eos = gc.eos_token_id if gc.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos])
        self.eos_ids.discard(None)
        self.newline_ids = self._newline_token_ids()
        self.cache_kw = cache_keyword(self.model)
        self.sliding_window = _sliding_window(self.model.config)
        why = self._compact_unsupported()
        self._compact_checked = why is None
        # what this generator runs (not part of the cache identity: every path gives the same replies)
        self.info = {"decode_path": self.decode if why is None else "generate", "compact_unsupported": why,
                     "cache_keyword": self.cache_kw, "sliding_window": self.sliding_window,
                     "attention": self.attention}
        if why is not None and self.decode == "compact":
            log.warning("%s: the compact decode loop does not support this model (%s); using "
                        "model.generate", spec.name, why)
        super().__init__({
            "model": spec.name, "weights_sha256": weights_hash(self.path, cache_dir),
            "adapter_sha256": a_hash, "backend": self.backend,
            "prompt_format": {"chat": spec.chat, "system_turn": spec.system_turn},
            "decoding": {"greedy": True, "max_new_tokens": self.max_new_tokens,
                         "stop_at_final": self.stop_at_final, "attention": self.attention,
                         "dtype": str(self.torch_dtype).replace("torch.", ""),
                         "tie_margin": self.tie_margin,
                         # only when on: the cache keys of every existing run stay as they were
                         **({"stop_at_first_line": True} if self.stop_at_first_line else {}),
                         **self.policy.identity()},   # the model's penalties (memtoc.decoding), when it has any
        })

    def close(self) -> None:
        """Drop the model and hand its memory back (a GPU's too), so that the next engine or trainer
        of the run finds it free. Safe to call twice; the generator cannot generate afterwards."""
        if getattr(self, "model", None) is None:
            return
        self.model = None
        release_memory(self.device)

    def _newline_token_ids(self) -> set[int]:
        ids = range(len(self.tokenizer))
        texts = self.tokenizer.batch_decode([[i] for i in ids])
        return {i for i, t in zip(ids, texts) if "\n" in t}

    # -- request building -----------------------------------------------------------------------
    def render(self, prompt: str) -> tuple[str, bool]:
        return render_prompt(self.tokenizer, self.spec, prompt)

    def encode(self, prompts: list[str]) -> list[list[int]]:
        out = []
        for p in prompts:
            text, special = self.render(p)
            out.append(self.tokenizer(text, add_special_tokens=special)["input_ids"])
        return out

    def plan_batches(self, lengths: list[int], prefixes: Optional[list[list[int]]] = None) -> list[list[int]]:
        """Indices grouped into batches (see the module docstring): longest prompts first, or, given
        the prompts' token ids as ``prefixes``, in token order, so that prompts sharing a prefix
        (a formulation's instruction, a relation's schema, a question's conditions) share a batch."""
        if prefixes is None:
            order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        else:
            order = sorted(range(len(lengths)), key=lambda i: (prefixes[i], i))
        if isinstance(self.batch_size, int):
            return [order[k:k + self.batch_size] for k in range(0, len(order), self.batch_size)]

        def fits(n: int, longest: int) -> bool:
            return n <= self.max_batch and n * (longest + self.max_new_tokens) <= self.token_budget

        batches: list[list[int]] = []
        cur: list[int] = []
        longest = 0
        for i in order:
            if cur and not fits(len(cur) + 1, max(longest, lengths[i])):
                batches.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, lengths[i])
        if cur:
            batches.append(cur)
        # rebalance: the same number of batches, near-equal sizes (no tiny tail batch), when the
        # budget still holds for each
        k = len(batches)
        if k > 1:
            size, extra = divmod(len(order), k)
            even, pos = [], 0
            for j in range(k):
                n = size + (1 if j < extra else 0)
                even.append(order[pos:pos + n])
                pos += n
            if all(fits(len(b), max(lengths[i] for i in b)) for b in even):
                batches = even
        return batches

    # -- generation -----------------------------------------------------------------------------
    def _generate_batches(self, prompts: list[str], desc: Optional[str]) -> Iterator[tuple[list[int], list[Reply]]]:
        ids = self.encode(prompts)
        shared = self.share_prefix and self.decode == "compact" and self._compact_ok()
        batches = self.plan_batches([len(x) for x in ids], ids if shared else None)
        bar = tqdm(total=len(prompts), desc=desc or f"generate {self.spec.label}", unit="req",
                   disable=not self.show_progress, leave=False)
        try:
            for b in batches:
                t0 = time.perf_counter()
                enc = self.tokenizer.pad({"input_ids": [ids[i] for i in b]}, padding=True,
                                         return_tensors="pt")
                input_ids = enc["input_ids"].to(self.device)
                attn = enc["attention_mask"].to(self.device)
                rows = self._decode_batch(input_ids, attn)
                dt = time.perf_counter() - t0
                replies = []
                for (new, reason), i in zip(rows, b):
                    replies.append(Reply(text=self.tokenizer.decode(new, skip_special_tokens=True),
                                         n_prompt_tokens=len(ids[i]), n_new_tokens=len(new),
                                         seconds=dt / len(b), key="", cached=False, finish=reason))
                bar.update(len(b))
                yield b, replies
        finally:
            bar.close()

    def _decode_batch(self, input_ids, attn) -> list[tuple[list[int], str]]:
        """Greedy replies of one left-padded batch: per row (new token ids, finish reason)."""
        if self.decode == "compact" and self._compact_ok():
            return self._decode_compact(input_ids, attn)
        return self._decode_generate(input_ids, attn)

    def _compact_ok(self) -> bool:
        return self._compact_checked

    def _compact_unsupported(self) -> Optional[str]:
        """Why the compact loop cannot run this model, or None. It reimplements plain greedy decoding
        over full or sliding-window attention layers: models whose generation config asks for logits
        processors (repetition penalty, suppressed tokens, ...), whose cache layers are of another
        kind (linear attention, chunked, ...) or whose attention kernel takes no 4-D mask use
        ``generate``."""
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
        gc = self.model.generation_config
        plain = ((gc.repetition_penalty in (None, 1.0)) and not gc.no_repeat_ngram_size
                 and not gc.bad_words_ids and not gc.suppress_tokens and not gc.begin_suppress_tokens
                 and not gc.min_length and not gc.min_new_tokens and gc.forced_bos_token_id is None
                 and gc.forced_eos_token_id is None and not gc.sequence_bias
                 and getattr(gc, "encoder_repetition_penalty", None) in (None, 1.0))
        if not plain:
            return "the generation config asks for logits processors"
        if self.model.config.is_encoder_decoder:
            return "encoder-decoder model"
        if self.attention not in MASK_KERNELS:
            return f"attention kernel {self.attention!r} takes no 4-D mask"
        kinds = set(getattr(self.model.config, "layer_types", None) or ["full_attention"])
        if kinds - {"full_attention", "sliding_attention"}:
            return f"layer types {sorted(kinds)}"
        if getattr(self.model.config, "sliding_window", None) and not getattr(self.model.config, "layer_types", None) \
                and getattr(self.model.config, "use_sliding_window", True):
            return "a sliding window without per-layer types"
        try:
            cache = DynamicCache(config=self.model.config)
        except Exception as e:  # a model whose cache cannot be built from its config alone
            return f"no cache from the config ({type(e).__name__})"
        allowed = (DynamicLayer, DynamicSlidingWindowLayer) if self.sliding_window else (DynamicLayer,)
        if not cache.layers or not all(type(x) in allowed for x in cache.layers):
            return f"cache layers {sorted({type(x).__name__ for x in cache.layers})}"
        return None

    # -- masks (sliding-window models, eager attention) -------------------------------------------
    def _mask_value(self, keep):
        """A 4-D boolean keep-mask as the attention kernel wants it: boolean for SDPA and memtoc_cpu,
        additive (0 / dtype min) for eager, which adds the mask to the scores."""
        import torch
        if self.attention == "eager":
            return torch.zeros(keep.shape, dtype=self.torch_dtype, device=keep.device).masked_fill(
                ~keep, torch.finfo(self.torch_dtype).min)
        return keep

    def _position_masks(self, key_valid, key_pos, q_pos, q_valid):
        """Per-layer-type masks from positions: query i of row r (position ``q_pos[r, i]``, the last
        ``S`` columns) sees key column c when it holds a real token (``key_valid``) at a position
        ``key_pos[r, c] <= q_pos[r, i]``, and on sliding-window layers also ``q - k < window``. A
        padding query sees only its own column (a query that sees nothing gives NaN keys / values).
        A dict {layer type: (n, 1, S, C) mask} for sliding-window models, else the full mask."""
        import torch
        n, S = q_pos.shape
        C = key_pos.shape[1]
        own = torch.zeros((S, C), dtype=torch.bool, device=key_pos.device)
        own[torch.arange(S), C - S + torch.arange(S)] = True
        dist = q_pos[:, :, None] - key_pos[:, None, :]                               # n, S, C
        full = key_valid[:, None, :] & (dist >= 0)
        pad_q = ~q_valid[:, :, None]
        masks = {"full_attention": torch.where(pad_q, own, full)}
        if self.sliding_window:
            masks["sliding_attention"] = torch.where(pad_q, own, full & (dist < self.sliding_window))
        masks = {k: self._mask_value(m[:, None]) for k, m in masks.items()}
        return masks if self.sliding_window else masks["full_attention"]

    def _forward(self, cache, expect: int, **kw):
        """``model(...)`` with ``cache`` under the model's own keyword; checks that the cache now
        holds ``expect`` columns (an older transformers that ignores the keyword would otherwise
        decode from nothing and return garbage)."""
        out = self.model(**{self.cache_kw: cache}, use_cache=True, return_dict=True, **kw)
        got = cache.get_seq_length()
        if got != expect:
            import transformers
            raise GenerationError(
                f"transformers {transformers.__version__}: {type(self.model).__name__} did not fill the KV cache "
                f"passed as `{self.cache_kw}` ({got} columns, expected {expect}); the compact decode loop cannot "
                "run with this version. Set the transformers backend option decode: generate, or install "
                "the transformers version in memtoc's lock")
        return out

    # -- the canonical tie-break ----------------------------------------------------------------
    def _canonical_next(self, ids: list[int]) -> int:
        """Greedy next token of one sequence computed alone (batch 1, no padding, no cache): the
        batch-independent decision for a near-tie step (see the module docstring)."""
        import torch
        self.decode_stats["tie_recomputes"] += 1
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, use_cache=False, logits_to_keep=1, return_dict=True)
        return int(torch.argmax(out.logits[0, -1].to(torch.float32)))

    def _near_ties(self, logits) -> list[int]:
        """Rows whose top-2 logits are closer than ``tie_margin``."""
        import torch
        if self.tie_margin <= 0 or logits.shape[-1] < 2:
            return []
        top = torch.topk(logits.to(torch.float32), 2, dim=-1).values
        return ((top[:, 0] - top[:, 1]) < self.tie_margin).nonzero().flatten().tolist()

    def _decode_generate(self, input_ids, attn) -> list[tuple[list[int], str]]:
        """``model.generate`` on the whole batch; finished rows keep decoding until the last ends."""
        import torch
        P = input_ids.shape[1]
        stop = _StopCriteria(self.tokenizer, P, self.eos_ids, self.newline_ids, self.stop_at_final,
                             self.stop_at_first_line)
        lens = attn.sum(-1).tolist()
        prompts = [input_ids[r, P - n:].tolist() for r, n in enumerate(lens)]
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids, attention_mask=attn, max_new_tokens=self.max_new_tokens,
                do_sample=False, temperature=None, top_p=None, top_k=None, **self.policy.transformers_generate(),
                pad_token_id=self.tokenizer.pad_token_id, stopping_criteria=[stop],
                logits_processor=[_TieGuard(self, prompts, P, stop)] if self.tie_margin > 0 else None)
        rows = []
        for row in range(input_ids.shape[0]):
            end = stop.end[row] if stop.end and stop.end[row] is not None else out.shape[1]
            rows.append((out[row, P:end].tolist(), stop.reason[row] if stop.reason else "length"))
        return rows

    def _decode_compact(self, input_ids, attn) -> list[tuple[list[int], str]]:
        """Greedy decoding that drops finished rows after every step (see the module docstring).

        Mirrors ``generate``: position ids = cumulative sum of the mask - 1 (0 on padding), float32
        argmax of the last logits, the EOS token not part of the reply, a FINAL-line check when the
        new token holds a newline. Decode steps pass a 4-D boolean mask as wide as the cache buffer
        (see :func:`_compact_layer_class`)."""
        import torch

        B, P = input_ids.shape
        new: list[list[int]] = [[] for _ in range(B)]
        reason = ["length"] * B
        active = list(range(B))                  # batch row -> original row
        lens = attn.sum(-1).tolist()
        prompt_ids: dict[int, list[int]] = {}    # a row's prompt without padding, for the tie-break
        with torch.inference_mode():
            if self.share_prefix and B > 1:
                cache, logits = self._prefill_shared(input_ids, attn)
            else:
                cache, logits = self._prefill_plain(input_ids, attn)
            last_pos = attn.long().sum(-1) - 1
            pad = P - attn.long().sum(-1)        # column of a token = its position + its row's padding
            # columns each row attends to in a decode step: its prompt, then the tokens decoded so
            # far; as wide as the cache buffer (see _compact_layer_class)
            valid = torch.zeros((B, P + self.max_new_tokens), dtype=torch.bool, device=input_ids.device)
            valid[:, :P] = attn.bool()
            cols = torch.arange(valid.shape[1], device=input_ids.device)
            stats = self.decode_stats
            stats["batches"] += 1
            for step in range(self.max_new_tokens):
                stats["steps"] += 1
                stats["row_steps"] += len(active)
                nxt = torch.argmax(logits.to(dtype=torch.float32), dim=-1)
                for a in self._near_ties(logits):
                    r = active[a]
                    if r not in prompt_ids:
                        prompt_ids[r] = input_ids[r, P - lens[r]:].tolist()
                    nxt[a] = self._canonical_next(prompt_ids[r] + new[r])
                del logits
                keep = []
                for a, t in enumerate(nxt.tolist()):
                    r = active[a]
                    if t in self.eos_ids:
                        reason[r] = "eos"
                        continue
                    new[r].append(t)
                    if ((self.stop_at_final or self.stop_at_first_line) and t in self.newline_ids
                            and (rule := line_stop(self.tokenizer.decode(new[r], skip_special_tokens=True),
                                                   self.stop_at_final, self.stop_at_first_line))):
                        reason[r] = rule
                        continue
                    keep.append(a)
                if not keep or step == self.max_new_tokens - 1:
                    break
                if len(keep) < len(active):
                    keep = _fill_holes(keep)
                    idx = torch.tensor(keep, device=nxt.device)
                    cache.batch_select_indices(idx)
                    active = [active[a] for a in keep]
                    nxt, last_pos, valid, pad = nxt[idx], last_pos[idx], valid[idx], pad[idx]
                valid[:, P + step] = True
                last_pos = last_pos + 1
                if self.sliding_window or self.attention == "eager":
                    mask = self._position_masks(valid, cols[None, :] - pad[:, None], last_pos[:, None],
                                                torch.ones((len(active), 1), dtype=torch.bool, device=valid.device))
                else:
                    mask = valid[:, None, None, :]
                logits = self._forward(cache, P + step + 1, input_ids=nxt[:, None], attention_mask=mask,
                                       position_ids=last_pos[:, None], logits_to_keep=1).logits[:, -1]
        return [(new[r], reason[r]) for r in range(B)]

    def _new_cache(self, capacity: int):
        from transformers import DynamicCache
        cache = DynamicCache(config=self.model.config)
        layer_cls = _compact_layer_class()
        cache.layers = [layer_cls(capacity) for _ in cache.layers]
        return cache

    def _prefill_plain(self, input_ids, attn):
        """One forward over the left-padded batch: (cache, last logits)."""
        pos = (attn.long().cumsum(-1) - 1).masked_fill(attn == 0, 0)
        if self.sliding_window:
            mask = self._position_masks(attn.bool(), pos, pos, attn.bool())
        else:
            mask = None if bool((attn == 1).all()) else attn
        cache = self._new_cache(input_ids.shape[1] + self.max_new_tokens)
        out = self._forward(cache, input_ids.shape[1], input_ids=input_ids, attention_mask=mask,
                            position_ids=pos, logits_to_keep=1)
        self.decode_stats["prompt_tokens_computed"] += int(attn.sum())
        return cache, out.logits[:, -1]

    def _prefill_shared(self, input_ids, attn):
        """The same state as :meth:`_prefill_plain`, each shared prefix segment computed once.

        The rows' prompts are cut into the segments of :func:`memtoc.backends.prefix.prefix_segments`
        and computed one tree depth at a time: a forward call over a chunk of segments of that depth,
        each row of it = the segment's tokens (left-padded to the chunk's longest) after the keys and
        values of its ancestors (gathered, right-aligned, from a per-layer token store; the gap in
        between masked), at the segment's own positions. The new keys and values go to the store;
        leaf segments also give their row's last logits. The decode cache is then gathered from the
        store into the usual left-padded layout, so decoding continues exactly as after the plain
        prefill. Same maths per token as the plain prefill (each token attends to the same earlier
        tokens at the same positions); in bfloat16 the different matrix shapes round differently,
        which can flip a near-tie greedy token (``memtoc bench generation --compare-share`` counts it).
        """
        import torch
        dev = input_ids.device
        B, P = input_ids.shape
        lens = attn.sum(-1).tolist()
        ids = [input_ids[r, P - n:].tolist() for r, n in zip(range(B), lens)]
        segs = prefix_segments(ids, self.min_shared_tokens)
        slot0 = [0] * len(segs)               # store slot of each segment's first token; slot 0 = zeros
        total = 1
        for s in segs:
            slot0[s.index] = total
            total += len(s.tokens)

        def slots(index):                       # store slots of a segment's path, in token order
            return [t for i in prefix_path(segs, index) for t in range(slot0[i], slot0[i] + len(segs[i].tokens))]

        store_k: list = []
        store_v: list = []
        logits: list = [None] * B
        pad = self.tokenizer.pad_token_id
        for depth in range(max(s.depth for s in segs) + 1):
            for chunk in self._segment_chunks([s for s in segs if s.depth == depth]):
                n = len(chunk)
                S = max(len(s.tokens) for s in chunk)
                W = max(s.start for s in chunk)
                inp = torch.full((n, S), pad, dtype=torch.long)
                mask = torch.zeros((n, W + S), dtype=torch.long)
                pos = torch.zeros((n, S), dtype=torch.long)
                past = torch.zeros((n, W), dtype=torch.long)
                for j, s in enumerate(chunk):
                    L = len(s.tokens)
                    inp[j, S - L:] = torch.tensor(s.tokens)
                    pos[j, S - L:] = torch.arange(s.start, s.end)
                    mask[j, W + S - L:] = 1
                    if s.start:
                        mask[j, W - s.start:W] = 1
                        past[j, W - s.start:] = torch.tensor(slots(s.parent))
                inp, mask, pos, past = inp.to(dev), mask.to(dev), pos.to(dev), past.to(dev)
                starts = torch.tensor([s.start for s in chunk], device=dev)
                cache = self._cache_from_store(store_k, store_v, past, W + S) if W else self._new_cache(W + S)
                if self.sliding_window:  # masks from positions: the gap between past and segment
                    key_pos = torch.cat([(torch.arange(W, device=dev)[None, :] - W + starts[:, None]).clamp(min=0),
                                         pos], 1)
                    masks = self._position_masks(mask.bool(), key_pos, pos, mask[:, W:].bool())
                else:
                    masks = None if bool((mask == 1).all()) else mask
                out = self._forward(cache, W + S, input_ids=inp, attention_mask=masks, position_ids=pos,
                                    logits_to_keep=1)
                if not store_k:
                    for layer in cache.layers:
                        _, hk, _, dk = layer.buf_k.shape
                        _, hv, _, dv = layer.buf_v.shape
                        store_k.append(layer.buf_k.new_zeros((total, hk, dk)))
                        store_v.append(layer.buf_v.new_zeros((total, hv, dv)))
                rows_j = torch.tensor([j for j, s in enumerate(chunk) for _ in s.tokens], device=dev)
                cols = torch.tensor([W + S - len(s.tokens) + t for s in chunk for t in range(len(s.tokens))],
                                    device=dev)
                dst = torch.tensor([slot0[s.index] + t for s in chunk for t in range(len(s.tokens))], device=dev)
                for layer, sk, sv in zip(cache.layers, store_k, store_v):
                    sk[dst] = layer.buf_k[rows_j, :, cols]
                    sv[dst] = layer.buf_v[rows_j, :, cols]
                last = out.logits[:, -1]
                for j, s in enumerate(chunk):
                    if s.is_leaf:
                        logits[s.rows[0]] = last[j]
                self.decode_stats["prompt_tokens_computed"] += sum(len(s.tokens) for s in chunk)
                self.decode_stats["prefill_calls"] += 1
                del out, cache

        # the decode cache in the plain prefill's layout: row r's prompt right-aligned in P columns
        gather = torch.zeros((B, P), dtype=torch.long)
        for r, leaf in enumerate(leaves_by_row(segs, B)):
            gather[r, P - lens[r]:] = torch.tensor(slots(leaf))
        return self._cache_from_store(store_k, store_v, gather.to(dev), P + self.max_new_tokens), torch.stack(logits)

    def _cache_from_store(self, store_k, store_v, gather, capacity: int):
        """A compact cache of ``capacity`` columns whose first ``gather.shape[1]`` columns hold, for
        each row r, the stored keys / values of slots ``gather[r]`` (slot 0 = zeros, for padding)."""
        n, W = gather.shape
        cache = self._new_cache(capacity)
        for layer, sk, sv in zip(cache.layers, store_k, store_v):
            bk = sk.new_empty((n, sk.shape[1], capacity, sk.shape[2]))
            bv = sv.new_empty((n, sv.shape[1], capacity, sv.shape[2]))
            bk[:, :, :W] = sk[gather].transpose(1, 2)
            bv[:, :, :W] = sv[gather].transpose(1, 2)
            layer.preload(bk, bv, W)
        return cache

    def _segment_chunks(self, level):
        """Segments of one depth cut into forward calls: longest first; a call holds segments while
        its padded size (count x longest) stays within ``prefill_tokens`` and no segment is shorter
        than half the longest (so padding wastes at most about half a call)."""
        order = sorted(level, key=lambda s: (-len(s.tokens), s.index))
        chunks: list[list] = []
        for s in order:
            if chunks:
                cur = chunks[-1]
                longest = len(cur[0].tokens)
                if (len(cur) + 1) * longest <= self.prefill_tokens and 2 * len(s.tokens) >= longest:
                    cur.append(s)
                    continue
            chunks.append([s])
        return chunks
