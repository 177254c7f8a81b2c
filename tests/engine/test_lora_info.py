"""lora_engine/stack/lora_info.py: what the metadata route reports for headers of known writers."""

from __future__ import annotations

import json

import pytest

from lora_engine.stack import lora_info


def kohya(prefix: str, rank: int, width: int = 320, ctx: int = 768) -> dict:
    return {f"{prefix}_attn1_to_q.lora_down.weight": [rank, width],
            f"{prefix}_attn1_to_q.lora_up.weight": [width, rank],
            f"{prefix}_attn2_to_k.lora_down.weight": [rank, ctx], f"{prefix}_attn1_to_q.alpha": []}


SD15 = kohya("lora_unet_down_blocks_0_attentions_0_transformer_blocks_0", 8)

FAMILY_CASES = [
    # (metadata, tensors, family, source)
    ({"ss_base_model_version": "sd_v1"}, SD15, "SD1.x", "metadata"),
    ({"ss_base_model_version": "sdxl_base_v1-0"}, SD15, "SDXL", "metadata"),
    ({"ss_base_model_version": "sd_v2_768_v"}, SD15, "SD2.x", "metadata"),
    ({"ss_v2": "True"}, SD15, "SD2.x", "metadata"),
    ({"modelspec.architecture": "stable-diffusion-xl-v1-base/lora"}, SD15, "SDXL", "metadata"),
    ({"modelspec.architecture": "flux-1-dev/lora", "ss_base_model_version": "sd_v1"}, SD15, "Flux", "metadata"),
    ({"modelspec.architecture": "stable-diffusion-v1/lora"}, SD15, "SD1.x", "metadata"),
    ({"modelspec.architecture": "some-new-model/lora"}, SD15, "some-new-model/lora", "metadata"),
    ({}, SD15, "SD1.x", "keys"),
    ({}, kohya("lora_unet_mid_block_attentions_0_transformer_blocks_0", 4, 1280, 1024), "SD2.x", "keys"),
    ({}, {**SD15, "lora_te2_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": [8, 1280]}, "SDXL", "keys"),
    ({}, {"transformer.single_transformer_blocks.0.attn.to_q.lora_A.weight": [16, 3072]}, "Flux", "keys"),
    ({}, {"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": [16, 3072]}, "Flux", "keys"),
    ({}, {"unet.down_blocks.0.attentions.0.transformer_blocks.0.attn2.processor.to_k.lora_A.weight": [4, 768]},
     "SD1.x", "keys"),
    ({}, {"something.weight": [3, 3]}, None, None),
]


@pytest.mark.parametrize("metadata, tensors, family, source", FAMILY_CASES)
def test_base_model_family(metadata, tensors, family, source):
    d = lora_info.describe(tensors, metadata)
    assert (d["base_model"], d["base_model_source"]) == (family, source)


@pytest.mark.parametrize("tensors, rank, ranks", [
    (SD15, 8, [8]),
    ({**SD15, **kohya("lora_unet_up_blocks_1_attentions_0_transformer_blocks_0", 32)}, 32, [8, 32]),
    ({"a.lora_A.weight": [16, 64], "a.lora_B.weight": [64, 16]}, 16, [16]),
    ({"a.lora_A.default.weight": [12, 64]}, 12, [12]),
    ({"a.lora.down.weight": [6, 64]}, 6, [6]),
    ({"a.lora_linear_layer.down.weight": [2, 64]}, 2, [2]),
    ({"a.hada_w1_b": [8, 64], "a.hada_w2_b": [8, 64]}, 8, [8]),
    ({"a.lora_down.weight": [4, 320, 3, 3]}, 4, [4]),  # LoCon convolution
    ({"a.diff": [64, 64]}, None, []),
])
def test_rank_from_tensor_shapes(tensors, rank, ranks):
    d = lora_info.describe(tensors, {})
    assert (d["rank"], d["ranks"]) == (rank, ranks)


def test_triggers_phrase_first_then_tags_by_count():
    meta = {"modelspec.trigger_phrase": "ohwx man, portrait",
            "ss_tag_frequency": json.dumps({"10_ohwx": {"ohwx man": 50, "smile": 10, "beard": 30},
                                            "1_reg": {"smile": 25, " ": 99}})}
    assert lora_info.describe({}, meta)["triggers"] == ["ohwx man", "portrait", "smile", "beard"]


@pytest.mark.parametrize("raw", ["not json", "[1, 2]", json.dumps({"a": "b"}), json.dumps({"a": {"t": "x"}}),
                                 "[" * 100000 + "]" * 100000, '{"a": {"t": ' + "9" * 5000 + "}}"])
def test_broken_tag_frequency_gives_no_triggers(raw):
    assert lora_info.describe({}, {"ss_tag_frequency": raw})["triggers"] == []


def test_triggers_are_capped_in_number_and_length():
    tags = {f"tag{i}" + "x" * 500: 100 - i for i in range(30)}
    got = lora_info.describe({}, {"ss_tag_frequency": json.dumps({"d": tags})})["triggers"]
    assert len(got) == lora_info.MAX_TRIGGERS
    assert all(len(t) <= lora_info.MAX_TEXT for t in got) and got[0].startswith("tag0")


def test_alpha_title_and_tensor_count():
    d = lora_info.describe(SD15, {"ss_network_alpha": "4.0", "modelspec.title": "My LoRA"})
    assert (d["alpha"], d["title"], d["tensors"]) == ("4.0", "My LoRA", len(SD15))
