"""The command line every scenario words alike, the configuration record, the run loop."""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .stats import finite

DEFAULT_PROMPT = "Once upon a time"
PROMPTS = ("Once upon a time", "The capital of France is", "In a distant galaxy", "The recipe begins with")
PROMPTS += ("The three laws of robotics are", "In 1969, the first", "Water boils at", "The quick brown fox")


def log(message: str) -> None:
    """Progress goes to stderr, so stdout holds only the report."""
    print(message, file=sys.stderr, flush=True)


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def prompt_list(text: str) -> list[str]:
    return [x for x in text.split("|") if x]


#: the options that scenarios share: ``parser(..., key=default)`` adds one
OPTIONS: dict[str, tuple[str, Callable[[str], Any], str]] = {
    "threads": ("--threads", int, "threads for decode and prefill, every contestant"),
    "ctx_size": ("--ctx-size", int, "context size (per sequence)"),
    "slots": ("--slots", int, "trioserve --slots (and llama-server-matched --parallel)"),
    "max_tokens": ("--max-tokens", int, "tokens per completion"),
    "reps": ("--reps", int, "measured rounds"),
    "prompt": ("--prompt", str, "prompt"),
    "prompts": ("--prompts", prompt_list, "'|'-separated prompts; stream i gets prompt i"),
    "streams": ("--streams", int_list, "concurrent stream counts"),
    "other_load_warn": ("--other-load-warn", float, "note runs where other processes used more %% of a core"),
}


def parser(doc: str | None, contestants: tuple[Sequence[str], ...] | None = None, **defaults: Any) -> Any:
    """``--model``, ``--contestants`` (all, default), the shared options named in
    ``defaults`` with those defaults, ``--json``/``--out``, ``--markdown`` and the timeouts."""
    epilog = "The method: docs/benchmarks.md, section Method."
    p = argparse.ArgumentParser(description=(doc or " ").splitlines()[0], epilog=epilog)
    p.add_argument("--model", type=Path, help="GGUF file (default: trioserve's default, Gemma 3 270M)")
    if contestants:
        every, default = contestants

        def names(text: str) -> list[str]:
            chosen = [x.strip() for x in text.split(",") if x.strip()]
            if not chosen or set(chosen) - set(every):
                raise argparse.ArgumentTypeError(f"pick from {','.join(every)}")
            return [name for name in every if name in chosen]

        help_ = f"comma-separated subset of {','.join(every)}, run in this order"
        help_ += f" (default: {','.join(default)})"
        p.add_argument("--contestants", type=names, default=list(default), help=help_)
    for key, default in defaults.items():
        (flag, kind, text), sep = OPTIONS[key], "|" if key == "prompts" else ","
        shown = sep.join(map(str, default)) if isinstance(default, list) else default
        p.add_argument(flag, type=kind, default=default, help=f"{text} (default: {shown})")
    p.add_argument("--json", "--out", dest="out", type=Path, help="write all that was measured to this JSON")
    p.add_argument("--markdown", action="store_true", help="also print every sample")
    p.add_argument("--ready-timeout", type=float, default=180.0, help="seconds a server may take to load")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds a completion may take")
    return p


def option(p: argparse.ArgumentParser, flag: str, default: Any, text: str) -> None:
    """A scenario's own option, typed by its default."""
    p.add_argument(flag, type=type(default), default=default, help=f"{text} (default: {default})")


def resolve_model(args: argparse.Namespace) -> Path:
    """``--model``, checked; without it trioserve's default model (downloaded once)."""
    if args.model is None:
        from trioserve import default_model_path

        return default_model_path(progress=False)
    model: Path = args.model.resolve()
    if not model.is_file():
        raise SystemExit(f"model file not found: {model}")
    return model


def environment(model: Path | None, **settings: Any) -> dict[str, Any]:
    """A result's configuration: the model, ``settings``, versions and machine facts."""
    from importlib.metadata import version

    import llama_cpp

    out = {"model": str(model) if model else None, **settings, "llama_cpp_python": llama_cpp.__version__}
    out |= {"trioserve": version("trioserve"), "python": platform.python_version()}
    return out | {"kernel": platform.release(), "cpu_count": os.cpu_count(), "loadavg_start": os.getloadavg()}


def pick(args: argparse.Namespace, names: str) -> dict[str, Any]:
    """The options ``names`` (space-separated) as a dict, for a result's configuration."""
    return {name: getattr(args, name) for name in names.split()}


def header(cfg: dict[str, Any], what: str) -> str:
    """The line above a report's tables."""
    model = Path(cfg["model"]).name if cfg.get("model") else "scripted backend"
    load = f"load {cfg['loadavg_start'][0]:.2f}→{cfg.get('loadavg_end', cfg['loadavg_start'])[0]:.2f}"
    return f"{model}, {what}; llama-cpp-python {cfg['llama_cpp_python']}, {cfg['cpu_count']} CPUs, {load}\n"


def _sigterm(_signo: int, _frame: object) -> None:
    raise SystemExit(143)  # unwind through the finally blocks: the servers get stopped


def main(parse: Callable[[], Any], run: Callable[[Any], dict[str, Any]], report: Callable[..., None]) -> int:
    """Parse, ``run``, write the result to ``--json``, print the ``report`` and the
    result's ``notes``; exits 1 when the result has ``problems``. SIGTERM exits like
    Ctrl-C, through the ``finally`` blocks that stop the servers."""
    signal.signal(signal.SIGTERM, _sigterm)
    args, started = parse(), time.perf_counter()
    result = run(args)
    result["config"].setdefault("loadavg_end", os.getloadavg())
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(finite(result), indent=2) + "\n")
        log(f"wrote {args.out}")
    report(result, args)
    for note in result.get("notes", []):
        print(f"\nnote: {note}")
    log(f"done in {time.perf_counter() - started:.0f} s")
    return 1 if result.get("problems") else 0
