"""A tiny random-weight text-to-speech pair for libmtmd's PocketTTS pipeline, made with
``gguf`` (no hub downloads; docs/audio.md "Speech").

PocketTTS (kyutai's CALM) as llama.cpp converts it is two files:

- the **backbone** (``general.architecture`` ``pockettts``, ``src/models/pockettts.cpp``):
  a pre-norm transformer with LayerNorm and a GELU feed-forward and no output head;
  libmtmd's helper feeds it embedding rows (the text's token rows, then ``<|audio_bos|>``)
  and reads its last hidden state (``llama_get_embeddings_ith``). Its vocabulary is a
  SentencePiece one; the helper needs ``<|audio_bos|>`` in it
  (``mtmd-helper-gen.cpp``, ``pockettts_gen_audio_pipeline::ensure_cache``).
- the **mmproj**: a speaker encoder (``clip.audio.projector_type`` ``pockettts_spkenc``:
  mimi's SEANet encoder, a transformer, a downsampling convolution and the speaker
  projection) — libmtmd refuses an mmproj with no vision or audio encoder
  (``mtmd.cpp``: "Failed to load CLIP model") — and the generator
  (``clip.gen.audio.projector_type`` ``pockettts_gen``, ``clip.has_gen_audio_encoder``):
  the flow net that turns each hidden state into a latent, the end-of-speech head, the
  latent-to-backbone projection and mimi's decoder (a depthwise upsampling by 16, a
  transformer, SEANet's decoder up by 6 × 5 × 4): 1,920 samples of 24 kHz a frame
  (12.5 frames a second).

Every width here is tiny (the backbone 64, latents 8, mimi 32), the weights random from a
fixed seed: the sound means nothing; the computations are libmtmd's own.
"""

from __future__ import annotations

import hashlib
import os
import string
from pathlib import Path

import numpy

from ._models import _cache_dir

__all__ = ["SAMPLES_PER_FRAME", "SAMPLE_RATE", "tiny_pockettts"]

#: libmtmd's PocketTTS rate (``mtmd_gen_audio_get_info``)
SAMPLE_RATE = 24000
#: mimi's upsampling: 16 × 6 × 5 × 4
SAMPLES_PER_FRAME = 1920

#: the backbone: 64 wide, 2 layers, 4 heads, 128 feed-forward, 512 positions
_D, _N_LAYER, _N_HEAD, _N_FF, _N_CTX = 64, 2, 4, 128, 512
#: latents, the flow net's width, its time-embedding frequencies
_LATENT, _FLOW, _FREQS = 8, 32, 16
#: mimi: width, heads, feed-forward, layers; SEANet's first decoder width
_MIMI, _MIMI_HEAD, _MIMI_FF, _MIMI_LAYER, _SEANET = 32, 2, 64, 1, 32
#: SEANet's ratios (the encoder walks them forward, the decoder backward: clip.cpp)
_RATIOS = (4, 5, 6)


def _vocabulary() -> list[tuple[str, int]]:
    """A SentencePiece vocabulary: the three specials, 256 byte pieces, letters and
    punctuation with and without the word marker, ``<|audio_bos|>``."""
    normal, control, byte = 1, 3, 6
    tokens = [("<unk>", 2), ("<s>", control), ("</s>", control)]
    tokens += [(f"<0x{b:02X}>", byte) for b in range(256)]
    pieces = list(string.ascii_letters + string.digits + ".,!?;:'-")
    tokens += [(p, normal) for p in pieces] + [("\u2581" + p, normal) for p in pieces] + [("\u2581", normal)]
    tokens.append(("<|audio_bos|>", control))
    return tokens


def tiny_pockettts(*, talkative: bool = False) -> tuple[Path, Path]:
    """The paths of the tiny backbone GGUF and its mmproj (made on first use, cached).

    The end-of-speech head's bias decides how long a sentence sounds: by default it fires
    on every frame, so each chunk of text (≤ 50 tokens) ends after the helper's tail
    (``frames_after_eos``: 5 frames for ≤ 6 tokens, else 3); ``talkative`` never fires,
    so each chunk runs to the helper's budget, ``ceil((tokens / 3 + 2) × 12.5)`` frames.
    """
    recipe = (
        f"pockettts:{_D}:{_N_LAYER}:{_N_HEAD}:{_N_FF}:{_N_CTX}:{_LATENT}:{_FLOW}:{_FREQS}:"
        f"{_MIMI}:{_MIMI_HEAD}:{_MIMI_FF}:{_MIMI_LAYER}:{_SEANET}:{_RATIOS}:seed=53:v1"
    )
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:12]
    backbone = _cache_dir() / f"tiny-pockettts-{digest}.gguf"
    kind = "talkative" if talkative else "terse"
    mmproj = _cache_dir() / f"tiny-pockettts-mmproj-{kind}-{digest}.gguf"
    if not backbone.is_file():
        _write(backbone, _backbone)
    if not mmproj.is_file():
        _write(mmproj, lambda path: _mmproj(path, eos_bias=-100.0 if talkative else 100.0))
    return backbone, mmproj


def _write(target: Path, make) -> None:  # type: ignore[no-untyped-def]
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    make(str(partial))
    partial.rename(target)


class _Weights:
    def __init__(self, seed: int) -> None:
        self.rng = numpy.random.default_rng(seed)

    def __call__(self, *shape: int, scale: float = 0.05) -> numpy.ndarray:
        return (self.rng.standard_normal(shape) * scale).astype(numpy.float32)


def _ones(n: int) -> numpy.ndarray:
    return numpy.ones(n, dtype=numpy.float32)


def _backbone(path: str) -> None:
    import gguf

    weight = _Weights(53)
    vocabulary = _vocabulary()
    writer = gguf.GGUFWriter(path, "pockettts")
    writer.add_name("trioserve tiny pockettts backbone (random weights, tests only)")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(_N_CTX)
    writer.add_embedding_length(_D)
    writer.add_block_count(_N_LAYER)
    writer.add_feed_forward_length(_N_FF)
    writer.add_head_count(_N_HEAD)
    writer.add_head_count_kv(_N_HEAD)
    writer.add_layer_norm_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t for t, _ in vocabulary])
    writer.add_token_scores([0.0 if kind != 1 else -float(len(t)) for t, kind in vocabulary])
    writer.add_token_types([kind for _, kind in vocabulary])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_tensor("token_embd.weight", weight(len(vocabulary), _D, scale=0.5))
    writer.add_tensor("output_norm.weight", _ones(_D))
    writer.add_tensor("output_norm.bias", weight(_D))
    for i in range(_N_LAYER):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", _ones(_D))
            writer.add_tensor(f"blk.{i}.{norm}.bias", weight(_D))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"blk.{i}.{name}.weight", weight(_D, _D, scale=0.1))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(_N_FF, _D, scale=0.1))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(_D, _N_FF, scale=0.1))
    _finish(writer)


def _finish(writer) -> None:  # type: ignore[no-untyped-def]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _mimi_layers(writer, weight: _Weights, prefix: str) -> None:  # type: ignore[no-untyped-def]
    """mimi's transformer layers (pre-norm, layer scale on both residuals)."""
    for i in range(_MIMI_LAYER):
        for norm in ("ln1", "ln2"):
            writer.add_tensor(f"{prefix}.blk.{i}.{norm}.weight", _ones(_MIMI))
            writer.add_tensor(f"{prefix}.blk.{i}.{norm}.bias", weight(_MIMI))
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            writer.add_tensor(f"{prefix}.blk.{i}.{name}.weight", weight(_MIMI, _MIMI, scale=0.1))
        for scale in ("ls1", "ls2"):
            writer.add_tensor(f"{prefix}.blk.{i}.{scale}.weight", _ones(_MIMI) * 0.1)
        writer.add_tensor(f"{prefix}.blk.{i}.ffn_up.weight", weight(_MIMI_FF, _MIMI, scale=0.1))
        writer.add_tensor(f"{prefix}.blk.{i}.ffn_down.weight", weight(_MIMI, _MIMI_FF, scale=0.1))


def _conv(writer, weight: _Weights, name: str, out: int, inp: int, k: int, *, bias: bool = True) -> None:  # type: ignore[no-untyped-def]
    """A convolution as ggml's conv_1d reads it: kernel [K, IC, OC] (numpy reversed)."""
    writer.add_tensor(f"{name}.weight", weight(out, inp, k, scale=0.2))
    if bias:
        writer.add_tensor(f"{name}.bias", weight(out))


def _mmproj(path: str, *, eos_bias: float) -> None:
    import gguf

    weight = _Weights(59)
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_name("trioserve tiny pockettts mmproj (random weights, tests only)")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_bool("clip.has_audio_encoder", True)
    writer.add_bool("clip.has_gen_audio_encoder", True)
    writer.add_string("clip.audio.projector_type", "pockettts_spkenc")
    writer.add_string("clip.gen.audio.projector_type", "pockettts_gen")
    writer.add_string("clip.gen.audio.model_variant", "english")
    for prefix in ("audio", "gen.audio"):
        writer.add_uint32(f"clip.{prefix}.embedding_length", _MIMI)
        writer.add_uint32(f"clip.{prefix}.feed_forward_length", _MIMI_FF)
        writer.add_uint32(f"clip.{prefix}.block_count", _MIMI_LAYER)
        writer.add_uint32(f"clip.{prefix}.projection_dim", _D)
        writer.add_uint32(f"clip.{prefix}.attention.head_count", _MIMI_HEAD)
        writer.add_float32(f"clip.{prefix}.attention.layer_norm_epsilon", 1e-5)
    writer.add_uint32("clip.audio.num_mel_bins", 1)

    # the speaker encoder: SEANet's encoder (1 → 2 → 4 → 8 → 16 channels, out 32), mimi's
    # transformer, a stride-16 downsampling, the projection into the backbone
    width = _SEANET // 2 ** len(_RATIOS) // 2
    _conv(writer, weight, "a.seanet.conv_in", width, 1, 7)
    for i, stride in enumerate(_RATIOS):
        _conv(writer, weight, f"a.seanet.blk.{i}.res_conv1", width // 2, width, 3)
        _conv(writer, weight, f"a.seanet.blk.{i}.res_conv2", width, width // 2, 1)
        _conv(writer, weight, f"a.seanet.blk.{i}.scale_conv", width * 2, width, 2 * stride)
        width *= 2
    _conv(writer, weight, "a.seanet.conv_out", _MIMI, width, 3)
    _mimi_layers(writer, weight, "a")
    _conv(writer, weight, "a.downsample.conv", _MIMI, _MIMI, 32, bias=False)
    writer.add_tensor("a.speaker_proj.weight", weight(_D, _MIMI))

    # the generator: the flow net (one AdaLN block), the end-of-speech head, the latent
    # into the backbone, then mimi's decoder
    writer.add_tensor("a.gen.flow.input_proj.weight", weight(_FLOW, _LATENT, scale=0.2))
    writer.add_tensor("a.gen.flow.input_proj.bias", weight(_FLOW))
    writer.add_tensor("a.gen.flow.cond_embd.weight", weight(_FLOW, _D, scale=0.2))
    writer.add_tensor("a.gen.flow.cond_embd.bias", weight(_FLOW))
    for t in range(2):
        freqs = numpy.exp(-numpy.arange(_FREQS, dtype=numpy.float32) / 4)
        writer.add_tensor(f"a.gen.flow.time.{t}.freqs", freqs)
        writer.add_tensor(f"a.gen.flow.time.{t}.up.weight", weight(_FLOW, 2 * _FREQS, scale=0.2))
        writer.add_tensor(f"a.gen.flow.time.{t}.up.bias", weight(_FLOW))
        writer.add_tensor(f"a.gen.flow.time.{t}.down.weight", weight(_FLOW, _FLOW, scale=0.2))
        writer.add_tensor(f"a.gen.flow.time.{t}.down.bias", weight(_FLOW))
        writer.add_tensor(f"a.gen.flow.time.{t}.norm", _ones(_FLOW))
    writer.add_tensor("a.gen.flow.blk.0.norm.weight", _ones(_FLOW))
    writer.add_tensor("a.gen.flow.blk.0.norm.bias", weight(_FLOW))
    writer.add_tensor("a.gen.flow.blk.0.up.weight", weight(_FLOW, _FLOW, scale=0.2))
    writer.add_tensor("a.gen.flow.blk.0.up.bias", weight(_FLOW))
    writer.add_tensor("a.gen.flow.blk.0.down.weight", weight(_FLOW, _FLOW, scale=0.2))
    writer.add_tensor("a.gen.flow.blk.0.down.bias", weight(_FLOW))
    writer.add_tensor("a.gen.flow.blk.0.ada.weight", weight(3 * _FLOW, _FLOW, scale=0.2))
    writer.add_tensor("a.gen.flow.blk.0.ada.bias", weight(3 * _FLOW))
    writer.add_tensor("a.gen.flow.final.ada.weight", weight(2 * _FLOW, _FLOW, scale=0.2))
    writer.add_tensor("a.gen.flow.final.ada.bias", weight(2 * _FLOW))
    writer.add_tensor("a.gen.flow.final.proj.weight", weight(_LATENT, _FLOW, scale=0.2))
    writer.add_tensor("a.gen.flow.final.proj.bias", weight(_LATENT))
    writer.add_tensor("a.gen.out_eos.weight", weight(1, _D, scale=0.2))
    # (a bias far from the threshold, -4, either way: a random head would end speech at a
    # random frame; see tiny_pockettts)
    writer.add_tensor("a.gen.out_eos.bias", numpy.full(1, eos_bias, dtype=numpy.float32))
    writer.add_tensor("a.gen.input_linear.weight", weight(_D, _LATENT, scale=0.5))
    writer.add_tensor("a.gen.emb_mean", weight(_LATENT))
    writer.add_tensor("a.gen.emb_std", _ones(_LATENT))
    writer.add_tensor("a.gen.wav.quant_out.weight", weight(_MIMI, _LATENT, scale=0.3))
    # depthwise transposed convolution, kernel [32, 1, C]
    writer.add_tensor("a.gen.wav.upsample.weight", weight(_MIMI, 1, 32, scale=0.2))
    _mimi_layers(writer, weight, "a.gen.wav.tfm")
    width = _SEANET
    _conv(writer, weight, "a.gen.wav.seanet.conv_in", width, _MIMI, 7)
    for i, stride in enumerate(reversed(_RATIOS)):
        # transposed: kernel [K, OC, IC] (numpy reversed: IC, OC, K)
        kernel = weight(width, width // 2, 2 * stride, scale=0.2)
        writer.add_tensor(f"a.gen.wav.seanet.blk.{i}.scale_conv.weight", kernel)
        writer.add_tensor(f"a.gen.wav.seanet.blk.{i}.scale_conv.bias", weight(width // 2))
        width //= 2
        _conv(writer, weight, f"a.gen.wav.seanet.blk.{i}.res_conv1", width // 2, width, 3)
        _conv(writer, weight, f"a.gen.wav.seanet.blk.{i}.res_conv2", width, width // 2, 1)
    _conv(writer, weight, "a.gen.wav.seanet.conv_out", 1, width, 3)
    _finish(writer)
