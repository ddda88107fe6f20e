"""Normalising records to Examples: format detection, field mapping, and errors that say what to change."""

from __future__ import annotations

import pytest

from anyfit.config import DataConfig
from anyfit.data.formats import Example, detect_format, to_examples
from anyfit.data.sources import DataError

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.mark.parametrize("record, fmt", [
    ({"messages": CHAT, "id": 1}, "messages"),
    ({"prompt": "q", "completion": "a"}, "prompt_completion"),
    ({"text": "some text"}, "text"),
    ({"input_ids": [5, 6, 7], "completion_mask": [0, 1, 1]}, "tokens"),
])
def test_autodetect(record, fmt):
    assert detect_format(record, DataConfig()) == fmt
    assert to_examples([record], DataConfig())[0].kind == fmt


def test_math_field_mapping():
    cfg = DataConfig(fields={"prompt": "problem", "completion": "solution"})
    records = [{"problem": "1+1?", "solution": "$\\boxed{2}$", "level": "Level 1", "type": "Algebra"}]
    (ex,) = to_examples(records, cfg)
    assert ex == Example("prompt_completion", 0, prompt="1+1?", completion="$\\boxed{2}$")


def test_gsm8k_mapping_does_not_take_the_completion_column_as_answer():
    cfg = DataConfig(fields={"prompt": "question", "completion": "answer"})
    (ex,) = to_examples([{"question": "q", "answer": "work\n#### 72"}], cfg)
    assert ex.completion == "work\n#### 72" and ex.answer is None


def test_answer_and_system_fields():
    records = [{"prompt": "q", "completion": "a", "answer": "42", "system": "be brief"}]
    (ex,) = to_examples(records, DataConfig())
    assert (ex.answer, ex.system) == ("42", "be brief")
    cfg = DataConfig(fields={"answer": "final"})
    with pytest.raises(DataError, match="maps answer: final, but record 0 has no such field"):
        to_examples(records, cfg)


def test_missing_fields_list_present_fields_and_suggest_mapping():
    with pytest.raises(DataError) as e:
        to_examples([{"problem": "1+1?", "solution": "2", "level": 3}], DataConfig())
    msg = str(e.value)
    assert "'problem', 'solution', 'level'" in msg
    assert "data.fields: {prompt: problem, completion: solution}" in msg


def test_explicit_format_with_missing_field():
    with pytest.raises(DataError) as e:
        to_examples([{"question": "q", "completion": "a"}], DataConfig(format="prompt_completion"))
    assert "no field 'prompt'" in str(e.value)
    assert "'question', 'completion'" in str(e.value)
    with pytest.raises(DataError, match=r"no field 'query' \(for prompt\)"):
        to_examples([{"question": "q", "completion": "a"}], DataConfig(fields={"prompt": "query"}, format="prompt_completion"))
    with pytest.raises(DataError, match=r"data.fields maps prompt: query, but there is no such field"):
        to_examples([{"question": "q", "completion": "a"}], DataConfig(fields={"prompt": "query"}))


def test_wrong_shape_names_the_record():
    records = [{"messages": CHAT}, {"messages": CHAT}, {"messages": "not a list"}]
    with pytest.raises(DataError, match="Record 2: 'messages' must be a non-empty list"):
        to_examples(records, DataConfig())
    records = [{"messages": CHAT}, {"messages": [{"role": "user"}]}]
    with pytest.raises(DataError, match="Record 1: message 0 of 'messages'"):
        to_examples(records, DataConfig())
    with pytest.raises(DataError, match="Record 1 has no field 'completion'"):
        to_examples([{"prompt": "q", "completion": "a"}, {"prompt": "q"}], DataConfig())
    with pytest.raises(DataError, match="Record 0: 'completion' must be a string"):
        to_examples([{"prompt": "q", "completion": {"x": 1}}], DataConfig())


def test_prompt_as_messages_and_conversational_completion():
    record = {"prompt": CHAT[:1], "completion": [{"role": "assistant", "content": "hello"}]}
    (ex,) = to_examples([record], DataConfig())
    assert ex.prompt == CHAT[:1] and ex.completion == "hello"


def test_sharegpt_conversations_need_no_mapping():
    record = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    (ex,) = to_examples([record], DataConfig())
    assert ex.messages == CHAT
    (ex,) = to_examples([record], DataConfig(fields={"messages": "conversations"}))
    assert ex.messages == CHAT


def test_numbers_become_text():
    (ex,) = to_examples([{"prompt": "2+2", "completion": 4}], DataConfig())
    assert ex.completion == "4"


def test_pretokenized_records_keep_their_ids_and_mask(qwen_tokenizer):
    from anyfit.data.tokenization import IGNORE_INDEX, tokenize_dataset

    records = [{"input_ids": [5, 6, 7, 8], "completion_mask": [0, 0, 1, 1]}, {"input_ids": [9, 10]}]
    examples, report = tokenize_dataset(records, qwen_tokenizer, DataConfig(max_length=16))
    assert examples[0] == {"input_ids": [5, 6, 7, 8], "labels": [IGNORE_INDEX, IGNORE_INDEX, 7, 8]}
    assert examples[1] == {"input_ids": [9, 10], "labels": [IGNORE_INDEX, 10]}  # no mask: every token trained
    assert report.trainable_tokens == 3
    from anyfit.data.tokenization import tokenize_example

    example = to_examples(records[:1], DataConfig())[0]  # what `anyfit render` shows
    assert tokenize_example(example, qwen_tokenizer, DataConfig()) == [([5, 6, 7, 8], [IGNORE_INDEX, IGNORE_INDEX, 7, 8])]


@pytest.mark.parametrize("record, message", [
    ({"input_ids": [5, 6], "completion_mask": [1]}, "Record 0: 'completion_mask' must be a list of 0/1, one per token"),
    ({"input_ids": ["a", "b"]}, "Record 0: 'input_ids' must be a non-empty list of integer token ids"),
    ({"input_ids": [5, 10**9]}, "Record 0: token id 1000000000 is outside the tokenizer's vocabulary"),
])
def test_bad_pretokenized_records_name_the_record(qwen_tokenizer, record, message):
    from anyfit.data.tokenization import tokenize_dataset

    with pytest.raises(DataError, match=message.replace("(", r"\(")):
        tokenize_dataset([record], qwen_tokenizer, DataConfig())


def test_unknown_role_names_record_role_and_the_accepted_roles():
    records = [{"messages": CHAT}, {"messages": [CHAT[0], {"role": "robot", "content": "beep"}]}]
    with pytest.raises(DataError) as e:
        to_examples(records, DataConfig())
    msg = str(e.value)
    assert msg.startswith("Record 1: message 1 of 'messages' has role 'robot'")
    assert "system, user, assistant, tool" in msg and "\n" not in msg
    sharegpt = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "narrator", "value": "x"}]}]
    with pytest.raises(DataError, match="role 'narrator'.*ShareGPT's human/gpt/observation/function_call are mapped"):
        to_examples(sharegpt, DataConfig())


@pytest.mark.parametrize("messages, message", [
    ([], "'messages' must be a non-empty list"),
    ("hello", "'messages' must be a non-empty list"),
    (["hi"], "message 0 of 'messages' must be an object"),
    ([{"content": "hi"}], "message 0 of 'messages' has no 'role'"),
    ([{"role": "user"}], "message 0 of 'messages' has no 'content'"),
    ([{"role": "user", "content": 5}], "message 0 of 'messages': 'content' must be a string, got 5"),
    ([{"role": "user", "content": None}], "message 0 of 'messages': 'content' is null"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}],
     "message 0 of 'messages': 'content' holds non-text parts"),
    ([{"role": 1, "content": "hi"}], "message 0 of 'messages' has role 1"),
])
def test_message_shape_errors_are_one_line_and_name_the_record(messages, message):
    with pytest.raises(DataError) as e:
        to_examples([{"messages": CHAT}, {"messages": messages}], DataConfig())
    assert str(e.value).startswith(f"Record 1: {message}") and "\n" not in str(e.value)


@pytest.mark.parametrize("value, message", [
    (None, "'completion' is null"),
    (float("nan"), "'completion' is nan, not text: a missing value?"),
    (float("inf"), "'completion' is inf"),
    (True, "'completion' must be a string, got True"),
    ("a\ud800b", "'completion' holds an unpaired surrogate"),
])
def test_field_values_that_are_not_text(value, message):
    with pytest.raises(DataError) as e:
        to_examples([{"prompt": "q", "completion": value}], DataConfig())
    assert str(e.value).startswith(f"Record 0: {message}")


def test_solution_is_the_completion_or_the_last_assistant_turn():
    (pc, chat, open_chat) = to_examples([{"prompt": "q", "completion": "s"}], DataConfig()) + to_examples(
        [{"messages": CHAT}, {"messages": CHAT[:1]}], DataConfig())
    assert (pc.solution, chat.solution, open_chat.solution) == ("s", "hello", None)
    assert Example("text", text="t").solution is None


def test_the_shape_table_is_the_one_list_of_formats():
    """data.format's choices, the ``Format`` type and auto-detection's order are FORMATS' keys: a new shape is one
    row of that table (and its reader)."""
    import dataclasses
    import typing

    from anyfit.config.schema import DataConfig
    from anyfit.data.formats import FORMATS, Format

    assert typing.get_args(Format) == tuple(FORMATS)
    field = {f.name: f for f in dataclasses.fields(DataConfig)}["format"]
    assert typing.get_args(typing.get_type_hints(DataConfig)["format"]) == ("auto", *FORMATS), field.name
