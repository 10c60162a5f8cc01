"""Speed benchmarks: ``memtoc bench generation [--json] [--n 64]`` and ``memtoc bench stats``.

generation
    The same ``n`` with-tool prompts of the embedded model (reference formulation, the first
    questions of the deterministic selection, conditions tool_right / tool_wrong / tool_error in
    turn), generated twice with identical decoding settings (greedy, ``max_new_tokens``, the
    FINAL-line stop, the default dtype: bf16 with the row prefill on a CPU with bf16 instructions, else
    float32): once one prompt at a time (a ``generate`` loop, batch size 1) and once
    with the batched backend (``batch_size``; timed ``--repeats`` times, default 3, the median
    reported, every repeat listed; the loop runs once, its 64 prompts already span ~45 s). Reported
    per episode: seconds
    in each mode, their ratio, prompt and new tokens of each mode, and the compute bound

        (2 x non-embedding params x prompt tokens + 2 x params x new tokens) / matmul rate

    where the rate is the best of a few ``torch.matmul`` (2048 x 2048) timings in the dtype the model
    runs in, measured in the same run; ``bound_ratio`` = batched seconds / bound. Also reported: how
    many replies differ between the modes (0 by construction in both CPU defaults, see
    :mod:`memtoc.generation.backends.hf`; bf16 without the row prefill may flip a greedy token), how many near-tie steps were
    decided by the canonical batch-1 forward, and, with ``--check-stop``, how often
    the FINAL-line early stop changes the extracted answer (one extra batched run without it).
    Every timing starts cold: the prefill chunks the row prefill keeps between calls are dropped
    before each loop prompt and each batched run (``forget_prefixes``), so neither mode is timed on
    chunks another one computed. The CPU is shared: run it at a quiet moment and read ``load_avg``
    in the output.
    ``--decode`` picks the transformers decode loop for both modes (``compact``, the default, drops
    finished rows after each step; ``generate`` is ``model.generate``); ``--compare-decode`` times
    one more batched run with the other loop and counts the replies that differ between the loops.
    The batched compact loop computes each shared prompt prefix once (``share_prefix``; a batch of
    one has nothing to share, so the loop cannot): ``prompt_tokens_computed_per_episode_batched``
    says how many prompt tokens it really ran, while the bound counts every prompt token, as
    DESIGN.md defines it. ``--no-share-prefix`` turns the sharing off; ``--compare-share`` times one
    more batched run without it and counts the replies that differ (bf16 rounding of the different
    matrix shapes). ``--compare-tail`` (row prefill only) times one more batched run with the other
    ``prefill_tail`` (the prompts' last chunks as one-token steps, or one forward per prompt) and
    counts the replies that differ.

    ``--peer vllm`` (run it in the environment of ``make vllm-env``) starts vLLM's engine on the same model
    with memtoc's settings (its dtype, greedy, the token budget, the FINAL-line stop; ``--peer-option
    KEY=VALUE`` adds engine options such as ``enforce_eager=true``) and times it in turn with memtoc's
    batched engine (memtoc, vLLM, memtoc, vLLM, ... ``--repeats`` pairs, each cold: the prefix caches of
    both dropped), reporting both medians per episode, their ratio, the engine's start time, and the
    replies that differ from memtoc's (:func:`peer_comparison`).

stats
    ``memtoc.run.bench.stats_benchmark()`` (bootstrap and sign-flip timings), printed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any, Optional

import numpy as np

from memtoc.core import metrics, stats
from memtoc.core.errors import ConfigError
from memtoc.core.scoring import extract_final
from memtoc.core.vocab import ARM_CONDITIONS
from memtoc.data.benchmark import load_benchmark, select_questions
from memtoc.data.episodes import build_episodes
from memtoc.generation.hardware import release_memory
from memtoc.generation.models import load_generator


def matmul_rate(dtype: str = "bfloat16", n: int = 2048, repeats: int = 5) -> float:
    """Best observed FLOP/s of an n x n x n torch matmul in ``dtype`` (on the current device)."""
    import torch
    dt = getattr(torch, dtype)
    a = torch.randn(n, n, dtype=dt)
    b = torch.randn(n, n, dtype=dt)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def matmul_dtype(torch_dtype) -> str:
    """The ``torch`` dtype name of a model's dtype, for :func:`matmul_rate`."""
    return str(torch_dtype).replace("torch.", "")


def bench_prompts(n: int, release_dir: Optional[str] = None) -> list[str]:
    bench = load_benchmark(release_dir)
    conds = ARM_CONDITIONS
    qs = select_questions(bench.analysis, n, 0)
    prompts = []
    for i, q in enumerate(qs):
        ep = build_episodes([q], ["reference"], [conds[i % len(conds)]])[0]
        prompts.append(ep.prompt)
    return prompts[:n]


def stats_benchmark(n_questions: int = 542, n_boot: int = stats.DEFAULT_N_BOOT, n_perm: int = stats.DEFAULT_N_PERM,
                  seed: int = 0, repeats: int = 3) -> dict[str, Any]:
    """Time the full metric set of one synthetic arm (``n_questions`` questions x 3 formulations x
    the 4 core conditions) with ``n_boot`` cluster-bootstrap resamples (per-formulation and pooled
    CIs, ``metrics.summarize``), and one paired contrast with ``n_perm`` sign flips. Best of
    ``repeats``; returns seconds."""
    df = metrics.synthetic_arm(n_questions, seed=seed)
    t_boot = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        metrics.summarize(df, by=("model", "arm", "formulation"), n_boot=n_boot, seed=seed)
        t_boot.append(time.perf_counter() - t0)
    rng = np.random.default_rng(seed)
    treated = rng.integers(0, 2, 3 * n_questions)
    untreated = rng.integers(0, 2, 3 * n_questions)
    cluster = np.repeat(np.arange(n_questions), 3)
    t_perm, t_contrast = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        s, _, _ = stats.cluster_sums(treated - untreated, cluster)
        stats.sign_flip_pvalue(s, treated.size, 0.0, n_perm, seed=seed)
        t_perm.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        stats.paired_contrast(treated, untreated, cluster, n_boot=n_boot, n_perm=n_perm, seed=seed)
        t_contrast.append(time.perf_counter() - t0)
    n_metrics = len(metrics.CELL_METRICS)
    return {"n_questions": n_questions, "n_formulations": 3, "n_episodes": int(len(df)),
            "n_metrics": n_metrics, "n_boot": n_boot, "n_perm": n_perm,
            "seconds_metric_set_bootstrap": min(t_boot),
            "seconds_sign_flips": min(t_perm),
            "seconds_paired_contrast": min(t_contrast),
            "repeats": repeats}


def param_counts(model) -> tuple[int, int]:
    """(all parameters, non-embedding parameters); tied input/output embeddings counted once."""
    total = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight.numel()
    return total, total - emb


def bench_generation(n: int = 64, batch_size: Any = "auto", max_new_tokens: int = 48, dtype: str = "auto",
                     model: str = "smollm2-135m-instruct", check_stop: bool = False,
                     loop_n: Optional[int] = None, release_dir: Optional[str] = None,
                     decode: str = "compact", compare_decode: bool = False, share_prefix: bool = True,
                     compare_share: bool = False, repeats: int = 3, compare_tail: bool = False,
                     backend_options: Optional[dict[str, Any]] = None, peer: Optional[str] = None,
                     peer_options: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    import torch

    if peer is not None:
        check_peer(peer, peer_options or {})
    prompts = bench_prompts(n, release_dir)
    gen = load_generator(model, batch_size=batch_size, dtype=dtype, max_new_tokens=max_new_tokens,
                         show_progress=False, decode=decode, share_prefix=share_prefix, **(backend_options or {}))
    total_params, non_emb = param_counts(gen.model)
    rate_dtype = matmul_dtype(gen.torch_dtype)  # the bound at the rate of the dtype actually used
    rate = matmul_rate(rate_dtype)

    gen.generate(prompts[:2])  # warm-up (allocator, kernels), not timed
    gen.batch_size = 1
    loop, t_loop = [], 0.0
    for p in prompts[: (loop_n or n)]:
        _forget(gen)                   # one prompt at a time, nothing kept from the one before
        t0 = time.perf_counter()
        loop.append(gen.generate([p])[0])
        t_loop += time.perf_counter() - t0

    gen.batch_size = batch_size
    batched, batch_times, differing_repeats, decode_stats = _time_batched(gen, prompts, repeats)
    t_batch = statistics.median(batch_times)
    # the rate measured before the timings can come out low (frequency ramp, a neighbour's load):
    # measure again after them and keep the best, so the bound (and bound_ratio) is not flattered
    rate = max(rate, matmul_rate(rate_dtype))
    batches = gen.plan_batches([r.n_prompt_tokens for r in batched])  # sizes only: the same either order

    prompt_tok = sum(r.n_prompt_tokens for r in batched)
    new_tok = sum(r.n_new_tokens for r in batched)
    bound = (2 * non_emb * prompt_tok + 2 * total_params * new_tok) / rate / n
    s_loop, s_batch = t_loop / len(loop), t_batch / n
    out: dict[str, Any] = {
        "model": model, "n_episodes": n, "n_episodes_loop": len(loop), "batch_size": batch_size,
        "batch_sizes": [len(b) for b in batches], "dtype": str(gen.torch_dtype).replace("torch.", ""),
        "max_new_tokens": max_new_tokens, "stop_at_final": gen.stop_at_final,
        "s_per_episode_loop": s_loop, "s_per_episode_batched": s_batch,
        "s_per_episode_batched_repeats": [t / n for t in batch_times],
        "replies_differing_between_repeats": differing_repeats, "speedup_vs_loop": s_loop / s_batch,
        "compute_bound_s_per_episode": bound, "bound_ratio": s_batch / bound,
        "matmul_rate_gflops": rate / 1e9, "params": total_params, "non_embedding_params": non_emb,
        "prompt_tokens_per_episode_batched": prompt_tok / n, "new_tokens_per_episode_batched": new_tok / n,
        "prompt_tokens_per_episode_loop": sum(r.n_prompt_tokens for r in loop) / len(loop),
        "new_tokens_per_episode_loop": sum(r.n_new_tokens for r in loop) / len(loop),
        "replies_differing_loop_vs_batched": sum(a.text != b.text for a, b in zip(loop, batched)),
        "finish_batched": {k: sum(r.finish == k for r in batched) for k in ("eos", "final_line", "length")},
        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(), "torch": torch.__version__,
        "decode": decode, "decode_stats_batched": decode_stats, "share_prefix": share_prefix,
        "prompt_tokens_computed_per_episode_batched": decode_stats["prompt_tokens_computed"] / n,
        "tie_margin": getattr(gen, "tie_margin", None), "matmul_rate_dtype": rate_dtype,
        "max_batch": getattr(gen, "max_batch", None), "token_budget": getattr(gen, "token_budget", None),
    }
    out.update(_comparison_runs(gen, prompts, batched, t_batch, s_loop, bound, decode=decode,
                                share_prefix=share_prefix, compare_share=compare_share,
                                compare_decode=compare_decode, check_stop=check_stop, compare_tail=compare_tail))
    if peer is not None:
        out.update(peer_comparison(gen, prompts, batched, _peer_loader(peer, model, out["dtype"], max_new_tokens,
                                                                         peer_options or {}), repeats))
        out["peer_options"] = dict(peer_options or {})
    gen.close()
    return out


PEERS = ("vllm",)
#: what memtoc sets for both engines: a peer option may not change it
PEER_FIXED = ("backend", "dtype", "max_new_tokens", "stop_at_final", "show_progress", "adapter")


def check_peer(peer: str, options: dict[str, Any]) -> None:
    """Before any timing: the peer is known and installed, and its options leave memtoc's settings alone."""
    import importlib.util
    if peer not in PEERS:
        raise ConfigError(f"peer {peer!r}: the peers are {', '.join(PEERS)}")
    fixed = sorted(set(options) & set(PEER_FIXED))
    if fixed:
        raise ConfigError(f"--peer-option {', '.join(fixed)}: set by memtoc for both engines (the same dtype, "
                          "budget and stop rule); give engine options only, e.g. enforce_eager=true")
    if importlib.util.find_spec(peer) is None:
        raise ConfigError(f"--peer {peer}: the {peer} package is not installed here; run the benchmark in the "
                          "environment of `make vllm-env` (.venv-vllm/bin/memtoc bench generation --peer vllm)")


def _peer_loader(peer: str, model: str, dtype: str, max_new_tokens: int, options: dict[str, Any]):
    """A function that starts the peer engine with memtoc's decoding settings: the same model and weights,
    the dtype memtoc's engine runs in, greedy, the same token budget and FINAL-line stop."""
    if peer not in PEERS:
        raise ConfigError(f"--peer {peer!r}: the peers are {', '.join(PEERS)}")

    def load():
        release_memory("cuda" if _cuda() else None)      # memtoc's engine keeps its weights; free its cache
        return load_generator(model, backend=peer, dtype=dtype, max_new_tokens=max_new_tokens, show_progress=False,
                              **options)
    return load


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _peer_version(peer_gen) -> Optional[str]:
    from importlib import metadata
    for dist in (peer_gen.backend, f"{peer_gen.backend}-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def peer_comparison(gen, prompts: list[str], batched: list, load_peer, repeats: int) -> dict[str, Any]:
    """memtoc's batched engine and a peer engine (``load_peer()``: vLLM's, through memtoc's vLLM backend as
    02/03 run it) on the same prompts, timed in turn (memtoc, peer, memtoc, peer, ...; ``repeats`` pairs,
    each cold: memtoc's kept prefill chunks and the peer's prefix cache dropped before every run), medians
    reported. Both engines render the prompts with the model's own chat template into the same token ids
    and decode greedily with the same budget and stop rule, so the replies are compared one by one. The
    vLLM backend applies the FINAL-line rule as line-end stops (a reply that has not met it continues in
    another ``llm.generate`` round, from its own tokens, with the prompt in the prefix cache), so the
    peer's time includes those rounds, as a vLLM run of 02/03 does. On a GPU both engines share the
    device: give the peer ``--peer-option gpu_memory_utilization=...`` below what memtoc's engine leaves."""
    n = len(prompts)
    t0 = time.perf_counter()
    peer = load_peer()
    try:
        peer.generate(prompts[:2])                # warm-up, as for memtoc's engine; a lazy generator starts here
        t_start = time.perf_counter() - t0
        mine, theirs, first, differing_repeats = [], [], None, 0
        for _ in range(max(1, repeats)):
            _, t = _timed(gen, prompts)
            mine.append(t)
            reset = getattr(getattr(peer, "llm", None), "reset_prefix_cache", None)
            if reset is not None:
                reset()
            t1 = time.perf_counter()
            replies = peer.generate(prompts)
            theirs.append(time.perf_counter() - t1)
            if first is None:
                first = replies
            else:
                differing_repeats += sum(a.text != b.text for a, b in zip(first, replies))
        s_mine, s_peer = statistics.median(mine) / n, statistics.median(theirs) / n
        return {
            "peer": peer.backend, "peer_version": _peer_version(peer), "peer_engine_start_s": t_start,
            "s_per_episode_batched_interleaved": s_mine, "s_per_episode_peer": s_peer,
            "s_per_episode_peer_repeats": [t / n for t in theirs],
            "s_per_episode_batched_interleaved_repeats": [t / n for t in mine],
            "peer_over_memtoc": s_peer / s_mine,
            "replies_differing_memtoc_vs_peer": sum(a.text != b.text for a, b in zip(batched, first)),
            "replies_differing_between_peer_repeats": differing_repeats,
            "new_tokens_per_episode_peer": sum(r.n_new_tokens for r in first) / n,
        }
    finally:
        peer.close()


def _time_batched(gen, prompts: list[str], repeats: int) -> tuple[list, list[float], int, dict[str, int]]:
    """The batched run, ``repeats`` times (a short run is at the mercy of a neighbour's burst: the
    caller takes the median): (the first run's replies, every run's seconds, replies of the later
    runs that differ from the first, the first run's decode counters)."""
    stats0 = dict(gen.decode_stats)
    batched, t_first = _timed(gen, prompts)
    decode_stats = {k: gen.decode_stats[k] - stats0[k] for k in stats0}
    batch_times = [t_first]
    differing = 0
    for _ in range(repeats - 1):
        again, t = _timed(gen, prompts)
        batch_times.append(t)
        differing += sum(a.text != b.text for a, b in zip(again, batched))
    return batched, batch_times, differing, decode_stats


def _comparison_runs(gen, prompts: list[str], batched: list, t_batch: float, s_loop: float, bound: float, *,
                     decode: str, share_prefix: bool, compare_share: bool, compare_decode: bool,
                     check_stop: bool, compare_tail: bool = False) -> dict[str, Any]:
    """The optional extra batched runs of :func:`bench_generation` (the other prefix setting, the
    other decode loop, the other last-chunk scheme, no FINAL-line stop) and how their replies
    compare with ``batched``."""
    n = len(prompts)
    out: dict[str, Any] = {}
    tail = getattr(gen, "prefill_tail", None)
    if compare_tail and decode == "compact" and getattr(gen, "row_prefill", False) and gen.prefill_chunk:
        other = "chunk" if tail == "steps" else "steps"
        alt, t_alt = _timed(gen, prompts, prefill_tail=other)
        out.update({
            "prefill_tail": tail, f"s_per_episode_batched_tail_{other}": t_alt / n,
            f"tail_{other}_over_{tail}": (t_alt / n) / (t_batch / n),
            "replies_differing_between_tails": sum(a.text != b.text for a, b in zip(batched, alt)),
        })
    if compare_share and decode == "compact":
        alt, t_alt = _timed(gen, prompts, share_prefix=not share_prefix)
        tag = "no_share" if share_prefix else "share"
        out.update({
            f"s_per_episode_batched_{tag}": t_alt / n,
            f"bound_ratio_batched_{tag}": (t_alt / n) / bound,
            f"speedup_vs_loop_batched_{tag}": s_loop / (t_alt / n),
            "replies_differing_share_vs_no_share": sum(a.text != b.text for a, b in zip(batched, alt)),
        })
    if compare_decode:
        other = "generate" if decode == "compact" else "compact"
        alt, t_alt = _timed(gen, prompts, decode=other)
        out.update({
            f"s_per_episode_batched_{other}": t_alt / n,
            f"speedup_vs_loop_batched_{other}": s_loop / (t_alt / n),
            "replies_differing_between_decode_loops": sum(
                (a.text, a.finish, a.n_new_tokens) != (b.text, b.finish, b.n_new_tokens) for a, b in zip(batched, alt)),
        })
    if check_stop:
        full, t_full = _timed(gen, prompts, stop_at_final=False)
        out.update({
            "s_per_episode_batched_no_final_stop": t_full / n,
            "new_tokens_per_episode_no_final_stop": sum(r.n_new_tokens for r in full) / n,
            "final_stop_speedup": t_full / t_batch,
            "final_stop_changed_extraction": sum(extract_final(a.text) != extract_final(b.text)
                                                 for a, b in zip(batched, full)),
        })
    return out


def _timed(gen, prompts: list[str], **settings) -> tuple[list, float]:
    """(replies, seconds) of one ``gen.generate(prompts)`` with generator ``settings`` (attributes
    such as ``decode`` or ``share_prefix``) set for that call only."""
    old = {k: getattr(gen, k) for k in settings}
    for k, v in settings.items():
        setattr(gen, k, v)
    _forget(gen)
    try:
        t0 = time.perf_counter()
        replies = gen.generate(prompts)
        return replies, time.perf_counter() - t0
    finally:
        for k, v in old.items():
            setattr(gen, k, v)


def _forget(gen) -> None:
    """A cold start for the next timing: the transformers backend's kept prefill chunks dropped."""
    forget = getattr(gen, "forget_prefixes", None)
    if forget is not None:
        forget()


def _print_generation(r: dict[str, Any]) -> None:
    print(f"generation benchmark: {r['model']}, {r['n_episodes']} with-tool prompts "
          f"(loop over {r['n_episodes_loop']}), {r['dtype']}, max_new_tokens {r['max_new_tokens']}, "
          f"FINAL-line stop {r['stop_at_final']}")
    print(f"  decode loop     : {r.get('decode', 'generate')}")
    print(f"  one-by-one loop : {r['s_per_episode_loop']:.3f} s/episode "
          f"({r['prompt_tokens_per_episode_loop']:.0f} prompt + {r['new_tokens_per_episode_loop']:.1f} new tokens)")
    print(f"  batched         : {r['s_per_episode_batched']:.3f} s/episode "
          f"({r['prompt_tokens_per_episode_batched']:.0f} prompt + {r['new_tokens_per_episode_batched']:.1f} new tokens; "
          f"batches {r['batch_sizes']}; median of "
          f"{', '.join(f'{t:.3f}' for t in r['s_per_episode_batched_repeats'])})")
    print(f"  speedup vs loop : {r['speedup_vs_loop']:.2f}x")
    print(f"  compute bound   : {r['compute_bound_s_per_episode']:.3f} s/episode at {r['matmul_rate_gflops']:.0f} "
          f"GFLOP/s ({r.get('matmul_rate_dtype', r['dtype'])} matmul); batched / bound = {r['bound_ratio']:.2f}")
    print(f"  shared prefixes : {r.get('share_prefix')} ({r.get('prompt_tokens_computed_per_episode_batched', 0):.0f} "
          f"prompt tokens computed per episode)")
    for tag in ("no_share", "share"):
        if f"s_per_episode_batched_{tag}" in r:
            print(f"  batched, {tag.replace('_', ' ')}: {r[f's_per_episode_batched_{tag}']:.3f} s/episode, "
                  f"{r[f'speedup_vs_loop_batched_{tag}']:.2f}x the loop, {r[f'bound_ratio_batched_{tag}']:.2f}x the "
                  f"bound; replies differing: {r['replies_differing_share_vs_no_share']} of {r['n_episodes']}")
    print(f"  replies differing loop vs batched: {r['replies_differing_loop_vs_batched']}; "
          f"load avg {r['load_avg_1m']}")
    for k in ("s_per_episode_batched_generate", "s_per_episode_batched_compact"):
        if k in r:
            print(f"  batched, {k.rsplit('_', 1)[1]} loop: {r[k]:.3f} s/episode; replies differing between the "
                  f"decode loops: {r['replies_differing_between_decode_loops']} of {r['n_episodes']}")
    for other in ("chunk", "steps"):
        if f"s_per_episode_batched_tail_{other}" in r:
            ratio = r[f"tail_{other}_over_{r['prefill_tail']}"]
            print(f"  batched, last chunk '{other}': {r[f's_per_episode_batched_tail_{other}']:.3f} s/episode "
                  f"({ratio:.2f}x the '{r['prefill_tail']}' time); replies "
                  f"differing: {r['replies_differing_between_tails']} of {r['n_episodes']}")
    if "peer" in r:
        print(f"  peer {r['peer']} {r['peer_version']}: {r['s_per_episode_peer']:.3f} s/episode against memtoc's "
              f"{r['s_per_episode_batched_interleaved']:.3f} in the same turns (peer / memtoc = "
              f"{r['peer_over_memtoc']:.2f}); engine start and 2-prompt warm-up {r['peer_engine_start_s']:.1f} s; replies differing from "
              f"memtoc's: {r['replies_differing_memtoc_vs_peer']} of {r['n_episodes']}, between its repeats: "
              f"{r['replies_differing_between_peer_repeats']}; options {r.get('peer_options') or {}}")
    if "final_stop_speedup" in r:
        print(f"  FINAL-line stop : {r['final_stop_speedup']:.2f}x faster than running to EOS/max "
              f"({r['new_tokens_per_episode_no_final_stop']:.1f} new tokens); extracted answer changed in "
              f"{r['final_stop_changed_extraction']} of {r['n_episodes']}")


def _options(items: list[str]) -> dict[str, Any]:
    import yaml
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--peer-option {item!r}: write KEY=VALUE, e.g. enforce_eager=true")
        out[key.strip()] = yaml.safe_load(value)
    return out


def cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="memtoc bench", description="speed benchmarks")
    sub = ap.add_subparsers(dest="what", required=True)
    g = sub.add_parser("generation", help="batched vs one-by-one generation and the compute bound")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--n", type=int, default=64, help="number of with-tool prompts (default 64)")
    g.add_argument("--loop-n", type=int, default=None, help="time the loop on the first N only (default: all)")
    g.add_argument("--batch-size", default="auto", help="int or auto (default auto)")
    g.add_argument("--max-new-tokens", type=int, default=48)
    g.add_argument("--dtype", default="auto")
    g.add_argument("--model", default="smollm2-135m-instruct")
    g.add_argument("--check-stop", action="store_true",
                   help="also run without the FINAL-line stop and count changed extractions")
    g.add_argument("--decode", default="compact", choices=["compact", "generate"],
                   help="transformers decode loop (default compact: finished rows leave the batch)")
    g.add_argument("--compare-decode", action="store_true",
                   help="also time the batched run with the other decode loop and count differing replies")
    g.add_argument("--repeats", type=int, default=3,
                   help="time the batched run this many times and report the median (default 3)")
    g.add_argument("--no-share-prefix", action="store_true",
                   help="compute every prompt token of a batch (no shared-prefix prefill)")
    g.add_argument("--compare-share", action="store_true",
                   help="also time the batched run with the other prefix setting and count differing replies")
    g.add_argument("--compare-tail", action="store_true",
                   help="also time the batched run with the other prefill_tail (row prefill) and count differing replies")
    g.add_argument("--max-batch", type=int, default=None, help="transformers backend option max_batch")
    g.add_argument("--token-budget", type=int, default=None, help="transformers backend option token_budget")
    g.add_argument("--release", default=None)
    g.add_argument("--peer", default=None, choices=PEERS,
                   help="also time this engine on the same prompts, in turn with memtoc's (vllm: in the "
                        "environment of make vllm-env), and count the replies that differ")
    g.add_argument("--peer-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an engine option of the peer (YAML value), e.g. enforce_eager=true; repeatable")
    s = sub.add_parser("stats", help="bootstrap / sign-flip timings (memtoc.run.bench.stats_benchmark)")
    s.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.what == "generation":
        bs: Any = a.batch_size
        if bs != "auto":
            try:
                bs = int(bs)
            except ValueError:
                raise ConfigError(f"--batch-size must be an integer or 'auto', got {bs!r}") from None
        r = bench_generation(a.n, bs, a.max_new_tokens, a.dtype, a.model, a.check_stop, a.loop_n, a.release,
                             decode=a.decode, compare_decode=a.compare_decode,
                             share_prefix=not a.no_share_prefix, compare_share=a.compare_share,
                             repeats=max(1, a.repeats), compare_tail=a.compare_tail,
                             backend_options={k: v for k, v in (("max_batch", a.max_batch),
                                                                ("token_budget", a.token_budget)) if v},
                             peer=a.peer, peer_options=_options(a.peer_option))
        print(json.dumps(r)) if a.json else _print_generation(r)
        return 0
    r = stats_benchmark()
    if a.json:
        print(json.dumps(r))
    else:
        for k, v in r.items():
            print(f"{k:<40} {v:.4f}" if isinstance(v, float) else f"{k:<40} {v}")
    return 0
