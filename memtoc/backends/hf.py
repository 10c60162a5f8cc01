"""transformers backend: greedy, batched, left-padded, length-sorted, bf16 where fast.

Batching: prompts are tokenized once, sorted by length (longest first, ties by original order) and
cut into batches. ``batch_size=int`` fixes the number of prompts per batch; ``batch_size="auto"``
uses a token-budget rule: a batch takes prompts while ``n * (longest prompt + max_new_tokens)`` stays
within ``token_budget`` (default 24576 on CPU, 131072 on GPU) and ``n <= max_batch`` (64 CPU, 256
GPU); the batches are then evened out (same count, near-equal sizes). Why large batches on a CPU
too: prefill runs near the matmul rate at any batch size, but a decode step streams all weights
from memory (~50 ms for this model on 2 cores whatever the batch), so bigger batches amortize the
decode; the budget bounds memory and the padding / finished-row waste.

Attention (``attention="auto"``): SDPA on GPU; on CPU ``memtoc_cpu`` = SDPA for the prefill and a
plain grouped-query matmul for one-token decode steps (see :func:`cpu_decode_attention`).

Early stop (``stop_at_final=True``, part of the decoding settings and so of the cache key): a
sequence is finished once its reply holds a completed ``FINAL:`` answer line (marker, non-empty
answer, newline) or EOS; the batch ends when all its sequences are finished. The protocol's
extractor takes the *last* FINAL marker, so text after the first completed FINAL line could only
matter if a model wrote a second, different FINAL line; ``memtoc bench generation`` measures how
often that changes an extracted answer.

Decode loop (``decode="compact"``, the default; ``decode="generate"`` is the former path): greedy
``model.generate`` on a left-padded batch keeps every row decoding until the last row ends (the few
replies that run to ``max_new_tokens`` keep a whole batch of 64 decoding), and its dynamic cache
re-allocates and copies all keys and values at every step. The compact loop does the same greedy
maths by hand: one prefill of the left-padded batch (same inputs, position ids, mask and attention
as ``generate``), then one token per step, keys and values written in place into a buffer sized
once (see :func:`_compact_layer_class`); after each step the finished rows leave the batch (their
cache rows, mask rows and position ids) and so do the padding columns no remaining row needs. Same
tokens, same stop rule, same ``Reply`` fields, so it is not part of the cache identity:
``tests/test_backends_hf.py`` checks token equality with ``generate`` (float32), and
``memtoc bench generation --compare-decode`` counts the replies that differ in bfloat16.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Iterator, Optional

from tqdm.auto import tqdm
from transformers import StoppingCriteria

from ..config import ConfigError
from .base import Generator, Reply, final_line_done


CPU_ATTENTION = "memtoc_cpu"
DECODE_LOOPS = ("compact", "generate")


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
        return torch.bfloat16  # ~2.5x faster than fp32 on this CPU (measured by the lead)
    return {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]


def _compact_layer_class():
    """A ``DynamicLayer`` whose keys / values live in one buffer allocated at the prefill (prompt +
    ``max_new_tokens`` positions); a decode step writes its column in place and the attention gets a
    view of the filled part. ``DynamicLayer`` instead concatenates, i.e. allocates and copies the
    whole cache at every step and every layer (60 concatenations of 64 x 3 x 230 x 64 bf16 took
    ~190 ms on one thread of this CPU, on a busy machine). Finished rows are dropped by moving
    kept rows into their places in place; padding columns no row needs by moving the start.
    The prefill returns exactly what ``DynamicLayer`` returns, so the prefill attention is unchanged."""
    import torch
    from transformers.cache_utils import DynamicLayer

    class CompactLayer(DynamicLayer):
        def __init__(self, capacity: int):
            super().__init__()
            self.capacity = capacity
            self.rows = self.start = self.end = 0
            self.buf_k = self.buf_v = None

        def _views(self):
            self.keys = self.buf_k[: self.rows, :, self.start:self.end]
            self.values = self.buf_v[: self.rows, :, self.start:self.end]

        def update(self, key_states, value_states, *args, **kwargs):
            T = key_states.shape[-2]
            if self.buf_k is None:  # the prefill
                if not self.is_initialized:
                    self.lazy_initialization(key_states, value_states)
                keys = torch.cat([self.keys, key_states], dim=-2)
                values = torch.cat([self.values, value_states], dim=-2)
                B, H, _, D = keys.shape
                self.buf_k = keys.new_empty((B, H, max(self.capacity, T), D))
                self.buf_v = values.new_empty((B, values.shape[1], max(self.capacity, T), values.shape[-1]))
                self.buf_k[:, :, :T] = keys
                self.buf_v[:, :, :T] = values
                self.rows, self.end = B, T
                self._views()
                return keys, values
            if self.end + T > self.buf_k.shape[2]:
                raise RuntimeError("compact decode cache: capacity exceeded")  # a bug, never user input
            self.buf_k[: self.rows, :, self.end:self.end + T] = key_states
            self.buf_v[: self.rows, :, self.end:self.end + T] = value_states
            self.end += T
            self._views()
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.end - self.start if self.buf_k is not None else 0

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
                    self.buf_k[j, :, self.start:self.end].copy_(self.buf_k[a, :, self.start:self.end])
                    self.buf_v[j, :, self.start:self.end].copy_(self.buf_v[a, :, self.start:self.end])
            self.rows = len(order)
            self._views()

        def drop_leading(self, n: int) -> None:
            self.start += n
            self._views()

    return CompactLayer


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
                 check_final: bool):
        self.tok = tokenizer
        self.prompt_len = prompt_len
        self.eos_ids = eos_ids
        self.newline_ids = newline_ids
        self.check_final = check_final
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
            elif self.check_final and t in self.newline_ids:
                text = self.tok.decode(input_ids[i, self.prompt_len:], skip_special_tokens=True)
                if final_line_done(text):
                    self.end[i] = L
                    self.reason[i] = "final_line"
        return torch.tensor([e is not None for e in self.end], dtype=torch.bool, device=input_ids.device)


class TransformersGenerator(Generator):
    backend = "transformers"

    def __init__(self, spec, path: Path, adapter=None, batch_size="auto", dtype="auto",
                 max_new_tokens: int = 48, cache_dir=None, stop_at_final: bool = True,
                 device: Optional[str] = None, token_budget: Optional[int] = None,
                 max_batch: Optional[int] = None, num_threads: Optional[int] = None,
                 attention: str = "auto", show_progress: bool = True, decode: str = "compact"):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ..models import adapter_hash, weights_hash

        if num_threads:
            torch.set_num_threads(int(num_threads))
        self.spec = spec
        self.path = Path(path)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.torch_dtype = resolve_dtype(dtype, self.device)
        self.batch_size = batch_size
        self.max_new_tokens = int(max_new_tokens)
        self.stop_at_final = bool(stop_at_final)
        gpu = self.device.startswith("cuda")
        self.token_budget = int(token_budget or (131072 if gpu else 24576))
        self.max_batch = int(max_batch or (256 if gpu else 64))
        self.show_progress = show_progress
        if decode not in DECODE_LOOPS:
            raise ConfigError(f"transformers backend option decode must be one of {list(DECODE_LOOPS)}, "
                              f"got {decode!r}")
        self.decode = decode
        # counters of the compact loop, summed over calls: decoded row-steps, padding columns cut
        self.decode_stats = {"batches": 0, "row_steps": 0, "steps": 0, "padding_columns_cut": 0}

        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if attention == "auto":
            attention = "sdpa" if gpu else register_cpu_attention()
        elif attention == CPU_ATTENTION:
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
        gc = self.model.generation_config
        eos = gc.eos_token_id if gc.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos])
        self.eos_ids.discard(None)
        self.newline_ids = self._newline_token_ids()
        super().__init__({
            "model": spec.name, "weights_sha256": weights_hash(self.path, cache_dir),
            "adapter_sha256": a_hash, "backend": self.backend,
            "prompt_format": {"chat": spec.chat, "system_turn": spec.system_turn},
            "decoding": {"greedy": True, "max_new_tokens": self.max_new_tokens,
                         "stop_at_final": self.stop_at_final, "attention": self.attention,
                         "dtype": str(self.torch_dtype).replace("torch.", "")},
        })

    def _newline_token_ids(self) -> set[int]:
        ids = range(len(self.tokenizer))
        texts = self.tokenizer.batch_decode([[i] for i in ids])
        return {i for i, t in zip(ids, texts) if "\n" in t}

    # -- request building -----------------------------------------------------------------------
    def render(self, prompt: str) -> tuple[str, bool]:
        from ..models import render_prompt
        return render_prompt(self.tokenizer, self.spec, prompt)

    def encode(self, prompts: list[str]) -> list[list[int]]:
        out = []
        for p in prompts:
            text, special = self.render(p)
            out.append(self.tokenizer(text, add_special_tokens=special)["input_ids"])
        return out

    def plan_batches(self, lengths: list[int]) -> list[list[int]]:
        """Indices grouped into batches, longest prompts first (see the module docstring)."""
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        if isinstance(self.batch_size, int):
            return [order[k:k + self.batch_size] for k in range(0, len(order), self.batch_size)]
        batches: list[list[int]] = []
        cur: list[int] = []
        for i in order:
            longest = lengths[cur[0]] if cur else lengths[i]
            if cur and ((len(cur) + 1) * (longest + self.max_new_tokens) > self.token_budget
                        or len(cur) >= self.max_batch):
                batches.append(cur)
                cur = []
            cur.append(i)
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
            if all(len(b) <= self.max_batch and len(b) * (lengths[b[0]] + self.max_new_tokens) <= self.token_budget
                   for b in even):
                batches = even
        return batches

    # -- generation -----------------------------------------------------------------------------
    def _generate_batches(self, prompts: list[str], desc: Optional[str]) -> Iterator[tuple[list[int], list[Reply]]]:
        ids = self.encode(prompts)
        batches = self.plan_batches([len(x) for x in ids])
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
        """The compact loop reimplements plain greedy decoding only: models whose generation config
        asks for logits processors (repetition penalty, suppressed tokens, ...) or whose cache is not
        a plain dynamic cache (sliding windows, linear attention) use ``generate``."""
        ok = getattr(self, "_compact_checked", None)
        if ok is None:
            from transformers import DynamicCache
            from transformers.cache_utils import DynamicLayer
            gc = self.model.generation_config
            plain = ((gc.repetition_penalty in (None, 1.0)) and not gc.no_repeat_ngram_size
                     and not gc.bad_words_ids and not gc.suppress_tokens and not gc.begin_suppress_tokens
                     and not gc.min_length and not gc.min_new_tokens and gc.forced_bos_token_id is None
                     and gc.forced_eos_token_id is None and not gc.sequence_bias
                     and getattr(gc, "encoder_repetition_penalty", None) in (None, 1.0)
                     and not self.model.config.is_encoder_decoder)
            try:
                cache = DynamicCache(config=self.model.config)
                plain = plain and bool(cache.layers) and all(type(x) is DynamicLayer for x in cache.layers)
            except Exception:  # a model whose cache cannot be built from its config alone
                plain = False
            ok = self._compact_checked = plain
        return ok

    def _decode_generate(self, input_ids, attn) -> list[tuple[list[int], str]]:
        """``model.generate`` on the whole batch; finished rows keep decoding until the last ends."""
        import torch
        P = input_ids.shape[1]
        stop = _StopCriteria(self.tokenizer, P, self.eos_ids, self.newline_ids, self.stop_at_final)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids, attention_mask=attn, max_new_tokens=self.max_new_tokens,
                do_sample=False, temperature=None, top_p=None, top_k=None,
                pad_token_id=self.tokenizer.pad_token_id, stopping_criteria=[stop])
        rows = []
        for row in range(input_ids.shape[0]):
            end = stop.end[row] if stop.end and stop.end[row] is not None else out.shape[1]
            rows.append((out[row, P:end].tolist(), stop.reason[row] if stop.reason else "length"))
        return rows

    def _decode_compact(self, input_ids, attn) -> list[tuple[list[int], str]]:
        """Greedy decoding that drops finished rows after every step (see the module docstring).

        Mirrors ``generate``: position ids = cumulative sum of the mask - 1 (0 on padding), the mask
        dropped altogether when there is no padding, float32 argmax of the last logits, the EOS token
        not part of the reply, a FINAL-line check when the new token holds a newline."""
        import torch
        from transformers import DynamicCache

        model = self.model
        B = input_ids.shape[0]
        pos = (attn.long().cumsum(-1) - 1).masked_fill(attn == 0, 0)
        mask = None if bool((attn == 1).all()) else attn
        cache = DynamicCache(config=model.config)
        layer_cls = _compact_layer_class()
        cache.layers = [layer_cls(input_ids.shape[1] + self.max_new_tokens) for _ in cache.layers]
        new: list[list[int]] = [[] for _ in range(B)]
        reason = ["length"] * B
        active = list(range(B))                  # batch row -> original row
        last_pos = pos[:, -1]
        with torch.inference_mode():
            out = model(input_ids=input_ids, attention_mask=mask, position_ids=pos, cache=cache,
                        use_cache=True, logits_to_keep=1, return_dict=True)
            stats = self.decode_stats
            stats["batches"] += 1
            for step in range(self.max_new_tokens):
                stats["steps"] += 1
                stats["row_steps"] += len(active)
                nxt = torch.argmax(out.logits[:, -1].to(dtype=torch.float32), dim=-1)
                del out
                keep = []
                for a, t in enumerate(nxt.tolist()):
                    r = active[a]
                    if t in self.eos_ids:
                        reason[r] = "eos"
                        continue
                    new[r].append(t)
                    if (self.stop_at_final and t in self.newline_ids
                            and final_line_done(self.tokenizer.decode(new[r], skip_special_tokens=True))):
                        reason[r] = "final_line"
                        continue
                    keep.append(a)
                if not keep or step == self.max_new_tokens - 1:
                    break
                if len(keep) < len(active):
                    keep = _fill_holes(keep)
                    idx = torch.tensor(keep, device=nxt.device)
                    cache.batch_select_indices(idx)
                    active = [active[a] for a in keep]
                    nxt, last_pos = nxt[idx], last_pos[idx]
                    if mask is not None:
                        mask = mask[idx]
                        lead = int((mask.sum(0) == 0).long().cumprod(0).sum())  # padding no row needs
                        if lead:
                            stats["padding_columns_cut"] += lead
                            mask = mask[:, lead:]
                            for layer in cache.layers:
                                layer.drop_leading(lead)
                if mask is not None:
                    mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
                last_pos = last_pos + 1
                out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last_pos[:, None],
                            cache=cache, use_cache=True, logits_to_keep=1, return_dict=True)
        return [(new[r], reason[r]) for r in range(B)]
