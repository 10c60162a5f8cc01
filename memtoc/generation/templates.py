"""One user-turn prompt as the model sees it: the chat template for chat models (no system turn for
the embedded model and local directories, the template as is for the paper's five), the raw text for
base models. Shared by every backend, fine-tuning (training rows tokenize like inference) and the probes."""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memtoc.generation.models import ModelSpec


def render_prompt(tokenizer, spec: ModelSpec, prompt: str) -> tuple[str, bool]:
    """(text to tokenize, add_special_tokens) for one user-turn prompt."""
    if not spec.chat or not getattr(tokenizer, "chat_template", None):
        return prompt, True
    msgs = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    if spec.system_turn == "none":
        if "<|im_start|>system" in text and "<|im_start|>user" in text:  # ChatML default system
            text = text[text.index("<|im_start|>user"):]
        elif detect_default_system(tokenizer):
            warnings.warn(f"{spec.name}: the chat template injects a system turn that memtoc cannot "
                          "strip (not ChatML); using the template as is", stacklevel=2)
    return text, False


def detect_default_system(tokenizer) -> bool:
    """True when the chat template injects a system turn for a single user message."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    t = tokenizer.apply_chat_template([{"role": "user", "content": "\u2063x"}], tokenize=False,
                                      add_generation_prompt=True)
    return "system" in t[: t.index("\u2063x")].lower()
