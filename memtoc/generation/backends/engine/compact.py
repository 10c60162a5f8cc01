"""The compact greedy decode loop of the transformers backend, its prefills and its KV cache.

One prefill of the left-padded batch (or the shared-prefix prefill: each shared prompt segment of
:func:`memtoc.generation.backends.engine.prefix.prefix_segments` computed once), then one token per step with keys
and values written in place into a buffer sized once (:class:`CompactLayer`); after each
step the finished rows leave the batch. The maths, the stop rules and the canonical tie-break are
those of :mod:`memtoc.generation.backends.hf` (whose module docstring describes them);
:class:`CompactDecoder` is the part of :class:`memtoc.generation.backends.hf.TransformersGenerator` that runs
them, and reads the generator's settings (``max_new_tokens``, ``share_prefix``, ``tie_margin``,
``sliding_window``, ``attention``, ...).
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch
import transformers
from transformers.cache_utils import DynamicCache, DynamicLayer

from memtoc.core.errors import MemtocError
from memtoc.generation.backends.base import line_stop
from memtoc.generation.backends.engine.prefix import leaves_by_row, path as prefix_path, prefix_segments
from memtoc.generation.backends.engine.rowprefill import RowPrefill, tail_order


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
    raise GenerationError(f"{type(model).__name__}.forward (transformers {transformers.__version__}) takes "
                          "neither `cache` nor `past_key_values`; set the transformers backend option "
                          "decode: generate, or install transformers >= 5.20")


class CompactLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys / values live in one buffer allocated at the prefill (prompt +
    ``max_new_tokens`` columns, the unfilled ones zero); a decode step writes its column in place.
    ``DynamicLayer`` instead concatenates, i.e. allocates and copies the whole cache at every step
    and every layer (60 concatenations of 64 x 3 x 230 x 64 bf16 took ~190 ms on one thread of a
    2-core CPU under load).

    A one-token step gets the *whole* buffer of the live rows back, ``buf[:rows]``: contiguous,
    because a view of only the filled columns is strided and the CPU bf16 batched matmul copies a
    strided operand first (measured: 1.48 ms vs 0.54 ms for one layer's decode attention at batch
    64 x 220 keys, i.e. ~28 ms of a ~108 ms step). The compact loop passes a 4-D boolean mask of the
    same width whose unfilled columns are False, and the unfilled keys / values are zeros (a masked
    column then adds exactly nothing). Longer inputs (the prefill, the shared-prefix levels) get the
    filled part, as ``DynamicLayer`` returns it. Finished rows are dropped by moving kept rows into
    their places in place (so ``buf[:rows]`` stays contiguous)."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.rows = self.end = 0
        self.buf_k = self.buf_v = None
        # the aligned layout (row prefill): each row's one-token step writes at its own column,
        # ``cols[row]`` (its position), set by the decode loop before every step; None = one column
        self.cols = None

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
            aligned_step = T == 1 and self.cols is not None   # writes by column; ``end`` counts steps
            if self.end + T > self.buf_k.shape[2] and not aligned_step:
                raise RuntimeError("compact decode cache: capacity exceeded")  # a bug, never user input
            if aligned_step:
                rows = torch.arange(self.rows, device=self.buf_k.device)
                self.buf_k[rows, :, self.cols] = key_states[:, :, 0]
                self.buf_v[rows, :, self.cols] = value_states[:, :, 0]
            else:
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
        is both read and overwritten (the hole-filling order of :func:`fill_holes`), else copies."""
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


def sliding_window_of(config) -> Optional[int]:
    """The window of a model with sliding-window layers (``layer_types`` has ``sliding_attention``:
    gemma-2, gemma-3, ...), else None."""
    kinds = getattr(config, "layer_types", None) or []
    w = getattr(config, "sliding_window", None)
    return int(w) if w and "sliding_attention" in kinds else None


def fill_holes(keep: list[int]) -> list[int]:
    """Old batch positions for the new rows 0..n-1 (``keep`` sorted, n = len(keep)): kept rows below
    n stay where they are, the kept rows at n or above move into the freed places below n. Only as
    many cache rows move as rows finished (each row's maths does not depend on its place in the
    batch)."""
    n = len(keep)
    kept = set(keep)
    movers = iter(a for a in keep if a >= n)
    return [p if p in kept else next(movers) for p in range(n)]

def chunk_inputs(chunk, slots, pad: int):
    """One shared-prefix forward call's inputs for segments ``chunk`` (one tree depth): token ids
    (n, S), each segment left-padded to the longest; the keep-mask (n, W + S) over the ancestors'
    W store columns (right-aligned, the gap masked) then the segment; the positions (n, S); and the
    store slots (n, W) of the ancestors' keys / values (``slots(index)``: a segment path's slots)."""
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
    return inp, mask, pos, past


def store_chunk(cache, chunk, width: int, slot0: list[int], store_k: list, store_v: list, total: int) -> None:
    """Copy the keys / values a forward over ``chunk`` computed (each segment's tokens, the last
    columns of its row, ``width`` columns in all) to their store slots (``slot0[segment]`` onward);
    the per-layer stores of ``total`` slots are created on first use."""
    dev = cache.layers[0].buf_k.device
    if not store_k:
        for layer in cache.layers:
            _, hk, _, dk = layer.buf_k.shape
            _, hv, _, dv = layer.buf_v.shape
            store_k.append(layer.buf_k.new_zeros((total, hk, dk)))
            store_v.append(layer.buf_v.new_zeros((total, hv, dv)))
    rows_j = torch.tensor([j for j, s in enumerate(chunk) for _ in s.tokens], device=dev)
    cols = torch.tensor([width - len(s.tokens) + t for s in chunk for t in range(len(s.tokens))], device=dev)
    dst = torch.tensor([slot0[s.index] + t for s in chunk for t in range(len(s.tokens))], device=dev)
    for layer, sk, sv in zip(cache.layers, store_k, store_v):
        sk[dst] = layer.buf_k[rows_j, :, cols]
        sv[dst] = layer.buf_v[rows_j, :, cols]


class CompactDecoder(RowPrefill):
    """The compact loop's methods of :class:`memtoc.generation.backends.hf.TransformersGenerator`."""

    # -- masks (sliding-window models, eager attention) -------------------------------------------
    def _mask_value(self, keep):
        """A 4-D boolean keep-mask as the attention kernel wants it: boolean for SDPA and memtoc_cpu,
        additive (0 / dtype min) for eager, which adds the mask to the scores."""
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

    def _step_mask(self, valid, key_pos, q_pos):
        """The mask of a one-token step (the decode loop's, the stepped last chunks'): the 4-D
        boolean ``valid`` (rows, columns) as wide as the cache buffer, or, for sliding-window models
        and eager attention, the position masks of :meth:`_position_masks` (``key_pos``: each
        column's position; ``q_pos``: each row's position this step)."""
        if self.sliding_window or self.attention == "eager":
            return self._position_masks(valid, key_pos, q_pos[:, None],
                                        torch.ones((len(q_pos), 1), dtype=torch.bool, device=valid.device))
        return valid[:, None, None, :]

    def _forward(self, cache, expect: int, **kw):
        """``model(...)`` with ``cache`` under the model's own keyword; checks that the cache now
        holds ``expect`` columns (an older transformers that ignores the keyword would otherwise
        decode from nothing and return garbage)."""
        out = self.model(**{self.cache_kw: cache}, use_cache=True, return_dict=True, **kw)
        got = cache.get_seq_length()
        if got != expect:
            raise GenerationError(
                f"transformers {transformers.__version__}: {type(self.model).__name__} did not fill the KV cache "
                f"passed as `{self.cache_kw}` ({got} columns, expected {expect}); the compact decode loop cannot "
                "run with this version. Set the transformers backend option decode: generate, or install "
                "the transformers version in memtoc's lock")
        return out


    def _decode_compact(self, input_ids, attn) -> list[tuple[list[int], str]]:
        """Greedy replies of a left-padded batch by :meth:`_decode_rows`, the rows first put in the
        order the stepped last chunks want (longest last chunk first, :func:`tail_order`) and the
        replies given back in the caller's order."""
        order = None
        if self.row_prefill and self.prefill_chunk and self.prefill_tail == "steps":
            order = tail_order(attn.sum(-1).tolist(), self.prefill_chunk)
        if order is None or order == sorted(order):
            return self._decode_rows(input_ids, attn)
        rows = self._decode_rows(input_ids[order], attn[order])
        back: list = [None] * len(order)
        for a, r in enumerate(order):
            back[r] = rows[a]
        return back

    def _decode_rows(self, input_ids, attn) -> list[tuple[list[int], str]]:
        """Greedy decoding that drops finished rows after every step (see the module docstring).

        Mirrors ``generate``: position ids = cumulative sum of the mask - 1 (0 on padding), float32
        argmax of the last logits, the EOS token not part of the reply, a FINAL-line check when the
        new token holds a newline. Decode steps pass a 4-D boolean mask as wide as the cache buffer
        (see :class:`CompactLayer`).

        With ``row_prefill`` the cache is *aligned* (row r's prompt in columns 0..n_r-1, the token
        at position p in column p) and no step runs on a single row (a batch of one is decoded twice
        over; a finished row stays as a ghost while one row is left): see :mod:`memtoc.generation.backends.hf`."""
        aligned = self.row_prefill
        solo = aligned and input_ids.shape[0] == 1
        if solo:   # row 1 = a ghost copy of row 0
            input_ids, attn = input_ids.repeat(2, 1), attn.repeat(2, 1)
        B, P = input_ids.shape
        new: list[list[int]] = [[] for _ in range(B)]
        reason = ["length"] * B
        active = list(range(B))                  # batch row -> original row
        lens = attn.sum(-1).tolist()
        prompt_ids: dict[int, list[int]] = {}    # a row's prompt without padding, for the tie-break
        with torch.inference_mode():
            if self.row_prefill:
                prefill = self._prefill_chunks if self.prefill_chunk else self._prefill_rows
                cache, logits = prefill(input_ids, attn)
            elif self.share_prefix and B > 1:
                cache, logits = self._prefill_shared(input_ids, attn)
            else:
                cache, logits = self._prefill_plain(input_ids, attn)
            base = cache.get_seq_length()      # columns the prefill counted (a step counter when aligned)
            last_pos = attn.long().sum(-1) - 1
            # column of a token = its position + its row's padding (none in the aligned layout)
            pad = torch.zeros_like(last_pos) if aligned else P - attn.long().sum(-1)
            # columns each row attends to in a decode step: its prompt, then the tokens decoded so
            # far; as wide as the cache buffer (see CompactLayer)
            valid = torch.zeros((B, P + self.max_new_tokens), dtype=torch.bool, device=input_ids.device)
            cols = torch.arange(valid.shape[1], device=input_ids.device)
            valid[:, :P] = (cols[None, :P] <= last_pos[:, None]) if aligned else attn.bool()
            # finished rows (a ghost row stays in the batch; the copy of a batch of one is a ghost)
            done = [solo and r > 0 for r in range(B)]
            stats = self.decode_stats
            stats["batches"] += 1
            for step in range(self.max_new_tokens):
                stats["steps"] += 1
                stats["row_steps"] += sum(not done[r] for r in active)   # ghosts not counted
                nxt = torch.argmax(logits.to(dtype=torch.float32), dim=-1)
                for a in self._near_ties(logits):
                    r = active[a]
                    if done[r]:
                        continue
                    if r not in prompt_ids:
                        prompt_ids[r] = input_ids[r, P - lens[r]:].tolist()
                    nxt[a] = self._canonical_next(prompt_ids[r] + new[r])
                del logits
                keep = self._take_tokens(nxt.tolist(), active, new, reason, done)
                if not keep or step == self.max_new_tokens - 1:
                    break
                if aligned and len(keep) == 1:   # a finished row stays as a ghost: never one row
                    keep = sorted(keep + [next(a for a in range(len(active)) if a != keep[0])])
                if len(keep) < len(active):
                    keep = fill_holes(keep)
                    idx = torch.tensor(keep, device=nxt.device)
                    cache.batch_select_indices(idx)
                    active = [active[a] for a in keep]
                    nxt, last_pos, valid, pad = nxt[idx], last_pos[idx], valid[idx], pad[idx]
                last_pos = last_pos + 1
                if aligned:   # each row writes its own column: its position
                    valid[torch.arange(len(active), device=valid.device), last_pos] = True
                    for layer in cache.layers:
                        layer.cols = last_pos
                else:
                    valid[:, P + step] = True
                mask = self._step_mask(valid, cols[None, :] - pad[:, None], last_pos)
                logits = self._forward(cache, base + step + 1, input_ids=nxt[:, None], attention_mask=mask,
                                       position_ids=last_pos[:, None], logits_to_keep=1).logits[:, -1]
        return [(new[r], reason[r]) for r in range(1 if solo else B)]

    def _take_tokens(self, tokens: list[int], active: list[int], new: list[list[int]], reason: list[str],
                     done: list[bool]) -> list[int]:
        """Append each live row's new token (not EOS) to its reply, mark the rows that finish (EOS,
        a completed FINAL / first line: ``reason`` and ``done``), and return the batch positions
        of the rows that go on. Finished (ghost) rows are skipped."""
        keep = []
        for a, t in enumerate(tokens):
            r = active[a]
            if done[r]:
                continue
            if t in self.eos_ids:
                reason[r], done[r] = "eos", True
                continue
            new[r].append(t)
            if ((self.stop_at_final or self.stop_at_first_line) and t in self.newline_ids
                    and (rule := line_stop(self.tokenizer.decode(new[r], skip_special_tokens=True),
                                           self.stop_at_final, self.stop_at_first_line))):
                reason[r], done[r] = rule, True
                continue
            keep.append(a)
        return keep

    def _new_cache(self, capacity: int):
        cache = DynamicCache(config=self.model.config)
        cache.layers = [CompactLayer(capacity) for _ in cache.layers]
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

        The rows' prompts are cut into the segments of :func:`memtoc.generation.backends.engine.prefix.prefix_segments`
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
                inp, mask, pos, past = (x.to(dev) for x in chunk_inputs(chunk, slots, pad))
                S, W = inp.shape[1], past.shape[1]
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
                store_chunk(cache, chunk, W + S, slot0, store_k, store_v, total)
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
