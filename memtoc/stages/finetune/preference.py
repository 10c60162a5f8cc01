"""A held-out diagnostic without generation: log-probability preference of chosen over rejected."""
from __future__ import annotations

from typing import Any, Sequence

from memtoc.generation import models
from memtoc.stages.finetune.data import TrainExample


def pair_preference(base_path, spec, examples: Sequence[TrainExample], adapter=None, dtype: str = "float32",
                    batch_size: int = 8) -> dict[str, Any]:
    """Held-out diagnostic without generation: for each pair, the summed log-probability of the
    chosen and of the rejected completion (+ EOS) after the rendered prompt, with the base model or
    base + ``adapter`` (unmerged). Returns ``{"n", "accuracy" (share chosen > rejected),
    "margin" (mean logp chosen − rejected), "chosen_nll" (mean per-token NLL of the chosen line)}``.
    Used to compare learning rates on a slice (see params/finetune.yaml)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_path)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=getattr(torch, dtype))
    if adapter is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    eos = tok.eos_token or ""

    def logps(pairs: list[tuple[str, str]]) -> list[tuple[float, int]]:
        out = []
        for i in range(0, len(pairs), batch_size):
            chunk = pairs[i:i + batch_size]
            ids, lens = [], []
            for prompt, comp in chunk:
                p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
                c_ids = tok(prompt + comp + eos, add_special_tokens=False)["input_ids"][len(p_ids):]
                ids.append(p_ids + c_ids)
                lens.append((len(p_ids), len(c_ids)))
            width = max(map(len, ids))
            pad = tok.pad_token_id if tok.pad_token_id is not None else 0
            x = torch.tensor([r + [pad] * (width - len(r)) for r in ids])
            att = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids])
            with torch.no_grad():
                lp = torch.log_softmax(model(input_ids=x, attention_mask=att).logits.float(), -1)
            for j, (pl, cl) in enumerate(lens):
                tgt = x[j, pl:pl + cl]
                out.append((float(lp[j, pl - 1:pl + cl - 1].gather(-1, tgt[:, None]).sum()), cl))
        return out

    rendered = [models.render_prompt(tok, spec, e.prompt)[0] for e in examples]
    ch = logps([(r, e.chosen) for r, e in zip(rendered, examples)])
    rj = logps([(r, e.rejected) for r, e in zip(rendered, examples)])
    margins = [c[0] - r[0] for c, r in zip(ch, rj)]
    return {"n": len(examples), "accuracy": sum(m > 0 for m in margins) / max(1, len(margins)),
            "margin": sum(margins) / max(1, len(margins)),
            "chosen_nll": sum(-c[0] / c[1] for c in ch) / max(1, len(ch))}
