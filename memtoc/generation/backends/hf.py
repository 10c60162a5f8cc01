"""transformers backend: greedy, batched, left-padded, shared prefixes computed once; replies that
do not depend on the batch (float32 on CPU, with a canonical tie-break).

Batch invariance: a reply must not depend on which other prompts share its batch (batch size,
order, a resume, a cache repair), since the cache key ignores the batch. ``dtype="auto"`` on a CPU
gets one of two invariant schemes.

*bfloat16 with the row prefill* (the CPU default where the CPU has bf16 instructions, AVX512-BF16 or
AMX: :func:`cpu_has_native_bf16`; ``row_prefill`` defaults to on for every CPU bf16 run). Measured
on such a CPU (torch 2.13): a bf16 ``linear`` gives a row the same bits in a call of 2 or of 1,000
rows, but a call of *one* row takes another kernel (GEMV) and differs; the decode attention of
:func:`memtoc.generation.backends.engine.attention.cpu_decode_attention` gives a row the same bits whatever the other
rows and whatever masked columns follow its keys, but not when its keys start one column later (an
odd shift re-pairs the bf16 dot products). So: (1) each prompt's prefill is computed for that row
alone (:meth:`~memtoc.generation.backends.engine.rowprefill.RowPrefill._prefill_chunks`: cut at every multiple of
``prefill_chunk`` tokens, default 16; chunk j depends on the prompt's first (j+1) x 16 tokens only,
so a chunk that several prompts share is computed once and kept for later calls, up to
``chunk_memo_mb``; ``prefill_chunk: 0`` = the whole prompt in one forward; the last 1..16 tokens
are fed as one-token steps of all the rows together, ``prefill_tail: steps``, which the bench
measured ~1.3x faster end to end than a forward per prompt, ``prefill_tail: chunk``); (2) the decode cache is
*aligned*: a row's prompt fills columns 0..n-1 and its token at position p goes to column p, so
every row's keys start at column 0 in every batch; (3) no decode step runs on a single row (a batch
of one is decoded twice over; a finished row stays as a ghost while one row is left). A row's
logits are then the same bits in every batch composition, so the replies are identical by
construction, with no tie-break (``tie_margin`` defaults to 0 here; it still works when set). The
``linear`` property is a property of the CPU's kernels, so it is checked at load on the model's own
weights (:func:`linear_rows_invariant`; a failure is logged with the way out, dtype float32, and
recorded in ``info["linear_rows_differ"]``); the rest is tested end to end (batch sizes, orders,
the loop, a repaired cache; the embedded models and tiny Llama / gemma-3 configs). Against the
float32 default of before, this is ~1.7x faster per episode on the bench prompts (docs/measurements.md).

*float32 with the tie-break* (CPUs without bf16 instructions, or ``dtype: float32``): a float32
``linear`` row differs in its last bits between 1, 2-15 and 16+ rows and the left-padded attention
shifts with the padding, moving logits by at most ~4e-5; a greedy step whose top-2 logit margin is
below ``tie_margin`` (default 2e-3, ~50x that noise) is decided by the *canonical* computation
instead: one forward of that row's prompt + reply so far alone (batch 1, no padding, no cache).
Every other step has a margin far above the noise, so every composition picks the same token; by
induction the replies are identical. ``decode_stats["tie_recomputes"]`` counts the canonical
forwards. bf16 without the row prefill (``row_prefill: false``) moves logits by up to 1.0 with the
batch and is not invariant; GPU ``auto`` stays bf16/fp16, which is not batch-invariant either.

Batching: prompts are tokenized once and cut into batches, in token order when shared-prefix
prefill is on (the default with the compact loop: prompts that share a prefix - a formulation's
instruction, a relation's tool schema, a question's conditions - land in the same batch), else
longest first (ties by original order). ``batch_size=int`` fixes the number of prompts per batch;
``batch_size="auto"`` uses a token-budget rule: a batch takes prompts while ``n * (longest prompt +
max_new_tokens)`` stays within ``token_budget`` (default 49152 on CPU, 131072 on GPU) and ``n <=
max_batch`` (128 CPU, 256 GPU; on 256 bench prompts 128 rows were ~1.1-1.2x faster than 64: rows
finish at different steps, and a larger batch keeps more of them in each late step); the batches are then evened out (same count, near-equal sizes). Why
large batches on a CPU too: a decode step streams all weights and the live keys / values from
memory whatever the batch, so bigger batches amortize it (and share more prefixes); the budget
bounds memory and the padding / finished-row waste.

Shared-prefix prefill (``share_prefix=True``, compact loop only, not with the row prefill, which
shares whole chunks instead): the batch's prompts are cut into
the segments of a radix tree (:mod:`memtoc.generation.backends.engine.prefix`), each shared run of at least
``min_shared_tokens`` tokens is computed once and its keys / values are copied to every row that
has it (see :meth:`memtoc.generation.backends.engine.compact.CompactDecoder._prefill_shared`). On the 64 bench prompts 75 of 191
prompt tokens per episode are computed; on a headline arm (20 questions x 4 conditions x 3
formulations) 37% of them, 1.6x faster end to end. Same maths as the plain prefill, so float32
replies are identical (tested); in bfloat16 the different matrix shapes round differently and flip
near-tie greedy tokens about as often as changing the batch composition does (measured on 120
episodes: 86 of 120 plain-bf16 and 88 of 120 shared-bf16 replies equal the float32 reply). Like the
batch size it is therefore not part of the cache identity.

Attention (``attention="auto"``, :func:`memtoc.generation.backends.engine.attention.attention_implementation`): SDPA on GPU; on
CPU ``memtoc_cpu`` = SDPA for the prefill and a plain grouped-query matmul for one-token decode
steps (see :func:`memtoc.generation.backends.engine.attention.cpu_decode_attention`); ``eager`` on every device for models that soft-cap their
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
written in place into a buffer sized once (see :class:`memtoc.generation.backends.engine.compact.CompactLayer`);
after each step the finished rows leave the batch (their cache rows, mask rows and position ids). Same tokens, same stop
rule, same ``Reply`` fields, so it is not part of the cache identity:
``tests/unit/test_backends_hf.py`` checks token equality with ``generate`` (float32), and
``memtoc bench generation --compare-decode`` counts the replies that differ in bfloat16.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from pathlib import Path
from typing import Iterator, Optional

from tqdm.auto import tqdm

from memtoc.core.errors import ConfigError
from memtoc.generation.backends.base import Generator, Reply
from memtoc.generation.backends.engine.attention import (
    CPU_ATTENTION,
    attention_implementation,
    cpu_decode_attention,
    register_cpu_attention,
)
from memtoc.generation.backends.engine.compact import CompactDecoder, GenerationError, cache_keyword, sliding_window_of
from memtoc.generation.backends.engine.rowprefill import PREFILL_TAILS
from memtoc.generation.backends.engine.stopping import FLOAT32_TIE_MARGIN, StopCriteria, TieGuard
from memtoc.generation.decoding import policy_from_config
from memtoc.generation.hardware import cpu_has_native_bf16, placement, release_memory, warn_emulated_bf16
from memtoc.generation.templates import render_prompt
from memtoc.generation.weights import adapter_hash, weights_hash

log = logging.getLogger(__name__)

# names other modules import from here
__all__ = ["TransformersGenerator", "GenerationError", "cache_keyword", "cpu_decode_attention",
           "register_cpu_attention", "resolve_dtype", "FLOAT32_TIE_MARGIN", "CPU_ATTENTION"]

DECODE_LOOPS = ("compact", "generate")
MASK_KERNELS = ("sdpa", CPU_ATTENTION, "eager")   # attention kernels that take the loop's 4-D masks


def resolve_dtype(dtype: str, device: str):
    import torch
    if dtype == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        # batch-invariant either way (module docstring): bf16 with the row prefill and the aligned
        # cache where the CPU has bf16 instructions, else float32 with the tie-break
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if not device.startswith("cuda"):
        warn_emulated_bf16(dtype, False, "generation dtype")
    return {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]


def linear_rows_invariant(model, rows: int = 64, seed: int = 0) -> Optional[str]:
    """None when every distinct ``nn.Linear`` weight shape of ``model`` gives each input row the same
    output bits in a call of 2, 3, 5, 17 or 33 rows as in a call of ``rows`` rows (what the row
    prefill's decode steps rely on, see the module docstring), else which shape and batch size
    differ. Run on the model's own weights with random inputs of its dtype; ~0.1 s for a 135M model."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    seen = set()
    with torch.inference_mode():
        for name, mod in model.named_modules():
            if not isinstance(mod, torch.nn.Linear) or tuple(mod.weight.shape) in seen:
                continue
            seen.add(tuple(mod.weight.shape))
            w = mod.weight
            x = (torch.randn(rows, w.shape[1], generator=gen) * torch.rand(rows, 1, generator=gen) * 3).to(
                dtype=w.dtype, device=w.device)
            full = torch.nn.functional.linear(x, w)
            for m in (2, 3, 5, 17, 33):
                if m < rows and not torch.equal(torch.nn.functional.linear(x[:m], w), full[:m]):
                    return f"{name} ({w.shape[1]} -> {w.shape[0]}): {m} rows vs {rows}"
    return None


class TransformersGenerator(CompactDecoder, Generator):
    backend = "transformers"

    def __init__(self, spec, path: Path, adapter=None, batch_size="auto", dtype="auto",
                 max_new_tokens: int = 48, cache_dir=None, stop_at_final: bool = True,
                 stop_at_first_line: bool = False, device: Optional[str] = None, token_budget: Optional[int] = None,
                 max_batch: Optional[int] = None, num_threads: Optional[int] = None,
                 attention: str = "auto", show_progress: bool = True, decode: str = "compact",
                 share_prefix: bool = True, min_shared_tokens: int = 8, prefill_tokens: Optional[int] = None,
                 tie_margin: Optional[float] = None, row_prefill: Optional[bool] = None,
                 prefill_chunk: int = 16, chunk_memo_mb: int = 512, prefill_tail: str = "steps"):
        import torch

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
        self.token_budget = int(token_budget or (131072 if gpu else 49152))
        self.max_batch = int(max_batch or (256 if gpu else 128))
        self.show_progress = show_progress
        if decode not in DECODE_LOOPS:
            raise ConfigError(f"transformers backend option decode must be one of {list(DECODE_LOOPS)}, "
                              f"got {decode!r}")
        self.decode = decode
        # counters of the compact loop, summed over calls: batches, decode steps, decoded row-steps,
        # prompt tokens actually run (fewer than given when prefixes are shared), prefill forward calls
        self.decode_stats = {"batches": 0, "row_steps": 0, "steps": 0,
                             "prompt_tokens_computed": 0, "prefill_calls": 0, "tie_recomputes": 0}
        # the row prefill + aligned cache: the default for bf16 on CPU (the module docstring)
        cpu_bf16 = self.torch_dtype == torch.bfloat16 and not gpu
        self.row_prefill = cpu_bf16 and decode == "compact" if row_prefill is None else bool(row_prefill)
        if tie_margin is None:
            tie_margin = FLOAT32_TIE_MARGIN if self.torch_dtype == torch.float32 else 0.0
        self._init_chunks(prefill_chunk, chunk_memo_mb, prefill_tail)
        if not isinstance(tie_margin, (int, float)) or isinstance(tie_margin, bool) or tie_margin < 0:
            raise ConfigError(f"transformers backend option tie_margin must be a number >= 0, got {tie_margin!r}")
        self.tie_margin = float(tie_margin)
        self.share_prefix = bool(share_prefix)
        self.min_shared_tokens = int(min_shared_tokens)
        self.prefill_tokens = int(prefill_tokens or (32768 if gpu else 8192))

        a_hash = self._load(attention, adapter)
        self.policy = policy_from_config(self.model.generation_config, str(self.path / "generation_config.json"))
        gc = self.model.generation_config
        eos = gc.eos_token_id if gc.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos])
        self.eos_ids.discard(None)
        self.newline_ids = self._newline_token_ids()
        self.cache_kw = cache_keyword(self.model)
        self.sliding_window = sliding_window_of(self.model.config)
        why = self._compact_unsupported()
        self._compact_checked = why is None
        # what this generator runs (not part of the cache identity: every path gives the same replies)
        self.info = {"decode_path": self.decode if why is None else "generate", "compact_unsupported": why,
                     "cache_keyword": self.cache_kw, "sliding_window": self.sliding_window,
                     "attention": self.attention}
        if why is not None and self.decode == "compact":
            log.warning("%s: the compact decode loop does not support this model (%s); using "
                        "model.generate", spec.name, why)
        self._check_row_prefill(why, asked=row_prefill is not None)
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
                         **({"prefill": "rows", "prefill_chunk": self.prefill_chunk} if self.row_prefill else {}),
                         # the stepped last chunk (the default since 2026-12-05); ``chunk`` keeps the key of before
                         **({"prefill_tail": "steps"} if self.row_prefill and self.prefill_chunk
                            and self.prefill_tail == "steps" else {}),
                         **self.policy.identity()},   # the model's penalties (memtoc.generation.decoding), when it has any
        })

    def _check_row_prefill(self, why: Optional[str], asked: bool) -> None:
        """The row prefill needs the compact loop (``why``: why that cannot run, or None): off
        when it was only the default, an error when it was asked for. When on, the bf16 ``linear``
        property it rests on is checked on the model's weights (a warning names a failure)."""
        if self.row_prefill and why is not None and not asked:
            self.row_prefill = False   # the default, on a model the compact loop cannot run
        if self.row_prefill and (why is not None or self.decode != "compact"):
            raise ConfigError(f"transformers backend option row_prefill needs the compact decode loop "
                              f"(decode: compact), which {'is off' if why is None else 'cannot run: ' + why}; "
                              "remove row_prefill")
        if self.row_prefill:
            self.info["linear_rows_differ"] = differ = linear_rows_invariant(self.model)
            if differ:
                log.warning("%s: on this CPU a bfloat16 linear layer's rows depend on the batch size (%s): "
                            "replies can depend on the batch; dtype float32 keeps them invariant",
                            self.spec.name, differ)

    def _init_chunks(self, prefill_chunk: int, chunk_memo_mb: int, prefill_tail: str = "steps") -> None:
        """The chunked row prefill's settings and its kept chunks (memtoc.generation.backends.engine.rowprefill)."""
        for name, value in (("prefill_chunk", prefill_chunk), ("chunk_memo_mb", chunk_memo_mb)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"transformers backend option {name} must be an integer >= 0, got {value!r}")
        if prefill_tail not in PREFILL_TAILS:
            raise ConfigError(f"transformers backend option prefill_tail must be one of {list(PREFILL_TAILS)}, "
                              f"got {prefill_tail!r}")
        self.prefill_tail = prefill_tail
        self.prefill_chunk = prefill_chunk     # 0: each prompt's prefill in one forward
        self.chunk_memo_mb = chunk_memo_mb
        self._chunk_memo: OrderedDict = OrderedDict()   # chunk name -> its keys / values
        self._chunk_memo_bytes = 0
        self._chunk_names: dict = {}                     # (chunk before, tokens) -> chunk name
        self._chunk_tokens: list = []                    # chunk name -> its tokens

    def _load(self, attention: str, adapter) -> Optional[str]:
        """Load the tokenizer (left padding) and the model with its attention kernel (``adapter``
        merged into it) onto the device; returns the adapter's hash (None without one)."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

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
                                                     attn_implementation=attention, **placement(self.device))
        a_hash = None
        if adapter is not None:
            from peft import PeftModel
            model = PeftModel.from_pretrained(model, str(adapter))
            model = model.merge_and_unload()
            # as from_pretrained leaves a model: peft froze the base weights, and with frozen weights
            # torch computes the lm_head of the last position (a strided 3-D input) as a batched
            # matmul over a copy of the whole weight per row (measured: an adapter's replies 2.7x
            # slower than the base model's, and its logits from another kernel than the base's)
            model.requires_grad_(True)
            a_hash = adapter_hash(adapter)
        self.model = model.to(self.device).eval()
        return a_hash

    def close(self) -> None:
        """Drop the model and hand its memory back (a GPU's too), so that the next engine or trainer
        of the run finds it free. Safe to call twice; the generator cannot generate afterwards."""
        if getattr(self, "model", None) is None:
            return
        self.model = None
        release_memory(self.device)

    def forget_prefixes(self) -> None:
        """Drop the kept prefill chunks (see :meth:`_prefill_chunks`): the next call computes every
        chunk again (what a benchmark of a cold start wants; the replies are the same)."""
        self._chunk_memo.clear()
        self._chunk_memo_bytes = 0

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
        stop = StopCriteria(self.tokenizer, P, self.eos_ids, self.newline_ids, self.stop_at_final,
                             self.stop_at_first_line)
        lens = attn.sum(-1).tolist()
        prompts = [input_ids[r, P - n:].tolist() for r, n in enumerate(lens)]
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids, attention_mask=attn, max_new_tokens=self.max_new_tokens,
                do_sample=False, temperature=None, top_p=None, top_k=None, **self.policy.transformers_generate(),
                pad_token_id=self.tokenizer.pad_token_id, stopping_criteria=[stop],
                logits_processor=[TieGuard(self, prompts, P, stop)] if self.tie_margin > 0 else None)
        rows = []
        for row in range(input_ids.shape[0]):
            end = stop.end[row] if stop.end and stop.end[row] is not None else out.shape[1]
            rows.append((out[row, P:end].tolist(), stop.reason[row] if stop.reason else "length"))
        return rows
