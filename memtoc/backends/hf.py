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
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Iterator, Optional

from tqdm.auto import tqdm
from transformers import StoppingCriteria

from .base import Generator, Reply, final_line_done


CPU_ATTENTION = "memtoc_cpu"


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
                 attention: str = "auto", show_progress: bool = True):
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
        import torch

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
                P = input_ids.shape[1]
                stop = _StopCriteria(self.tokenizer, P, self.eos_ids, self.newline_ids, self.stop_at_final)
                with torch.inference_mode():
                    out = self.model.generate(
                        input_ids=input_ids, attention_mask=attn, max_new_tokens=self.max_new_tokens,
                        do_sample=False, temperature=None, top_p=None, top_k=None,
                        pad_token_id=self.tokenizer.pad_token_id, stopping_criteria=[stop])
                dt = time.perf_counter() - t0
                replies = []
                for row, i in enumerate(b):
                    end = stop.end[row] if stop.end and stop.end[row] is not None else out.shape[1]
                    new = out[row, P:end]
                    reason = stop.reason[row] if stop.reason else "length"
                    replies.append(Reply(text=self.tokenizer.decode(new, skip_special_tokens=True),
                                         n_prompt_tokens=len(ids[i]), n_new_tokens=int(new.shape[0]),
                                         seconds=dt / len(b), key="", cached=False, finish=reason))
                bar.update(len(b))
                yield b, replies
        finally:
            bar.close()
