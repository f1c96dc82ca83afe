"""Small test models made with ``gguf`` (no hub downloads): written once, cached beside
the default model (``…/test-models/``), named by a digest of what made them so a change
here makes a new file. Both servers (trioserve and llama.cpp's llama-server) load them.

- :func:`fim_model`: the default Gemma 3 270M with three (``plain``) or five
  (``repo``) of its unused special tokens named as FIM tokens (``gguf_new_metadata``):
  a real model with real fill-in-the-middle plumbing (the default has none).
- :func:`reasoning_model`: the default Gemma 3 270M with a chat template that opens a
  ``<think>`` block after the generation prompt (``gguf_new_metadata --chat-template``):
  the server reads it as a reasoning model (its weights do not reason; the markers and
  the scheduler's forced tokens are what the tests exercise).
- :func:`tools_model`: the default with a chat template that renders ``tools``.
- :func:`tiny_reranker`: a cross-encoder as llama.cpp converts BERT rerankers
  (bge-reranker, ms-marco MiniLM): architecture ``bert``, pooling type 4 (rank), the
  classification head (``cls`` dense + tanh, ``cls.output`` to one label), a WordPiece
  vocabulary of letters, digits, punctuation and a few hundred words; random weights
  from a fixed seed. Its scores mean nothing about relevance; they are real llama.cpp
  computations of a real rank-pooling graph, which is what the tests compare.
"""

from __future__ import annotations

import hashlib
import os
import string
import subprocess
import sys
from pathlib import Path

import numpy

from trioserve import default_model_path

__all__ = [
    "FIM_LAYOUTS",
    "REASONING_TEMPLATE",
    "TOOLS_TEMPLATE",
    "fim_model",
    "reasoning_model",
    "tiny_reranker",
    "tools_model",
]

#: the shapes: 2 layers of 64 dimensions, 4 heads, 512 positions
_N_EMBD, _N_FF, _N_LAYER, _N_HEAD, _N_CTX = 64, 128, 2, 4, 512
_WORDS = """
the a an of to in on for with and or is are was were be been it its this that these those
what which who how why when where there here than then so not no yes do does did can could
will would should may might must have has had by from at as about into over under after
before between through during without within city river bridge market history long old new
water boils degrees celsius sea level fox dog quick brown lazy jumps embeddings vectors
text texts model models search query document documents rank ranking relevant relevance
python code function circle area radius rome paris london capital country france italy
england germany spain europe world time year day night sun moon star planet earth mars
cat cats dog dogs bird fish tree trees flower green blue red black white small large big
computer server request response cancel stop run runs fast slow memory disk cache token
tokens prompt answer question love life music book books read write learn learning deep
machine neural network language english french train trains car cars road city town food
apple apples banana fruit eat eats drink coffee tea milk bread house home room door window
""".split()  # noqa: SIM905 (a word list reads better as text)


def _vocabulary() -> list[str]:
    """WordPiece tokens as llama.cpp's converter stores them: special tokens in brackets,
    a word's first piece with ``▁`` before it, a continuation piece bare."""
    tokens = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    pieces = list(string.ascii_lowercase + string.digits + string.punctuation)
    tokens += ["\u2581" + piece for piece in pieces]  # a word's first character
    tokens += pieces  # (##x) the next ones
    tokens += ["\u2581" + word for word in dict.fromkeys(_WORDS)]
    tokens += ["ing", "ed", "es", "er", "ly", "s"]
    return list(dict.fromkeys(tokens))


def _cache_dir() -> Path:
    return default_model_path(progress=False).parent / "test-models"


def tiny_reranker() -> Path:
    """The path of the tiny cross-encoder GGUF (made on first use)."""
    import gguf

    vocabulary = _vocabulary()
    recipe = f"bert-rank:{_N_EMBD}:{_N_FF}:{_N_LAYER}:{_N_HEAD}:{_N_CTX}:{len(vocabulary)}:seed=37:v1"
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:12]
    target = _cache_dir() / f"tiny-reranker-{digest}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    rng = numpy.random.default_rng(37)

    def weight(*shape: int, scale: float = 0.08) -> numpy.ndarray:
        return (rng.standard_normal(shape) * scale).astype(numpy.float32)

    def ones(n: int) -> numpy.ndarray:
        return numpy.ones(n, dtype=numpy.float32)

    writer = gguf.GGUFWriter(str(partial), "bert")
    writer.add_name("trioserve tiny reranker (random weights, tests only)")
    writer.add_context_length(_N_CTX)
    writer.add_embedding_length(_N_EMBD)
    writer.add_feed_forward_length(_N_FF)
    writer.add_block_count(_N_LAYER)
    writer.add_head_count(_N_HEAD)
    writer.add_layer_norm_eps(1e-12)
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType.RANK)
    writer.add_classifier_output_labels(["LABEL_0"])
    writer.add_tokenizer_model("bert")
    writer.add_token_list(vocabulary)
    types = [
        gguf.TokenType.CONTROL if token.startswith("[") and token.endswith("]") else gguf.TokenType.NORMAL
        for token in vocabulary
    ]
    types[vocabulary.index("[UNK]")] = gguf.TokenType.UNKNOWN
    writer.add_token_types(types)
    writer.add_token_type_count(2)
    writer.add_bos_token_id(vocabulary.index("[CLS]"))
    writer.add_sep_token_id(vocabulary.index("[SEP]"))
    writer.add_unk_token_id(vocabulary.index("[UNK]"))
    writer.add_pad_token_id(vocabulary.index("[PAD]"))
    writer.add_mask_token_id(vocabulary.index("[MASK]"))
    writer.add_add_bos_token(True)
    writer.add_add_sep_token(True)
    # (numpy shapes are ggml's dimensions reversed)
    writer.add_tensor("token_embd.weight", weight(len(vocabulary), _N_EMBD, scale=0.5))
    writer.add_tensor("token_types.weight", weight(2, _N_EMBD, scale=0.5))
    writer.add_tensor("position_embd.weight", weight(_N_CTX, _N_EMBD, scale=0.5))
    writer.add_tensor("token_embd_norm.weight", ones(_N_EMBD))
    writer.add_tensor("token_embd_norm.bias", weight(_N_EMBD))
    for i in range(_N_LAYER):
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"blk.{i}.{name}.weight", weight(_N_EMBD, _N_EMBD, scale=0.2))
            writer.add_tensor(f"blk.{i}.{name}.bias", weight(_N_EMBD))
        writer.add_tensor(f"blk.{i}.attn_output_norm.weight", ones(_N_EMBD))
        writer.add_tensor(f"blk.{i}.attn_output_norm.bias", weight(_N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(_N_FF, _N_EMBD, scale=0.2))
        writer.add_tensor(f"blk.{i}.ffn_up.bias", weight(_N_FF))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(_N_EMBD, _N_FF, scale=0.2))
        writer.add_tensor(f"blk.{i}.ffn_down.bias", weight(_N_EMBD))
        writer.add_tensor(f"blk.{i}.layer_output_norm.weight", ones(_N_EMBD))
        writer.add_tensor(f"blk.{i}.layer_output_norm.bias", weight(_N_EMBD))
    writer.add_tensor("cls.weight", weight(_N_EMBD, _N_EMBD, scale=0.3))
    writer.add_tensor("cls.bias", weight(_N_EMBD))
    writer.add_tensor("cls.output.weight", weight(1, _N_EMBD, scale=1.0))
    writer.add_tensor("cls.output.bias", weight(1))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(target)
    return target


#: Gemma 3's <unused0>… (ids 6…): named FIM prefix, suffix, middle, repo, separator
FIM_LAYOUTS = {
    "repo": [("fim_pre", 6), ("fim_suf", 7), ("fim_mid", 8), ("fim_rep", 9), ("fim_sep", 10)],
    "plain": [("fim_pre", 6), ("fim_suf", 7), ("fim_mid", 8)],
}


def fim_model(layout: str) -> Path:
    """The default model with FIM tokens named (``layout``), cached beside it."""
    source = default_model_path(progress=False)
    digest = hashlib.sha256(
        f"{source.stat().st_size}:{source.name}:{FIM_LAYOUTS[layout]}".encode()
    ).hexdigest()[:12]
    target = _cache_dir() / f"{source.stem}-fim-{layout}-{digest}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    tokens = [
        arg for name, token in FIM_LAYOUTS[layout] for arg in ("--special-token-by-id", name, str(token))
    ]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "gguf.scripts.gguf_new_metadata",
            str(source),
            str(partial),
            *tokens,
            "--force",
        ],
        check=True,
        capture_output=True,
    )
    partial.rename(target)
    return target


#: Gemma's turns, and a ``<think>`` block the generation prompt opens (``enable_thinking``
#: false: an empty one, as reasoning templates do)
REASONING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m.role == 'assistant' else 'user' }}\n{{ m.content }}<end_of_turn>\n{% endfor %}"
    "<start_of_turn>model\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>{% endif %}"
)


def reasoning_model() -> Path:
    """The default model with :data:`REASONING_TEMPLATE` as its chat template, cached
    beside it."""
    return _with_template(REASONING_TEMPLATE, "reasoning")


#: Gemma's turns, with the tools it is given listed in the first one (a template that
#: renders ``tools``, as tool-trained models' templates do)
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<start_of_turn>user\nTools: {{ tools | tojson }}<end_of_turn>\n{% endif %}"
    "{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m.role == 'assistant' else 'user' }}\n{{ m.content }}<end_of_turn>\n{% endfor %}"
    "<start_of_turn>model\n"
)


def tools_model() -> Path:
    """The default model with :data:`TOOLS_TEMPLATE` as its chat template, cached beside
    it: a model whose template renders tools (Ollama's ``tools`` capability)."""
    return _with_template(TOOLS_TEMPLATE, "tools")


def _with_template(template: str, label: str) -> Path:
    source = default_model_path(progress=False)
    digest = hashlib.sha256(f"{source.stat().st_size}:{source.name}:{template}".encode()).hexdigest()[:12]
    target = _cache_dir() / f"{source.stem}-{label}-{digest}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "gguf.scripts.gguf_new_metadata",
            str(source),
            str(partial),
            "--chat-template",
            template,
            "--force",
        ],
        check=True,
        capture_output=True,
    )
    partial.rename(target)
    return target
