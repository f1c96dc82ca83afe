"""Model names as Ollama's clients send them (``name:tag``; a name without a tag is
``name:latest``) and list them (docs/dialects.md, "Ollama"): shared by the Ollama
generation routes and the model routes so that both read a name the same way."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["LATEST", "ollama_listed_name", "ollama_model_name"]

LATEST = ":latest"


def ollama_model_name(name: str, known: Callable[[str], bool]) -> str:
    """The served name an Ollama client's ``name`` means: the name itself when it is
    served (an alias may hold a tag), else the name without ``:latest``. Any other tag
    of an unknown name is left as it is, to be refused as an unknown model."""
    if known(name) or not name.endswith(LATEST):
        return name
    return name.removesuffix(LATEST)


def ollama_listed_name(name: str) -> str:
    """How a served model is listed to Ollama's clients: with its tag (``:latest`` when
    its name has none), as ``ollama list`` shows it."""
    return name if ":" in name else name + LATEST
