"""The row prefill of the compact decode loop: each prompt's prefill computed for its row alone,
so that what a row gets does not depend on the batch (the bf16 CPU scheme of
:mod:`memtoc.backends.hf`).

:meth:`RowPrefill._prefill_rows` runs each prompt in one forward; :meth:`RowPrefill._prefill_chunks`
(``prefill_chunk`` > 0, the default) cuts it at every multiple of C tokens and computes each distinct
chunk once. Both write the *aligned* layout of
:meth:`memtoc.backends.compact.CompactDecoder._decode_compact` (row r's prompt in columns 0..n_r-1).
"""
from __future__ import annotations

import torch


class RowPrefill:
    """The row prefills of :class:`memtoc.backends.compact.CompactDecoder` (a mixin: it uses the
    decoder's ``_new_cache``, ``_forward`` and ``_position_masks``)."""

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
        after jC keys each: the same shapes for every row, no padding); the last chunk of each row
        alone. What a row gets then does not depend on the batch, as long as a row's result does not
        depend on the other rows of the same shapes (``linear`` at >= 2 rows is checked at load;
        attention is tested end to end)."""
        B, P = input_ids.shape
        C, dev, stats = self.prefill_chunk, input_ids.device, self.decode_stats
        lens = attn.sum(-1).tolist()
        ids = [input_ids[r, P - n:].tolist() for r, n in enumerate(lens)]
        chains = [self._chunk_chain(x, (n - 1) // C) for x, n in zip(ids, lens)]
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
            C = self.prefill_chunk
            first = held[pasts[0][0]]                                   # layers, 2, heads, C, dim
            store = first.new_empty(first.shape[:2] + (n, first.shape[2], start + T, first.shape[4]))
            for u, chain in enumerate(pasts):
                for i, cid in enumerate(chain):
                    store[:, :, u, :, i * C:(i + 1) * C] = held[cid]
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
