"""A tiny audio projector ("mmproj") for the default Gemma 3 270M, made with ``gguf`` (no
hub downloads), and sounds to feed it, made in code (docs/audio.md).

- :func:`tiny_ultravox_projector`: a Whisper encoder and Ultravox's projector as
  llama.cpp converts them (``clip.projector_type`` ``ultravox``; libmtmd's
  ``clip_graph_whisper_enc``), with random weights from a fixed seed. libmtmd resamples
  every clip to 16 kHz mono, computes Whisper's 80-bin log-mel spectrogram, cuts it
  into 30-second chunks of 3,000 frames (the last one padded with silence), runs two
  convolutions (the second of stride 2: 1,500 positions), two 64-dimension encoder
  layers, stacks 4 positions into one and projects into the text model's 640
  dimensions: :data:`CHUNK_TOKENS` (375) embeddings per 30 seconds begun. Ultravox
  writes no text around them. Its embeddings mean nothing; they are real libmtmd
  computations, which is what the tests exercise. Ultravox is the audio projector of
  fewest tensors and tokens per chunk libmtmd has (Qwen2-Audio's takes 750 a chunk,
  more than a default batch holds).
- :func:`sine_wav`: a sine tone as a 16-bit PCM WAV (the stdlib ``wave`` module).
- :func:`sine_mp3`: the same tone as an MP3 (``lameenc``, LAME's encoder).
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import struct
import wave
from pathlib import Path

import numpy

from ._models import _cache_dir

__all__ = [
    "CHUNK_TOKENS",
    "HEAVY",
    "heavy_ultravox_projector",
    "sine_mp3",
    "sine_wav",
    "tiny_ultravox_projector",
    "ultravox_projector",
]

#: the Whisper encoder: 64 dimensions, 128 feed-forward (≠ 64: see _vision_model.py),
#: 2 layers, 4 heads; 80 mel bins; Ultravox stacks 4 positions (with 8, the real models' factor,
#: libmtmd counts 187 tokens a chunk and its graph makes 188: a refused encode); its hidden width 128
_N_EMBD, _N_FF, _N_LAYER, _N_HEAD, _N_MEL, _STACK, _HIDDEN = 64, 128, 2, 4, 80, 4, 128
#: Gemma 3 270M's n_embd: libmtmd refuses a projector whose output differs
_N_EMBD_TEXT = 640
#: positions after the stride-2 convolution of one 3,000-frame chunk
_N_POS = 1500
#: embeddings (prompt tokens) of one 30-second chunk: 1,500 positions stacked by 4
CHUNK_TOKENS = _N_POS // _STACK


def tiny_ultravox_projector() -> Path:
    """The path of the tiny ultravox mmproj GGUF (made on first use)."""
    return ultravox_projector()


#: a heavier encoder (8 layers of 512, 2,048 feed-forward; 108 MB): a 30-second chunk's
#: encode takes seconds on 2 cores (~4 s measured on this shared machine), long enough
#: for a client to leave mid-encode (benchmarks/cancel_audio.py)
HEAVY = {"n_embd": 512, "n_ff": 2048, "n_layer": 8}


def heavy_ultravox_projector() -> Path:
    """The path of the :data:`HEAVY` ultravox mmproj GGUF (made on first use)."""
    return ultravox_projector(**HEAVY)


def ultravox_projector(*, n_embd: int = _N_EMBD, n_ff: int = _N_FF, n_layer: int = _N_LAYER) -> Path:
    """A random-weight ultravox mmproj GGUF of this shape (made on first use, cached)."""
    import gguf

    shape = f"{n_embd}:{n_ff}:{n_layer}:{_N_HEAD}:{_N_MEL}:{_STACK}:{_HIDDEN}:{_N_EMBD_TEXT}"
    recipe = f"ultravox-mmproj:{shape}:seed=43:v1"
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:12]
    target = _cache_dir() / f"tiny-ultravox-mmproj-{digest}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    rng = numpy.random.default_rng(43)

    def weight(*shape: int, scale: float = 0.02) -> numpy.ndarray:
        return (rng.standard_normal(shape) * scale).astype(numpy.float32)

    def ones(n: int) -> numpy.ndarray:
        return numpy.ones(n, dtype=numpy.float32)

    writer = gguf.GGUFWriter(str(partial), "clip")
    writer.add_name("trioserve tiny ultravox projector (random weights, tests only)")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_clip_has_audio_encoder(True)
    writer.add_clip_projector_type(gguf.VisionProjectorType.ULTRAVOX)
    writer.add_audio_projection_dim(_N_EMBD_TEXT)
    writer.add_audio_embedding_length(n_embd)
    writer.add_audio_feed_forward_length(n_ff)
    writer.add_audio_block_count(n_layer)
    writer.add_audio_head_count(_N_HEAD)
    writer.add_audio_attention_layernorm_eps(1e-5)
    writer.add_audio_num_mel_bins(_N_MEL)
    writer.add_audio_stack_factor(_STACK)
    # (numpy shapes are ggml's dimensions reversed; the converter keeps convolution
    # kernels in f16 and the biases as columns)
    writer.add_tensor("a.conv1d.1.weight", weight(n_embd, _N_MEL, 3, scale=0.05).astype(numpy.float16))
    writer.add_tensor("a.conv1d.1.bias", weight(n_embd, 1))
    writer.add_tensor("a.conv1d.2.weight", weight(n_embd, n_embd, 3, scale=0.05).astype(numpy.float16))
    writer.add_tensor("a.conv1d.2.bias", weight(n_embd, 1))
    writer.add_tensor("a.position_embd.weight", weight(_N_POS, n_embd))
    for i in range(n_layer):
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            writer.add_tensor(f"a.blk.{i}.{name}.weight", weight(n_embd, n_embd, scale=0.1))
            if name != "attn_k":  # (Whisper's keys have no bias)
                writer.add_tensor(f"a.blk.{i}.{name}.bias", weight(n_embd))
        for name in ("ln1", "ln2"):
            writer.add_tensor(f"a.blk.{i}.{name}.weight", ones(n_embd))
            writer.add_tensor(f"a.blk.{i}.{name}.bias", weight(n_embd))
        writer.add_tensor(f"a.blk.{i}.ffn_up.weight", weight(n_ff, n_embd, scale=0.1))
        writer.add_tensor(f"a.blk.{i}.ffn_up.bias", weight(n_ff))
        writer.add_tensor(f"a.blk.{i}.ffn_down.weight", weight(n_embd, n_ff, scale=0.1))
        writer.add_tensor(f"a.blk.{i}.ffn_down.bias", weight(n_embd))
    writer.add_tensor("a.post_ln.weight", ones(n_embd))
    writer.add_tensor("a.post_ln.bias", weight(n_embd))
    # Ultravox's projector: RMS norm, a matrix into 2 × hidden (SwiGLU halves), RMS norm,
    # a matrix into the text width
    stacked = n_embd * _STACK
    writer.add_tensor("mm.a.norm_pre.weight", ones(stacked))
    writer.add_tensor("mm.a.mlp.1.weight", weight(2 * _HIDDEN, stacked, scale=0.05))
    writer.add_tensor("mm.a.norm_mid.weight", ones(_HIDDEN))
    writer.add_tensor("mm.a.mlp.2.weight", weight(_N_EMBD_TEXT, _HIDDEN, scale=0.05))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(target)
    return target


def _tone(seconds: float, hz: float, rate: int) -> numpy.ndarray:
    t = numpy.arange(int(seconds * rate)) / rate
    # (a little vibrato and a second partial, so two tones differ in every chunk)
    return 0.4 * numpy.sin(2 * math.pi * hz * t + 0.5 * numpy.sin(2 * math.pi * 3 * t)) + 0.1 * numpy.sin(
        2 * math.pi * 2.5 * hz * t
    )


def sine_wav(seconds: float = 1.0, hz: float = 440.0, *, rate: int = 16000, channels: int = 1) -> bytes:
    """A tone as a 16-bit PCM WAV file."""
    samples = (_tone(seconds, hz, rate) * 32767).astype("<i2")
    if channels > 1:
        samples = numpy.repeat(samples[:, None], channels, axis=1)
    out = io.BytesIO()
    with wave.open(out, "wb") as file:
        file.setnchannels(channels)
        file.setsampwidth(2)
        file.setframerate(rate)
        file.writeframes(samples.tobytes())
    return out.getvalue()


def sine_mp3(seconds: float = 1.0, hz: float = 440.0, *, rate: int = 16000, kbps: int = 64) -> bytes:
    """A tone as an MP3 file (LAME, mono, constant bit rate)."""
    import lameenc

    encoder = lameenc.Encoder()
    encoder.set_bit_rate(kbps)
    encoder.set_in_sample_rate(rate)
    encoder.set_channels(1)
    encoder.set_quality(2)
    pcm = (_tone(seconds, hz, rate) * 32767).astype("<i2").tobytes()
    return bytes(encoder.encode(pcm) + encoder.flush())


def silence_wav(seconds: float, *, rate: int = 16000) -> bytes:
    """Silence as a 16-bit PCM WAV whose header declares ``seconds``."""
    frames = int(seconds * rate)
    header = struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF",
        36 + 2 * frames,
        b"WAVE",
        b"fmt ",
        16,
        1,
        1,
        rate,
        2 * rate,
        2,
        16,
        b"data",
        2 * frames,
    )
    return header + bytes(2 * frames)
