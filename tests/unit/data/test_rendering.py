"""Templates, masks, EOS, the length policy and the report, on the real Qwen2.5 tokenizer."""

from __future__ import annotations

import copy

import pytest

from anyfit.config import DataConfig
from anyfit.data.formats import to_examples
from anyfit.data.sources import DataError
from anyfit.data.templates import R1_ZERO_PROMPT, render_prompt
from anyfit.data.showing import GREEN, GREY, show_example
from anyfit.data.tokenization import IGNORE_INDEX, prompt_token_ids, tokenize_dataset, tokenize_example

TWO_TURNS = {"messages": [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Add 2 and 3."},
    {"role": "assistant", "content": "2 + 3 = 5."},
]}


def trained_spans(tok, row) -> list[str]:
    """The decoded runs of consecutive trained tokens."""
    spans, current = [], []
    for token, label in zip(row["input_ids"], row["labels"]):
        if label != IGNORE_INDEX:
            assert label == token
            current.append(token)
        elif current:
            spans.append(tok.decode(current))
            current = []
    if current:
        spans.append(tok.decode(current))
    return spans


def one(tok, record, **cfg):
    rows, report = tokenize_dataset([record], tok, DataConfig(**cfg))
    assert report.kept == 1
    return rows[0]


def test_chat_trains_only_assistant_turns(qwen_tokenizer):
    row = one(qwen_tokenizer, TWO_TURNS)
    assert trained_spans(qwen_tokenizer, row) == ["Hello! How can I help?<|im_end|>", "2 + 3 = 5.<|im_end|>"]
    # the ids are the template's own text, ending at the last <|im_end|> (EOS for Qwen), not after it
    full = qwen_tokenizer.apply_chat_template(TWO_TURNS["messages"], tokenize=False)
    assert qwen_tokenizer.decode(row["input_ids"]) == full.rstrip()
    assert row["input_ids"][-1] == qwen_tokenizer.eos_token_id
    assert row["input_ids"].count(qwen_tokenizer.eos_token_id) == 5  # system, 2 user, 2 assistant turns


def test_chat_system_prompt(qwen_tokenizer):
    row = one(qwen_tokenizer, TWO_TURNS, system_prompt="You are terse.")
    text = qwen_tokenizer.decode(row["input_ids"])
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>")
    assert "Qwen" not in text
    assert len(trained_spans(qwen_tokenizer, row)) == 2


def test_prompt_completion_masks_the_prompt(qwen_tokenizer):
    record = {"prompt": "What is 2+2?", "completion": "4"}
    for template in ("chat", "plain", "Q: {prompt}\nA: "):
        cfg = DataConfig(template=template)
        row = one(qwen_tokenizer, record, template=template)
        (ex,) = to_examples([record], cfg)
        prompt_ids = prompt_token_ids(ex, qwen_tokenizer, cfg)
        # the prompt is tokenized on its own: its ids are a prefix of the example, all masked
        assert row["input_ids"][: len(prompt_ids)] == prompt_ids
        assert set(row["labels"][: len(prompt_ids)]) == {IGNORE_INDEX}
        assert qwen_tokenizer.decode(prompt_ids) == render_prompt(ex, qwen_tokenizer, cfg)
        assert trained_spans(qwen_tokenizer, row) == ["4<|im_end|>"]
    plain = one(qwen_tokenizer, record, template="plain")
    assert qwen_tokenizer.decode(plain["input_ids"]) == "What is 2+2?4<|im_end|>"  # nothing added between


def test_r1_zero_shape_and_boxed_answer(qwen_tokenizer):
    record = {"problem": "What is 1 divided by 2?", "solution": "Half of one is $\\boxed{\\frac{1}{2}}$."}
    cfg = dict(template="r1_zero", fields={"prompt": "problem", "completion": "solution"})
    row = one(qwen_tokenizer, record, **cfg)
    text = qwen_tokenizer.decode(row["input_ids"])
    prompt = R1_ZERO_PROMPT.replace("{prompt}", record["problem"])
    assert prompt.endswith("User: What is 1 divided by 2?\nAssistant: <think>")
    completion = "Half of one is $\\boxed{\\frac{1}{2}}$. </think> <answer> \\frac{1}{2} </answer>"
    assert text == prompt + completion + "<|im_end|>"
    assert trained_spans(qwen_tokenizer, row) == [completion + "<|im_end|>"]


def test_r1_zero_answer_field_and_missing_answer(qwen_tokenizer):
    cfg = DataConfig(template="r1_zero", fields={"prompt": "q", "completion": "s", "answer": "a"})
    rows, _ = tokenize_dataset([{"q": "x?", "s": "because", "a": "7"}], qwen_tokenizer, cfg)
    assert qwen_tokenizer.decode(rows[0]["input_ids"]).endswith("because </think> <answer> 7 </answer><|im_end|>")

    cfg = DataConfig(template="r1_zero")
    records = [{"prompt": "x?", "completion": "\\boxed{1}"}, {"prompt": "y?", "completion": "no box"}]
    rows, report = tokenize_dataset(records, qwen_tokenizer, cfg)
    assert (report.kept, report.dropped_no_answer) == (1, 1)
    with pytest.raises(DataError, match="1 without an answer for r1_zero"):
        tokenize_dataset(records[1:], qwen_tokenizer, cfg)


def test_train_on_all(qwen_tokenizer):
    row = one(qwen_tokenizer, TWO_TURNS, train_on="all")
    assert row["labels"][0] == IGNORE_INDEX  # no token predicts the first one
    assert row["labels"][1:] == row["input_ids"][1:]


def test_text_format_is_trained_whole_with_eos(qwen_tokenizer):
    row = one(qwen_tokenizer, {"text": "Once upon a time"})
    assert qwen_tokenizer.decode(row["input_ids"]) == "Once upon a time<|im_end|>"
    assert row["labels"][0] == IGNORE_INDEX and row["labels"][1:] == row["input_ids"][1:]
    no_eos = one(qwen_tokenizer, {"text": "Once upon a time"}, add_eos=False)
    assert no_eos["input_ids"] == row["input_ids"][:-1]


def test_truncate_versus_drop(qwen_tokenizer):
    records = [{"prompt": "Q", "completion": "word " * 50}, {"prompt": "Q", "completion": "short"}]
    rows, report = tokenize_dataset(records, qwen_tokenizer, DataConfig(template="plain", max_length=20))
    assert (report.loaded, report.kept, report.truncated, report.dropped_overlong) == (2, 2, 1, 0)
    assert len(rows[0]["input_ids"]) == 20 and report.max_length == 20
    assert rows[0]["input_ids"][-1] != qwen_tokenizer.eos_token_id  # cut text does not end
    whole, _ = tokenize_dataset(records[:1], qwen_tokenizer, DataConfig(template="plain", max_length=4096))
    assert report.truncated_tokens == len(whole[0]["input_ids"]) - 20 > 0  # the tokens the cut removed
    assert f"({report.truncated_tokens:,} tokens cut away)" in report.summary()

    rows, report = tokenize_dataset(records, qwen_tokenizer, DataConfig(template="plain", max_length=20, overlong="drop"))
    assert (report.kept, report.truncated, report.dropped_overlong) == (1, 0, 1)
    assert report.total_tokens == len(rows[0]["input_ids"])
    assert report.trainable_tokens == sum(x != IGNORE_INDEX for x in rows[0]["labels"])
    assert "1 were dropped as longer than data.max_length=20" in report.summary()


def test_prompt_filling_max_length_has_no_target(qwen_tokenizer):
    records = [{"prompt": "long " * 40, "completion": "a"}, {"prompt": "Q", "completion": "a"}]
    _, report = tokenize_dataset(records, qwen_tokenizer, DataConfig(template="plain", max_length=10))
    assert (report.kept, report.dropped_no_target, report.truncated) == (1, 1, 0)


def test_everything_dropped_raises_with_reasons(qwen_tokenizer):
    records = [{"prompt": "long " * 40, "completion": "a"}]
    with pytest.raises(DataError) as e:
        tokenize_dataset(records, qwen_tokenizer, DataConfig(template="plain", max_length=10))
    assert "No training examples left out of 1: 1 with no trainable tokens" in str(e.value)
    with pytest.raises(DataError, match="1 longer than data.max_length=10 .set data.overlong=truncate"):
        tokenize_dataset(records, qwen_tokenizer, DataConfig(template="plain", max_length=10, overlong="drop"))


def test_text_templates_refuse_what_they_cannot_show(qwen_tokenizer):
    with pytest.raises(DataError, match="only data.template=chat renders"):
        tokenize_dataset([{"prompt": "q", "completion": "a"}], qwen_tokenizer,
                         DataConfig(template="plain", system_prompt="sys"))
    with pytest.raises(DataError, match="Use data.template=chat for multi-turn"):
        tokenize_dataset([TWO_TURNS], qwen_tokenizer, DataConfig(template="plain"))
    no_template = copy.copy(qwen_tokenizer)
    no_template.chat_template = None
    with pytest.raises(DataError, match="tokenizer has no chat template"):
        tokenize_dataset([TWO_TURNS], no_template, DataConfig())


def test_single_turn_messages_work_with_text_templates(qwen_tokenizer):
    record = {"messages": TWO_TURNS["messages"][:2]}
    row = one(qwen_tokenizer, record, template="Q: {prompt}\nA: ")
    assert qwen_tokenizer.decode(row["input_ids"]) == "Q: Hi there\nA: Hello! How can I help?<|im_end|>"


def test_show_example(qwen_tokenizer):
    record = {"prompt": "What is 2+2?", "completion": "4"}
    (ex,) = to_examples([record], DataConfig(template="plain"))
    ((ids, labels),) = tokenize_example(ex, qwen_tokenizer, DataConfig(template="plain"))
    plain = show_example(ids, labels, qwen_tokenizer, color=False)
    assert plain == f"What is 2+2?⟦4<|im_end|>⟧\n{len(ids)} tokens, 2 trained ({200 / len(ids):.0f}%)"
    colored = show_example(ids, labels, qwen_tokenizer, color=True)
    assert colored.startswith(f"{GREY}What is 2+2?") and f"{GREEN}4<|im_end|>" in colored


def test_report_summary(qwen_tokenizer):
    _, report = tokenize_dataset([TWO_TURNS, {"messages": TWO_TURNS["messages"][:2]}], qwen_tokenizer, DataConfig())
    assert report.kept == 2 and report.mean_length == report.total_tokens / 2
    assert report.summary().startswith("Loaded 2 records, kept 2 examples.")


class _BosTokenizer:
    """The Qwen tokenizer made to add a BOS (id 151643) like Llama's: text templates must get exactly one."""

    bos = 151643

    def __init__(self, tok):
        self.tok, self.eos_token_id = tok, tok.eos_token_id

    def __getattr__(self, name):  # the rest (chat template, special tokens) is the Qwen tokenizer's
        return getattr(self.tok, name)

    def __call__(self, text, add_special_tokens=True):
        enc = self.tok(text, add_special_tokens=False)
        if add_special_tokens:
            return {"input_ids": [self.bos] + enc["input_ids"]}
        return enc


def test_text_templates_start_with_the_tokenizers_bos(qwen_tokenizer):
    tok = _BosTokenizer(qwen_tokenizer)
    cfg = DataConfig(template="plain")
    rows, _ = tokenize_dataset([{"prompt": "hi", "completion": "yo"}], tok, cfg)
    ids = rows[0]["input_ids"]
    assert ids[0] == tok.bos and ids.count(tok.bos) == 1 and rows[0]["labels"][0] == IGNORE_INDEX
    (ex,) = to_examples([{"prompt": "hi", "completion": "yo"}], cfg)
    prompt_ids = prompt_token_ids(ex, tok, cfg)
    assert prompt_ids[0] == tok.bos and ids[: len(prompt_ids)] == prompt_ids


def test_plain_is_prompt_then_completion_tokenized_each_on_its_own(qwen_tokenizer):
    tok = qwen_tokenizer
    for prompt, completion in [("6 times 7? Answer:", " 42"), ("The capital of France is ", "Paris."),
                               ("Line\n", "next")]:
        row = one(tok, {"prompt": prompt, "completion": completion}, template="plain")
        prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        completion_ids = tok(completion, add_special_tokens=False)["input_ids"]
        assert row["input_ids"] == prompt_ids + completion_ids + [tok.eos_token_id]
        assert tok.decode(row["input_ids"]) == prompt + completion + "<|im_end|>"
        assert trained_spans(tok, row) == [completion + "<|im_end|>"]


def test_trl_tokenizes_the_joined_text_and_trains_from_the_first_difference(qwen_tokenizer):
    tok = qwen_tokenizer
    record = {"prompt": "The capital of France is ", "completion": "Paris."}
    row = one(tok, record, template="trl")
    assert row["input_ids"] == tok("The capital of France is Paris.<|im_end|>")["input_ids"]
    # " Paris" is one token across the boundary: it is trained, the prompt's lone " " is not in the sequence
    assert trained_spans(tok, row) == [" Paris.<|im_end|>"]
    cfg = DataConfig(template="trl")
    (ex,) = to_examples([record], cfg)
    assert prompt_token_ids(ex, tok, cfg) == tok("The capital of France is ")["input_ids"]
    everything = one(tok, record, template="trl", train_on="all")
    assert everything["labels"][1:] == everything["input_ids"][1:]
    no_eos = one(tok, record, template="trl", add_eos=False)
    assert no_eos["input_ids"] == row["input_ids"][:-1]


def test_trl_conversations_use_the_chat_template(qwen_tokenizer):
    tok = qwen_tokenizer
    row = one(tok, TWO_TURNS, template="trl", train_on="all")  # TRL's default for conversations: every token
    full = tok.apply_chat_template(TWO_TURNS["messages"], tokenize=True, return_dict=True)["input_ids"]
    assert row["input_ids"] == full
    assert row["labels"][1:] == row["input_ids"][1:]
    record = {"prompt": TWO_TURNS["messages"][:3], "completion": [TWO_TURNS["messages"][3]]}
    row = one(tok, record, template="trl")
    assert trained_spans(tok, row) == ["2 + 3 = 5.<|im_end|>\n"]  # the template's newline after the turn, as in TRL
    cfg = DataConfig(template="trl")
    (ex,) = to_examples([record], cfg)
    prompt_ids = prompt_token_ids(ex, tok, cfg)
    assert row["input_ids"][: len(prompt_ids)] == prompt_ids
    with pytest.raises(DataError, match="only data.template=chat renders .and trl, for conversations."):
        tokenize_dataset([{"prompt": "q", "completion": "a"}], tok, DataConfig(template="trl", system_prompt="sys"))


def test_trl_assistant_only_needs_generation_markers(qwen_tokenizer, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "trl.chat_template_utils", None)  # as if TRL were not installed
    with pytest.raises(DataError, match="assistant_only_loss.*not installed. Set data.train_on=all"):
        tokenize_dataset([TWO_TURNS], qwen_tokenizer, DataConfig(template="trl"))


def test_unknown_template_is_a_config_error_before_any_data():
    from anyfit.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="data.template='chatml' is not one of chat, plain, trl, r1_zero"):
        load_config(None, ["data.template=chatml"])
    assert load_config(None, ['data.template="Q: {prompt}\\nA:"']).data.template == "Q: {prompt}\nA:"


def test_tool_turns_need_a_template_that_renders_them(qwen_tokenizer):
    record = {"messages": [{"role": "user", "content": "Weather?"}, {"role": "tool", "content": "SUNNY-42"},
                           {"role": "assistant", "content": "Sunny."}]}
    row = one(qwen_tokenizer, record)
    assert "SUNNY-42" in qwen_tokenizer.decode(row["input_ids"])  # Qwen's template has a tool role
    no_tools = copy.copy(qwen_tokenizer)
    no_tools.chat_template = ("{% for m in messages %}{% if m.role != 'tool' %}<|im_start|>{{ m.role }}\n"
                              "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
                              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(DataError, match="Record 0: message 1 has role 'tool', but the chat template of .* does not render tool messages"):
        tokenize_dataset([record], no_tools, DataConfig())


def test_conversations_without_an_assistant_turn_are_counted_apart(qwen_tokenizer):
    no_answer = {"messages": TWO_TURNS["messages"][:1]}
    _, report = tokenize_dataset([TWO_TURNS, no_answer], qwen_tokenizer, DataConfig())
    assert (report.kept, report.dropped_nothing_to_train, report.dropped_no_target) == (1, 1, 0)
    assert "1 were dropped with nothing to train on" in report.summary()
    with pytest.raises(DataError, match="1 with nothing to train on .conversations without an assistant turn"):
        tokenize_dataset([no_answer], qwen_tokenizer, DataConfig())


def test_encode_matches_the_transformers_call(qwen_tokenizer):
    """The backend fast path gives exactly tokenizer(texts)'s ids, and a tokenizer whose backend has truncation
    set (the transformers call would clear it) takes the transformers call, not a silently cut encoding."""
    from anyfit.data.tokenization import _encode, _plain_backend

    texts = ["<|im_start|>user\nÜnïcödé ✓ $\\sqrt{2}$<|im_end|>\n", " leading and trailing ", "a " * 300, "日本語"]
    for special in (False, True):
        assert _encode(texts, qwen_tokenizer, special) == qwen_tokenizer(texts, add_special_tokens=special)["input_ids"]
    backend = qwen_tokenizer.backend_tokenizer
    assert _plain_backend(qwen_tokenizer, backend)
    whole = _encode(texts, qwen_tokenizer)
    backend.enable_truncation(max_length=8)
    try:
        assert not _plain_backend(qwen_tokenizer, backend)
        assert _encode(texts, qwen_tokenizer) == whole  # the transformers call clears the truncation
    finally:
        backend.no_truncation()


def test_the_default_system_turn_of_a_chat_template_is_found(qwen_tokenizer):
    from anyfit.data.templates import default_system_prompt

    assert default_system_prompt(qwen_tokenizer) == "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    plain = copy.deepcopy(qwen_tokenizer)
    plain.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}")
    assert default_system_prompt(plain) is None  # a template that adds no system turn of its own
    plain.chat_template = None
    assert default_system_prompt(plain) is None
