"""A tiny vision projector ("mmproj") for the default Gemma 3 270M, made with ``gguf`` (no
hub downloads): written once, cached beside the default model (``…/test-models/``), named
by a digest of its recipe, like the models in ``_models.py``.

- :func:`tiny_gemma3_projector`: a SigLIP vision tower and Gemma 3's projector as
  llama.cpp converts them (``clip.projector_type`` ``gemma3``; libmtmd's
  ``clip_graph_siglip``), with random weights from a fixed seed. libmtmd resizes every
  image to :data:`IMAGE_SIZE` square, cuts it into :data:`PATCH_SIZE` patches (8 × 8),
  runs two 64-dimension encoder layers, average-pools 2 × 2 patches
  (``clip.vision.projector.scale_factor``) and projects the 4 × 4 result into the text
  model's 640 dimensions: :data:`IMAGE_TOKENS` (16) embeddings per image, wrapped by the
  text model's ``<start_of_image>`` / ``<end_of_image>`` tokens. Its embeddings mean
  nothing; they are real libmtmd computations, which is what the tests exercise.
- :func:`solid_png`: a large PNG of one colour, in a small file (a decompression bomb:
  1-bit and 30,000 pixels square in ~110 KB), compressed row by row.
- :func:`png_bytes`: a small RGB PNG (solid or a gradient) made with ``zlib`` alone
  (no Pillow), for image parts of requests.
"""

from __future__ import annotations

import hashlib
import os
import struct
import zlib
from pathlib import Path

import numpy

from ._models import _cache_dir

__all__ = [
    "IMAGE_SIZE",
    "IMAGE_TOKENS",
    "PATCH_SIZE",
    "gemma3_projector",
    "heavy_gemma3_projector",
    "png_bytes",
    "solid_png",
    "tiny_gemma3_projector",
    "wide_gemma3_projector",
]

#: what libmtmd resizes every image to (square), and the patch side in pixels
IMAGE_SIZE, PATCH_SIZE = 64, 8
#: patches pooled per side before the projection (the real models: 4, 896 / 14 → 256 tokens)
_MERGE = 2
#: the vision tower: 64 dimensions, 128 feed-forward (must differ from 64, or libmtmd
#: takes the ffn tensors for a legacy up/down swap), 2 layers, 4 heads
_N_EMBD, _N_FF, _N_LAYER, _N_HEAD = 64, 128, 2, 4
#: Gemma 3 270M's n_embd: libmtmd refuses a projector whose output differs
_N_EMBD_TEXT = 640
#: image embeddings (tokens) per image
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE // _MERGE) ** 2


def tiny_gemma3_projector() -> Path:
    """The path of the tiny gemma3 mmproj GGUF (made on first use)."""
    return gemma3_projector()


def heavy_gemma3_projector() -> Path:
    """A gemma3 projector laid out as the real one (896-pixel images, 14-pixel patches,
    4 × 4 pooling: 256 image tokens), narrow and shallow but with the real 4,096
    patches, so an encode takes long enough to leave in the middle of (its weights are
    random too): the benchmarks' and the encode-cancel test's."""
    return gemma3_projector(image_size=896, patch_size=14, merge=4, n_embd=128, n_ff=256, n_layer=4)


def wide_gemma3_projector() -> Path:
    """Two layers of the real Gemma 3 vision tower's width (SigLIP so400m: 1,152
    dimensions, 4,304 feed-forward, 16 heads) over the real 4,096 patches: how long one
    graph node of a real encode takes, which bounds how soon a cancel stops it."""
    return gemma3_projector(
        image_size=896, patch_size=14, merge=4, n_embd=1152, n_ff=4304, n_layer=2, n_head=16
    )


def gemma3_projector(
    *,
    image_size: int = IMAGE_SIZE,
    patch_size: int = PATCH_SIZE,
    merge: int = _MERGE,
    n_embd: int = _N_EMBD,
    n_ff: int = _N_FF,
    n_layer: int = _N_LAYER,
    n_head: int = _N_HEAD,
) -> Path:
    """A random-weight gemma3 mmproj GGUF of this shape (made on first use, cached)."""
    import gguf

    recipe = (
        f"gemma3-mmproj:{image_size}:{patch_size}:{merge}:{n_embd}:{n_ff}:{n_layer}:{n_head}"
        f":{_N_EMBD_TEXT}:seed=41:v1"
    )
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:12]
    target = _cache_dir() / f"tiny-gemma3-mmproj-{digest}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    rng = numpy.random.default_rng(41)

    def weight(*shape: int, scale: float = 0.02) -> numpy.ndarray:
        return (rng.standard_normal(shape) * scale).astype(numpy.float32)

    def ones(n: int) -> numpy.ndarray:
        return numpy.ones(n, dtype=numpy.float32)

    n_patches = (image_size // patch_size) ** 2
    writer = gguf.GGUFWriter(str(partial), "clip")
    writer.add_name("trioserve tiny gemma3 projector (random weights, tests only)")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
    writer.add_vision_projection_dim(_N_EMBD_TEXT)
    writer.add_vision_image_size(image_size)
    writer.add_vision_patch_size(patch_size)
    writer.add_vision_embedding_length(n_embd)
    writer.add_vision_feed_forward_length(n_ff)
    writer.add_vision_block_count(n_layer)
    writer.add_vision_head_count(n_head)
    writer.add_vision_attention_layernorm_eps(1e-6)
    writer.add_vision_use_gelu(True)
    writer.add_vision_image_mean([0.5, 0.5, 0.5])
    writer.add_vision_image_std([0.5, 0.5, 0.5])
    writer.add_vision_projector_scale_factor(merge)
    # (numpy shapes are ggml's dimensions reversed)
    writer.add_tensor("v.patch_embd.weight", weight(n_embd, 3, patch_size, patch_size, scale=0.05))
    writer.add_tensor("v.patch_embd.bias", weight(n_embd))
    writer.add_tensor("v.position_embd.weight", weight(n_patches, n_embd))
    for i in range(n_layer):
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            writer.add_tensor(f"v.blk.{i}.{name}.weight", weight(n_embd, n_embd, scale=0.1))
            writer.add_tensor(f"v.blk.{i}.{name}.bias", weight(n_embd))
        for name in ("ln1", "ln2"):
            writer.add_tensor(f"v.blk.{i}.{name}.weight", ones(n_embd))
            writer.add_tensor(f"v.blk.{i}.{name}.bias", weight(n_embd))
        writer.add_tensor(f"v.blk.{i}.ffn_up.weight", weight(n_ff, n_embd, scale=0.1))
        writer.add_tensor(f"v.blk.{i}.ffn_up.bias", weight(n_ff))
        writer.add_tensor(f"v.blk.{i}.ffn_down.weight", weight(n_embd, n_ff, scale=0.1))
        writer.add_tensor(f"v.blk.{i}.ffn_down.bias", weight(n_embd))
    writer.add_tensor("v.post_ln.weight", ones(n_embd))
    writer.add_tensor("v.post_ln.bias", weight(n_embd))
    # Gemma 3's projector: RMS norm (weight stored as 1 + w, as the converter does), then
    # a plain matrix from the vision width to the text width (ggml [640, 64])
    writer.add_tensor("mm.soft_emb_norm.weight", ones(n_embd))
    writer.add_tensor("mm.input_projection.weight", weight(n_embd, _N_EMBD_TEXT))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(target)
    return target


def png_bytes(width: int = 32, height: int = 32, color: tuple[int, int, int] | None = None) -> bytes:
    """An RGB PNG: one ``color`` throughout, or (``None``) a red/green gradient."""
    if color is None:
        ys, xs = numpy.mgrid[0:height, 0:width]
        pixels = numpy.stack(
            [xs * 255 // max(width - 1, 1), ys * 255 // max(height - 1, 1), numpy.full_like(xs, 96)],
            axis=-1,
        ).astype(numpy.uint8)
    else:
        pixels = numpy.empty((height, width, 3), dtype=numpy.uint8)
        pixels[:] = color
    # each row: filter type 0 (none), then its pixels
    raw = b"".join(b"\x00" + row.tobytes() for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


def solid_png(width: int, height: int, *, bits: int = 8, color_type: int = 2, byte: int = 0x5A) -> bytes:
    """A ``width`` × ``height`` PNG whose every byte of pixel data is ``byte`` (``bits``
    per sample; ``color_type`` 0: grey, 2: RGB), compressed row by row: never held whole."""
    samples = {0: 1, 2: 3}[color_type]
    row = b"\x00" + bytes([byte]) * ((width * samples * bits + 7) // 8)  # (filter 0: none)
    packer = zlib.compressobj(9)
    rows = 256
    block = row * rows
    parts = [packer.compress(block) for _ in range(height // rows)]
    parts.append(packer.compress(row * (height % rows)))
    parts.append(packer.flush())

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, bits, color_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", b"".join(parts)) + chunk(b"IEND", b"")
    )
