"""The row prefill of the compact decode loop: each prompt's prefill computed for its row alone,
so that what a row gets does not depend on the batch (the bf16 CPU scheme of
:mod:`memtoc.generation.backends.hf`).

:meth:`RowPrefill._prefill_rows` runs each prompt in one forward; :meth:`RowPrefill._prefill_chunks`
(``prefill_chunk`` > 0, the default) cuts it at every multiple of C tokens and computes each distinct
chunk once. Both write the *aligned* layout of
:meth:`memtoc.generation.backends.engine.compact.CompactDecoder._decode_rows` (row r's prompt in columns 0..n_r-1).
"""
from __future__ import annotations

import torch

PREFILL_TAILS = ("steps", "chunk")


def tail_order(lens: list[int], chunk: int) -> list[int]:
    """Row order for :meth:`RowPrefill._tail_steps`: longest last chunk (1..``chunk`` tokens of a
    prompt of ``lens[r]`` tokens) first, ties in the given order."""
    return sorted(range(len(lens)), key=lambda r: (-(lens[r] - chunk * ((lens[r] - 1) // chunk)), r))


class RowPrefill:
    """The row prefills of :class:`memtoc.generation.backends.engine.compact.CompactDecoder` (a mixin: it uses the
    decoder's ``_new_cache``, ``_forward``, ``_position_masks`` and ``_step_mask``)."""

    def _prefill_rows(self, input_ids, attn):
        """Each row's prompt computed alone (batch 1, no padding, nothing before it), i.e. as the
        canonical forward computes it: the prompt's keys / values and first logits then cannot
        depend on the other rows of the batch."""
        B, P = input_ids.shape
        lens = attn.sum(-1).tolist()
        cap = P + self.max_new_tokens
        bufs: list = []
        logits = []
        for r, n in enumerate(lens):
            one = self._new_cache(n)
            out = self._forward(one, n, input_ids=input_ids[r:r + 1, P - n:], logits_to_keep=1)
            if not bufs:
                bufs = [(x.buf_k.new_zeros((B, x.buf_k.shape[1], cap, x.buf_k.shape[3])),
                         x.buf_v.new_zeros((B, x.buf_v.shape[1], cap, x.buf_v.shape[3]))) for x in one.layers]
            for (bk, bv), x in zip(bufs, one.layers):
                bk[r, :, :n] = x.buf_k[0, :, :n]
                bv[r, :, :n] = x.buf_v[0, :, :n]
            logits.append(out.logits[0, -1])
            self.decode_stats["prefill_calls"] += 1
        cache = self._new_cache(cap)
        for layer, (bk, bv) in zip(cache.layers, bufs):
            layer.preload(bk, bv, P)
        self.decode_stats["prompt_tokens_computed"] += int(sum(lens))
        return cache, torch.stack(logits)

    def _prefill_chunks(self, input_ids, attn):
        """The row prefill in chunks of ``prefill_chunk`` tokens, shared chunks computed once.

        A prompt's canonical prefill: its tokens cut at every multiple of C, each chunk computed
        after the exact keys / values of the chunks before it; the last chunk (1..C tokens) gives
        the first logits. Chunk j of a prompt is a function of its first (j+1) C tokens only (named
        by :meth:`_chunk_chain`), so it is computed once per distinct prefix and kept
        (``chunk_memo_mb``, least recently used first out): a formulation's instruction is computed
        once for a whole run. The full chunks of one depth are computed together (rows of C tokens
        after jC keys each: the same shapes for every row, no padding). The last chunk (``prefill_tail``):
        ``steps`` (the default) feeds its tokens one at a time, as decode steps of the aligned cache
        for all the rows together (:meth:`_tail_steps`); ``chunk`` runs it as one forward per row
        (one model call per prompt: on 64 bench prompts a quarter of the prefill's time). What a row
        gets then does not depend on the batch, as long as a row's result does not depend on the
        other rows of the same shapes (``linear`` at >= 2 rows is checked at load; attention is
        tested end to end)."""
        B, P = input_ids.shape
        C, dev, stats = self.prefill_chunk, input_ids.device, self.decode_stats
        lens = attn.sum(-1).tolist()
        ids = [input_ids[r, P - n:].tolist() for r, n in enumerate(lens)]
        chains = [self._chunk_chain(x, (n - 1) // C) for x, n in zip(ids, lens)]
        held = self._full_chunks(chains, dev)
        if self.prefill_tail == "steps":
            order = tail_order(lens, C)
            if order == list(range(B)):
                return self._tail_steps(ids, chains, held, P)
            cache, logits = self._tail_steps([ids[r] for r in order], [chains[r] for r in order], held, P)
            back = torch.tensor(sorted(range(B), key=order.__getitem__), device=dev)
            for layer in cache.layers:     # rows back in the caller's order (the decode loop sorts first)
                layer.preload(layer.buf_k.index_select(0, back), layer.buf_v.index_select(0, back), layer.end)
            return cache, logits[back]
        cap = P + self.max_new_tokens
        big = None
        logits = []
        for r, (x, chain) in enumerate(zip(ids, chains)):
            start = len(chain) * C
            store, last = self._run_chunk(held, [chain], torch.tensor([x[start:]], device=dev), logits=True)
            if big is None:   # layers, 2, rows, heads, columns, dim
                big = store.new_zeros(store.shape[:2] + (B, store.shape[3], cap, store.shape[5]))
            big[:, :, r, :, :len(x)] = store[:, :, 0]
            logits.append(last[0])
            stats["prompt_tokens_computed"] += len(x) - start
            stats["prefill_calls"] += 1
        cache = self._new_cache(cap)
        for layer, kv in zip(cache.layers, big):
            layer.preload(kv[0], kv[1], P)
        return cache, torch.stack(logits)

    def _full_chunks(self, chains: list[list[int]], dev) -> dict:
        """The keys / values of every full chunk of ``chains`` (name -> (layers, 2, heads, C, dim)),
        from the memo or computed, one depth at a time. (Keeping each chunk's whole prefix instead,
        one copy per row's past, was measured 1.5x slower on the bench prompts: the larger copies
        cost more than the fewer calls saved.)"""
        C, stats = self.prefill_chunk, self.decode_stats
        held: dict = {}     # every chunk this call uses, whatever the memo evicts meanwhile
        for j in range(max(len(c) for c in chains)):
            level: dict = {}
            for chain in chains:
                if len(chain) > j:
                    level.setdefault(chain[j], chain[:j + 1])
            todo = []
            for cid, chain in level.items():
                if cid in self._chunk_memo:
                    self._chunk_memo.move_to_end(cid)
                    held[cid] = self._chunk_memo[cid]
                else:
                    todo.append(chain)
            per_call = max(1, self.prefill_tokens // ((j + 1) * C))
            for s in range(0, len(todo), per_call):
                part = todo[s:s + per_call]
                tokens = torch.tensor([self._chunk_tokens[c[-1]] for c in part], device=dev)
                store, _ = self._run_chunk(held, [c[:-1] for c in part], tokens, logits=False)
                for u, chain in enumerate(part):
                    held[chain[-1]] = store[:, :, u, :, j * C:].clone()
                    self._memo_put(chain[-1], held[chain[-1]])
                stats["prompt_tokens_computed"] += len(part) * C
                stats["prefill_calls"] += 1
        return held

    def _tail_steps(self, ids: list[list[int]], chains: list[list[int]], held: dict, P: int):
        """(cache, first logits) of prompts ``ids`` whose full chunks (``chains``) are in ``held``:
        each row's full chunks copied into an aligned cache (columns 0..jC-1), then its last 1..C
        tokens fed one per step, every row at its own column, as the decode loop's steps are
        (:meth:`memtoc.generation.backends.engine.compact.CompactDecoder._decode_rows`). The rows come sorted by
        tail length, longest first (:func:`tail_order`), so the rows still feeding are always the
        first k of the cache; a row whose tail is done while fewer than two rows feed goes on as a
        ghost, feeding its last token again at its last column (the same keys / values and logits
        again: no step runs on one row). Returns the cache with ``end`` = widest full part + longest
        tail (a step counter; the aligned decode writes by column)."""
        C, stats = self.prefill_chunk, self.decode_stats
        B = len(ids)
        dev = self.model.device
        starts = [len(c) * C for c in chains]
        tails = [x[s:] for x, s in zip(ids, starts)]
        T = [len(t) for t in tails]
        if B < 2 or any(a < b for a, b in zip(T, T[1:])):
            raise ValueError("_tail_steps wants two rows or more, longest tail first")  # a bug, never input
        cap = P + self.max_new_tokens
        layers, heads, dim = self._kv_dims()
        big = torch.zeros((layers, 2, B, heads, cap, dim), dtype=self.torch_dtype, device=dev)
        for r, chain in enumerate(chains):
            self._place_chunks(big, r, chain, held)
        F = max(starts)
        cache = self._new_cache(cap)
        for layer, kv in zip(cache.layers, big):
            layer.preload(kv[0], kv[1], F)
        valid = torch.zeros((B, cap), dtype=torch.bool, device=dev)
        for r, s in enumerate(starts):
            valid[r, :s] = True
        cols = torch.arange(cap, device=dev)
        first: list = [None] * B
        for step in range(T[0]):
            k = max(2, sum(t > step for t in T))
            at = [min(step, T[r] - 1) for r in range(k)]
            pos = torch.tensor([starts[r] + a for r, a in enumerate(at)], device=dev)
            toks = torch.tensor([[tails[r][a]] for r, a in enumerate(at)], device=dev)
            valid[torch.arange(k, device=dev), pos] = True
            for layer in cache.layers:
                layer.rows, layer.cols = k, pos
            mask = self._step_mask(valid[:k], cols[None, :].expand(k, -1), pos)
            out = self._forward(cache, F + step + 1, input_ids=toks, attention_mask=mask,
                                position_ids=pos[:, None], logits_to_keep=1)
            for r in range(k):
                if T[r] == step + 1:
                    first[r] = out.logits[r, -1]
            stats["prefill_calls"] += 1
        stats["prompt_tokens_computed"] += sum(T)
        for layer in cache.layers:
            layer.rows, layer.cols = B, None
            layer._views()
        return cache, torch.stack(first)

    def _place_chunks(self, dst, row: int, chain: list[int], held: dict) -> None:
        """Copy the keys / values of the chunks named ``chain`` (from ``held``) into row ``row`` of
        ``dst`` (layers, 2, rows, heads, columns, dim), chunk i at columns iC..(i+1)C-1."""
        C = self.prefill_chunk
        for i, cid in enumerate(chain):
            dst[:, :, row, :, i * C:(i + 1) * C] = held[cid]

    def _kv_dims(self) -> tuple[int, int, int]:
        """(layers, key / value heads, head dim) of the model's cache."""
        cfg = self.model.config.get_text_config()
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cfg.num_hidden_layers, heads, dim

    def _chunk_chain(self, tokens: list[int], n: int) -> list[int]:
        """Names of the first ``n`` chunks of a prompt: chunk j's name stands for the prompt's first
        (j+1) C tokens (a name per (name of the chunk before, this chunk's tokens), kept for the
        generator's life, so that a name means the same prefix in every call)."""
        C = self.prefill_chunk
        names, tokens_of = self._chunk_names, self._chunk_tokens
        chain, parent = [], -1
        for j in range(n):
            piece = tuple(tokens[j * C:(j + 1) * C])
            parent = names.setdefault((parent, piece), len(names))
            if parent == len(tokens_of):
                tokens_of.append(piece)
            chain.append(parent)
        return chain

    def _run_chunk(self, held: dict, pasts: list[list[int]], tokens, logits: bool):
        """One forward of ``tokens`` (rows, T) after each row's past (``pasts[u]``: the names of
        its chunks before, the same count for every row; their keys / values in ``held``); returns
        (every layer's keys / values (layers, 2, rows, heads, past + T, dim), the last logits or
        None)."""
        n, T = tokens.shape
        start = len(pasts[0]) * self.prefill_chunk
        cache = self._new_cache(start + T)
        store = None
        if start:
            first = held[pasts[0][0]]                                   # layers, 2, heads, C, dim
            store = first.new_empty(first.shape[:2] + (n, first.shape[2], start + T, first.shape[4]))
            for u, chain in enumerate(pasts):
                self._place_chunks(store, u, chain, held)
            for layer, kv in zip(cache.layers, store):
                layer.preload(kv[0], kv[1], start)
        pos = torch.arange(start, start + T, device=tokens.device).expand(n, T)
        mask = None
        if self.sliding_window:
            every = torch.ones((n, start + T), dtype=torch.bool, device=tokens.device)
            mask = self._position_masks(every, torch.arange(start + T, device=tokens.device).expand(n, -1), pos,
                                        every[:, start:])
        out = self._forward(cache, start + T, input_ids=tokens, attention_mask=mask, position_ids=pos,
                            logits_to_keep=1)
        if store is None:
            store = torch.stack([torch.stack([x.buf_k, x.buf_v]) for x in cache.layers])
        return store, (out.logits[:, -1] if logits else None)

    def _memo_put(self, name: int, kv) -> None:
        memo = self._chunk_memo
        memo[name] = kv
        self._chunk_memo_bytes += kv.numel() * kv.element_size()
        while self._chunk_memo_bytes > self.chunk_memo_mb * 2 ** 20 and len(memo) > 1:
            _, old = memo.popitem(last=False)
            self._chunk_memo_bytes -= old.numel() * old.element_size()
