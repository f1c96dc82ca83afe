"""``trioserve serve``'s text-to-speech flags (``--tts-model``, ``--tts-mmproj``,
``--tts-model-id``, ``--tts-threads``): the speaking pair ``POST /v1/audio/speech``
serves, and how it is loaded (docs/audio.md, "Speech")."""

from __future__ import annotations

import argparse
import functools
import os
from pathlib import Path

from .._http._speech_service import SpeechModel, SpeechSource
from ._flag_types import positive_int

__all__ = ["add_speech_flags", "speech_source"]


def add_speech_flags(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("text to speech (POST /v1/audio/speech; docs/audio.md, 'Speech')")
    group.add_argument(
        "--tts-model",
        default=None,
        metavar="FILE",
        help="a speaking model's backbone GGUF (PocketTTS, as llama.cpp converts it), with "
        "--tts-mmproj: POST /v1/audio/speech speaks with it (without: 400 speech_not_supported)",
    )
    group.add_argument(
        "--tts-mmproj",
        default=None,
        metavar="FILE",
        help="the speaking model's mmproj (its voice encoder and audio generator), with --tts-model",
    )
    group.add_argument(
        "--tts-model-id",
        default=None,
        metavar="NAME",
        help="the speech model's name, the `model` a request gives (default: --tts-model's file "
        "name without .gguf)",
    )
    group.add_argument(
        "--tts-threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="CPU threads of a speech generation (default: --threads, else all cores)",
    )


def _load(model: Path, mmproj: Path, threads: int) -> SpeechModel:
    from .._backends._media import SpeechEngine

    return SpeechEngine(model, mmproj, threads=threads)


def speech_source(args: argparse.Namespace) -> SpeechSource | None:
    """The speech model the flags name (``None``: none); a missing file or a lone flag
    is a :class:`RuntimeError` (the command exits 2 before listening)."""
    if args.tts_model is None and args.tts_mmproj is None:
        if args.tts_model_id is not None or args.tts_threads is not None:
            raise RuntimeError("--tts-model-id and --tts-threads need --tts-model and --tts-mmproj")
        return None
    if args.tts_model is None or args.tts_mmproj is None:
        given, missing = ("--tts-model", "--tts-mmproj")
        if args.tts_model is None:
            given, missing = missing, given
        raise RuntimeError(
            f"{given} needs {missing}: a speaking model is two files (docs/audio.md, 'Speech')"
        )
    model, mmproj = Path(args.tts_model), Path(args.tts_mmproj)
    for flag, path in (("--tts-model", model), ("--tts-mmproj", mmproj)):
        if not path.is_file():
            raise RuntimeError(f"{flag}: file not found: {path}")
    threads = args.tts_threads or args.threads or os.cpu_count() or 1
    name = args.tts_model_id or model.name.removesuffix(".gguf")
    return SpeechSource(
        name, functools.partial(_load, model, mmproj, threads), description=f"speech model {model} + {mmproj}"
    )
