"""trl's preprocessing of memtoc's training rows equals the paper's fine-tuning recipe, token for token.

The paper trains with the bare transformers Trainer and peft: one sequence per SFT example, the
deployment chat template with the generation prompt, then the completion and the end-of-turn token
as the template writes it, with the prompt tokens labelled -100. memtoc trains with trl
(``finetune.make_trainer``); the reference below is built from that description, independently of
trl, and compared with what SFTTrainer / DPOTrainer actually hold after their own preprocessing.
The chat model is the embedded SmolLM2-135M-Instruct, the base model gemma-3-270m (fine-tuned only
when ``finetune.models`` names it), and gemma-3-270m's tokenizer with the gemma chat template (whose
turns end with ``<end_of_turn>`` while ``eos_token`` is ``<eos>``, as for gemma-2-9b-it); all with
tiny random weights and real tokenizers.
"""
from __future__ import annotations

import dataclasses
import functools

import pytest

from memtoc.config.params import load_params
from memtoc.config.runconfig import RunConfig
from memtoc.generation import models
from memtoc.stages import finetune as F

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

IGNORE = -100


def _end_of_turn_id(tok, spec, prompt: str, completion: str) -> int:
    """The token the deployment template puts right after an assistant message (the EOS a chat
    model's turn ends with); ``eos_token`` for a base model (no template)."""
    text, special = models.render_prompt(tok, spec, prompt)
    if special:
        return tok.eos_token_id
    full = tok.apply_chat_template([{"role": "user", "content": prompt},
                                    {"role": "assistant", "content": completion}], tokenize=False)
    after = full[full.rindex(completion) + len(completion):]
    first = tok(after, add_special_tokens=False)["input_ids"][0]
    assert tok.added_tokens_decoder[first].special, f"the template ends the assistant turn with {after!r}"
    return first


def _reference(tok, spec, prompt: str, completion: str) -> tuple[list[int], list[int], int]:
    """The paper's recipe for one (prompt, completion): (input_ids, labels, n_prompt) where
    input_ids = tokenizer(templated prompt + completion + end-of-turn text), the prompt part exactly
    the ids the generator feeds at inference, and labels -100 on the prompt."""
    text, special = models.render_prompt(tok, spec, prompt)
    eot = _end_of_turn_id(tok, spec, prompt, completion)
    prompt_ids = tok(text, add_special_tokens=special)["input_ids"]
    ids = tok(text + completion + tok.convert_ids_to_tokens(eot), add_special_tokens=special)["input_ids"]
    assert ids[:len(prompt_ids)] == prompt_ids, "the templated prompt is not a token prefix of prompt + completion"
    assert ids[-1] == eot and ids.count(eot) == prompt_ids.count(eot) + 1
    return ids, [IGNORE] * len(prompt_ids) + ids[len(prompt_ids):], len(prompt_ids)


@pytest.fixture(scope="module")
def fast_fingerprints():
    """datasets fingerprints every map by hashing its arguments (the tokenizer: seconds for a 262k
    vocabulary); the in-memory datasets here are never cached, so a random fingerprint is the same."""
    from datasets import arrow_dataset, fingerprint
    mp = pytest.MonkeyPatch()
    for module in (fingerprint, arrow_dataset):
        mp.setattr(module, "update_fingerprint", lambda *a, **k: fingerprint.generate_random_fingerprint())
    yield
    mp.undo()


@pytest.fixture(scope="module")
def examples(bench):
    """Reference-formulation pairs of two repaired and two unrepaired questions of the release."""
    rep = [q for q in bench.questions if q.repaired][:1]
    plain = [q for q in bench.questions if not q.repaired][:1]
    return F.training_examples(rep + plain, ["reference"])


def _tiny(tok):
    """A tiny random Llama with ``tok``'s vocabulary (tied embeddings)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))


GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
                  "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
                  "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


@functools.lru_cache(maxsize=None)
def _tokenizer_and_spec(name: str):
    """The real tokenizer (loaded once per name) and the model's spec."""
    from transformers import AutoTokenizer
    if name != "gemma-chat":
        return AutoTokenizer.from_pretrained(models.prepare_model(name)), models.get_model(name)
    tok = AutoTokenizer.from_pretrained(models.prepare_model("gemma-3-270m"))
    tok.chat_template = GEMMA_TEMPLATE
    return tok, models.ModelSpec("gemma-chat", "gemma-chat", "local", chat=True, system_turn="template")


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "gemma-3-270m", "gemma-chat"])
def trainers(request, tmp_path_factory, examples, fast_fingerprints):
    """(tokenizer, spec, SFTTrainer, DPOTrainer) built by memtoc on the rows it trains on, as
    ``train_adapter`` builds them."""
    name = request.param
    tok, spec = _tokenizer_and_spec(name)
    out = tmp_path_factory.mktemp(name)
    ft = RunConfig.of(load_params(None, overrides={"finetune": {"max_steps": 1, "batch_size": 2}})).finetune
    render = lambda p: F.training_prompt(tok, spec, p)
    F.check_training_tokens(tok, spec, [e.prompt for e in examples])
    eos = F.training_eos(tok, spec)
    sft = F.make_trainer(_tiny(tok), tok, F.sft_rows(examples, render), "sft", ft, out / "sft", progress=False,
                         eos_token=eos)
    dpo = F.make_trainer(_tiny(tok), tok, F.dpo_rows(examples, render), "dpo", ft, out / "dpo", progress=False,
                         eos_token=eos)
    assert tok.eos_token == _tokenizer_and_spec(name)[0].eos_token     # make_trainer restores the tokenizer
    return tok, spec, sft, dpo


def test_completions_end_with_the_templates_end_of_turn(bench):
    """trl appends ``eos_token``; for a gemma-style template that is one wrong token per completion
    (``<eos>`` where the template ends the turn with ``<end_of_turn>``) unless memtoc passes
    :func:`training_eos`."""
    ex = F.training_examples(bench.questions[:1], ["reference"])[0]
    tok, spec = _tokenizer_and_spec("gemma-chat")
    assert (tok.eos_token, F.training_eos(tok, spec)) == ("<eos>", "<end_of_turn>")
    ids = _reference(tok, spec, ex.prompt, ex.chosen)[0]
    assert tok.convert_ids_to_tokens(ids[-1]) == "<end_of_turn>" and tok.eos_token_id not in ids
    smol, smol_spec = _tokenizer_and_spec("smollm2-135m-instruct")
    assert F.training_eos(smol, smol_spec) == smol.eos_token == "<|im_end|>"


def test_sft_rows_are_the_papers_sequence_and_labels(trainers, examples):
    tok, spec, sft, _ = trainers
    rows = list(sft.train_dataset)
    assert len(rows) == len(examples)
    for e, row in zip(examples, rows):
        ids, labels, n_prompt = _reference(tok, spec, e.prompt, e.chosen)
        assert row["input_ids"] == ids
        trl_labels = row.get("labels")
        if trl_labels is None:   # older trl: the completion mask, applied by the collator
            trl_labels = [t if m else IGNORE for t, m in zip(row["input_ids"], row["completion_mask"])]
        assert trl_labels == labels
        assert labels[n_prompt:] == ids[n_prompt:] and labels[-1] == row["input_ids"][-1]   # the EOS is learnt
    batch = sft.data_collator(rows[:2])                  # the loss sees the same labels after padding
    for j, row in enumerate(rows[:2]):
        n = len(row["input_ids"])
        assert batch["labels"][j][:n].tolist() == _reference(tok, spec, examples[j].prompt, examples[j].chosen)[1]
        assert set(batch["labels"][j][n:].tolist()) <= {IGNORE}


def test_dpo_rows_are_the_papers_prompt_and_completions(trainers, examples):
    tok, spec, _, dpo = trainers
    rows = list(dpo.train_dataset)
    assert len(rows) == len(examples)
    for e, row in zip(examples, rows):
        for side, text in (("chosen", e.chosen), ("rejected", e.rejected)):
            ids, labels, n_prompt = _reference(tok, spec, e.prompt, text)
            assert row["prompt_ids"] == ids[:n_prompt]
            assert row[f"{side}_ids"] == ids[n_prompt:] == labels[n_prompt:]


def test_pairs_train_on_the_near_values_the_release_trained_on(bench):
    """The release's cross-fitting pairs (code/scripts/build_crossfit_inputs.py, verified by
    crossfit_verification.json against the v2 mapping) were built before the repair overlay: for the
    39 repaired questions the tool_wrong prompt shows and the rejected line says the pre-repair near
    value; evaluation uses the repaired one."""
    rep = [q for q in bench.questions if q.repaired]
    assert len(rep) == 39 and all(q.near != q.near_original for q in rep)
    ex = F.training_examples(rep, ["reference"])
    assert len(ex) == 2 * len(rep)
    evaluated = {(e.question_id, e.condition): e for e in F.eval_episodes(rep, ["reference"], ("tool_wrong",))}
    for e in ex:
        q = next(q for q in rep if q.id == e.question_id)
        assert e.rejected == f"FINAL: {q.near_original}" and e.chosen == f"FINAL: {q.gold}"
        if e.condition == "tool_wrong":
            assert e.tool_value == q.near_original and f'"result": "{q.near_original}"' in e.prompt
            assert f'"result": "{q.near}"' not in e.prompt
            assert evaluated[(q.id, "tool_wrong")].tool_value == q.near      # scored on the repaired value
    same = [dataclasses.replace(q, near=q.near_original, repaired=False) for q in rep]
    assert [e.to_dict() for e in F.training_examples(same, ["reference"])] == [e.to_dict() for e in ex]
