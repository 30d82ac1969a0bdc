# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Layer-level tests of the shared encoder seam (``vllm_npu.models.encoder_attention``): vLLM's SigLIP, Idefics2
and InternViT towers converted by ``adopt_encoder_attention`` give the towers' own (SDPA) outputs through the NPU
kernel's reference twin; transformers' Qwen2-Audio and Qwen2.5-Omni audio encoders give their SDPA outputs through
``npu_encoder_attention`` (padded batch, packed chunks); a mask of another shape falls back to SDPA."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm_npu.interface import configure_kernels  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _reference_kernels():
    configure_kernels("reference")


def _randomise(module: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def _siglip():
    import transformers
    from vllm.model_executor.models.siglip import SiglipVisionModel

    cfg = transformers.SiglipVisionConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, image_size=56, patch_size=14
    )
    return SiglipVisionModel(cfg), torch.randn(2, 3, 56, 56, generator=torch.Generator().manual_seed(1))


def _idefics2():
    from transformers.models.idefics2.configuration_idefics2 import Idefics2VisionConfig
    from vllm.model_executor.models.idefics2_vision_model import Idefics2VisionTransformer

    cfg = Idefics2VisionConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2, image_size=56, patch_size=14
    )
    return Idefics2VisionTransformer(cfg), torch.randn(2, 3, 56, 56, generator=torch.Generator().manual_seed(1))


def _intern_vit():
    from transformers import PretrainedConfig
    from vllm.model_executor.models.intern_vit import InternVisionModel

    cfg = PretrainedConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=56,
        patch_size=14,
        num_channels=3,
        qkv_bias=True,
        qk_normalization=False,
        norm_type="layer_norm",
        layer_norm_eps=1e-6,
        initializer_factor=1.0,
        drop_path_rate=0.0,
        hidden_act="gelu",
    )
    return InternVisionModel(cfg), torch.randn(3, 3, 56, 56, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", ["siglip", "idefics2", "intern_vit"])
def test_converted_vit_matches_vllm(tp1_group, family: str) -> None:
    from vllm.attention.layer import MultiHeadAttention
    from vllm_npu.models.encoder_attention import AscendMultiHeadAttention, adopt_encoder_attention

    build = {"siglip": _siglip, "idefics2": _idefics2, "intern_vit": _intern_vit}[family]
    tower, pixels = build()
    ours, _ = build()
    _randomise(tower)
    _randomise(ours)
    attns = [m for m in ours.modules() if isinstance(m, MultiHeadAttention)]
    assert len(attns) == 2 and all(type(m) is MultiHeadAttention for m in attns)
    assert adopt_encoder_attention(ours) == 2
    assert all(type(m) is AscendMultiHeadAttention for m in attns)
    assert adopt_encoder_attention(ours) == 0  # already converted
    # Idefics2 (MiniCPM-V) takes each image's valid-patch mask: all patches valid here.
    kwargs = {"patch_attention_mask": torch.ones(len(pixels), 4, 4, dtype=torch.bool)} if family == "idefics2" else {}
    with torch.no_grad():
        want, got = tower(pixels, **kwargs), ours(pixels, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert [m.npu_calls for m in attns] == [1, 1]


@pytest.mark.parametrize("gqa", [False, True])
def test_multi_head_attention_layouts_and_gqa(tp1_group, gqa: bool) -> None:
    from vllm.attention.layer import MultiHeadAttention
    from vllm_npu.models.encoder_attention import adopt_encoder_attention

    kv = 2 if gqa else 4
    ref = MultiHeadAttention(4, 16, 0.25, num_kv_heads=kv)
    holder = torch.nn.Module()
    holder.attn = MultiHeadAttention(4, 16, 0.25, num_kv_heads=kv)
    adopt_encoder_attention(holder)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 7, 4 * 16, generator=gen)
    k, v = (torch.randn(3, 7, kv, 16, generator=gen) for _ in range(2))  # the [B, S, N, D] form for key/value
    torch.testing.assert_close(holder.attn(q, k, v), ref(q, k, v), rtol=1e-5, atol=1e-5)
    # Cross attention (key longer than query) is not this kernel's contract: vLLM's own forward runs.
    k2, v2 = (torch.randn(3, 9, kv, 16, generator=gen) for _ in range(2))
    torch.testing.assert_close(holder.attn(q, k2, v2), ref(q, k2, v2))
    assert holder.attn.npu_calls == 1


def _spy_kernel(monkeypatch) -> list[list[int]]:
    """Record the sequence lengths of every ``attend_packed`` call of the seam."""
    from vllm_npu.models import encoder_attention

    calls: list[list[int]] = []
    real = encoder_attention.attend_packed

    def spy(q, k, v, seq_lens, **kw):
        calls.append(list(seq_lens))
        return real(q, k, v, seq_lens, **kw)

    monkeypatch.setattr(encoder_attention, "attend_packed", spy)
    return calls


def test_qwen2_audio_encoder_with_padding_mask_matches_sdpa(monkeypatch) -> None:
    import transformers
    from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder
    from vllm_npu.models.encoder_attention import HF_ATTENTION, SEQ_LENS_MEMO, adopt_encoder_attention

    cfg = transformers.Qwen2AudioEncoderConfig(
        num_mel_bins=16,
        encoder_layers=2,
        encoder_attention_heads=2,
        d_model=32,
        encoder_ffn_dim=64,
        max_source_positions=20,
    )
    cfg._attn_implementation = "sdpa"
    tower = Qwen2AudioEncoder(cfg).eval()
    _randomise(tower)
    holder = torch.nn.Module()
    holder.audio_tower = tower
    feats = torch.randn(2, 16, 40, generator=torch.Generator().manual_seed(2))
    calls = _spy_kernel(monkeypatch)
    memo_before = SEQ_LENS_MEMO.computed
    lens = torch.tensor([20, 13])  # after the stride-2 conv: the second audio is padded
    # vLLM's qwen2_audio mask: -inf on keys from each audio's length on, for every query row.
    pad = torch.arange(20)[None, :] >= lens[:, None]
    mask = torch.zeros(2, 1, 20, 20)
    mask.masked_fill_(pad[:, None, None, :], float("-inf"))
    with torch.no_grad():
        want = tower(feats, attention_mask=mask).last_hidden_state
        assert adopt_encoder_attention(holder, hf_towers=("audio_tower",)) == 2
        assert tower.config._attn_implementation == HF_ATTENTION
        got = tower(feats, attention_mask=mask).last_hidden_state
    # The valid outputs match: audio 0 whole, audio 1's (13 - 2) // 2 + 1 = 6 pooled positions (what vLLM keeps);
    # the padded ones, which vLLM drops, differ by design.
    assert got.shape == want.shape == (2, 10, 32)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1, :6], want[1, :6], rtol=1e-5, atol=1e-5)
    assert calls == [[20, 13]] * 2  # each layer: the two audios' valid lengths, read back from the mask
    assert SEQ_LENS_MEMO.computed - memo_before == 1  # once per forward (both layers get the same mask tensor)


def test_qwen2_5_omni_audio_encoder_chunks_match_sdpa(monkeypatch) -> None:
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniAudioEncoderConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder
    from vllm_npu.models.encoder_attention import SEQ_LENS_MEMO, adopt_encoder_attention

    cfg = Qwen2_5OmniAudioEncoderConfig(
        num_mel_bins=16,
        encoder_layers=2,
        encoder_attention_heads=2,
        d_model=32,
        encoder_ffn_dim=64,
        output_dim=48,
        n_window=4,
        max_source_positions=64,
    )
    cfg._attn_implementation = "sdpa"
    tower = Qwen2_5OmniAudioEncoder(cfg).eval()
    _randomise(tower)
    holder = torch.nn.Module()
    holder.audio_tower = tower
    feature_lens = torch.tensor([30, 11])  # two audios, several n_window chunks each (one partial)
    feats = torch.randn(16, int(feature_lens.sum()), generator=torch.Generator().manual_seed(2))
    after_cnn, _ = tower._get_feat_extract_output_lengths(feature_lens)
    calls = _spy_kernel(monkeypatch)
    memo_before = SEQ_LENS_MEMO.computed
    with torch.no_grad():
        want = tower(feats, feature_lens=feature_lens, aftercnn_lens=after_cnn).last_hidden_state
        adopt_encoder_attention(holder, hf_towers=("audio_tower",))
        got = tower(feats, feature_lens=feature_lens, aftercnn_lens=after_cnn).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Each layer sees the packed chunks of both audios; their lengths were read from the device once.
    assert len(calls) == 2 and calls[0] == calls[1] and sum(calls[0]) == int(after_cnn.sum()), calls
    assert SEQ_LENS_MEMO.computed - memo_before == 1


def test_an_arbitrary_mask_falls_back_to_sdpa() -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from vllm_npu.models.encoder_attention import npu_encoder_attention

    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=gen) for _ in range(3))
    mask = torch.zeros(1, 1, 6, 6)
    mask[0, 0, 2, 1] = float("-inf")  # not a key-padding mask: one query row differs
    module = torch.nn.Module()
    module.is_causal = False
    got, _ = npu_encoder_attention(module, q, k, v, mask, scaling=0.3)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="dropout is a training feature"):
        npu_encoder_attention(module, q, k, v, None, dropout=0.1)


def test_the_registry_maps_the_multimodal_architectures_to_the_overrides() -> None:
    from vllm import ModelRegistry
    from vllm_npu.models._hooks import MODEL_OVERRIDES, register_models

    register_models()
    for arch in (
        "Gemma3ForConditionalGeneration",
        "InternVLChatModel",
        "InternVLForConditionalGeneration",
        "MiniCPMV",
        "Qwen2AudioForConditionalGeneration",
        "Qwen2_5OmniModel",
        "Qwen2_5OmniForConditionalGeneration",
    ):
        entry = ModelRegistry.models[arch]
        assert f"{entry.module_name}:{entry.class_name}" == MODEL_OVERRIDES[arch]
        assert entry.module_name == "vllm_npu.models.multimodal"


def test_minicpmv_tower_masks_padded_slices(tp1_group) -> None:
    """MiniCPM-V batches slices of different patch counts into one tower call, padded to the longest, with a prefix
    patch mask: the converted tower attends each slice's own patches only, so every slice's valid tokens equal the
    tower run on that slice alone (vLLM 0.11's SDPA path attends the padding: asserted to differ)."""
    from vllm_npu.models.encoder_attention import adopt_encoder_attention
    from vllm_npu.models.multimodal import AscendIdefics2VisionTransformer

    tower, _ = _idefics2()
    ours, _ = _idefics2()
    _randomise(tower)
    _randomise(ours)
    adopt_encoder_attention(ours)
    ours.__class__ = AscendIdefics2VisionTransformer
    gen = torch.Generator().manual_seed(5)
    sizes = [(2, 2), (2, 3)]  # patch rows x cols per slice: 4 and 6 patches, laid out by patch as [3, 14, n * 14]
    slices = [torch.randn(3, 14, h * w * 14, generator=gen) for h, w in sizes]
    batch = torch.zeros(2, 3, 14, 6 * 14)
    mask = torch.zeros(2, 1, 6, dtype=torch.bool)
    for i, s in enumerate(slices):
        batch[i, ..., : s.shape[-1]] = s
        mask[i, 0, : s.shape[-1] // 14] = True
    tgt = torch.tensor(sizes)
    with torch.no_grad():
        alone = [
            tower(s[None], patch_attention_mask=mask[i : i + 1, :, : s.shape[-1] // 14], tgt_sizes=tgt[i : i + 1])[0]
            for i, s in enumerate(slices)
        ]
        got = ours(batch, patch_attention_mask=mask, tgt_sizes=tgt)
        vllm_padded = tower(batch, patch_attention_mask=mask, tgt_sizes=tgt)
    for i, want in enumerate(alone):
        torch.testing.assert_close(got[i, : len(want)], want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(vllm_padded[0, :4], alone[0], atol=1e-3)  # vLLM's path: the short slice sees padding
    assert all(m.row_lens is None for m in ours.modules() if hasattr(m, "row_lens"))  # cleared after the call


def test_prefix_lengths() -> None:
    from vllm_npu.models.encoder_attention import prefix_lengths

    assert prefix_lengths(torch.tensor([[True, True, False], [True, True, True]])) == [2, 3]
    assert prefix_lengths(torch.tensor([[True, False, True]])) is None  # not a prefix: vLLM's behaviour kept
