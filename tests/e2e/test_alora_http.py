"""Activated LoRA over HTTP (docs/lora.md, "Activated LoRA"): an aLoRA given with
``--lora`` turns on from its invocation tokens, as llama-server's does on the same file
(the same greedy text, with the invocation in the prompt and without it); the prompt
before it is the base model's — evaluated once for the base and every aLoRA on the
same prompt — and nothing an aLoRA computed past it serves anyone else."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from benchmarks.harness.servers import LLAMA_SERVER, Server, free_port
from trioserve import default_model_path

from .._greedy import Step, assert_same_greedy_text, steps
from .._helpers import ServerProcess, llama_server_command
from .._lora import tiny_lora

pytestmark = pytest.mark.model

#: ``<start_of_turn>model\n``: the invocation of the test aLoRAs (a chat prompt's end)
INVOKE = (105, 4368, 107)
INVOCATION = "<start_of_turn>model\n"
PROMPT = "".join(f"In year {1300 + 11 * i} the port town kept ledger {i} of its trade.\n" for i in range(12))
#: ~1,000 tokens
LONG = "".join(f"In year {1200 + 7 * i} the river town built bridge {i} of stone.\n" for i in range(70))
BAN = {"logit_bias": {"1": -100, "106": -100}}  # (every answer max_tokens long)


def _aloras() -> tuple[Any, Any]:
    # (the plain test LoRAs' strength. Stronger random adapters make the two servers'
    # greedy texts part — plain LoRAs as much as aLoRAs: with amplitude 0.06 or 0.08,
    # 6 of 8 and 4 of 4 texts on these prompts differ — where the two servers' different
    # call widths move a log-probability by ~0.1 nat, as they do on the base model, and
    # a stronger adapter makes closer calls; docs/lora.md)
    return tiny_lora(3, invocation=INVOKE), tiny_lora(5, invocation=INVOKE)


@pytest.fixture(scope="module")
def ours() -> Iterator[str]:
    al, al2 = _aloras()
    with ServerProcess(
        "--threads", "2", "--slots", "2", "--lora", f"al={al}", "--lora", f"al2={al2}"
    ) as server:
        yield server.wait_ready()


@pytest.fixture(scope="module")
def fresh() -> Iterator[str]:
    """The same server with the prompt cache off: every prompt evaluated whole."""
    al, al2 = _aloras()
    with ServerProcess(
        "--threads", "2", "--slots", "1", "--no-prompt-cache", "--lora", f"al={al}", "--lora", f"al2={al2}"
    ) as server:
        yield server.wait_ready()


@pytest.fixture(scope="module")
def theirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    al, al2 = _aloras()
    extra = ["--parallel", "1", "--lora", str(al), "--lora", str(al2)]
    argv = llama_server_command(default_model_path(progress=False), port, extra)
    server = Server(LLAMA_SERVER, argv, port, tmp_path_factory.mktemp("llama-server-alora"))
    try:
        server.wait_ready(120)
        yield server.url
    finally:
        server.stop()


def _complete(url: str, prompt: str, **fields: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, **BAN, **fields}
    answer = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def _text(url: str, prompt: str, **fields: Any) -> str:
    return str(_complete(url, prompt, **fields)["choices"][0]["text"])


def _steps(url: str, prompt: str, **fields: Any) -> list[Step]:
    """A greedy completion's tokens with their two best candidates each."""
    return steps(_complete(url, prompt, logprobs=2, **fields)["choices"][0]["logprobs"])


def _evaluated(answer: dict[str, Any]) -> tuple[int, int]:
    """``(prompt tokens, of those evaluated)`` of an answer's usage."""
    usage = answer["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return usage["prompt_tokens"], usage["prompt_tokens"] - cached


def test_it_is_listed_with_its_invocation_as_llama_server_lists_it(ours: str, theirs: str) -> None:
    mine = httpx.get(ours + "/lora-adapters").json()[0]
    reference = httpx.get(theirs + "/lora-adapters").json()[0]
    assert mine["alora_invocation_tokens"] == reference["alora_invocation_tokens"] == list(INVOKE)
    assert mine["alora_invocation_string"] == reference["alora_invocation_string"] == INVOCATION
    models = {m["id"]: m for m in httpx.get(ours + "/v1/models").json()["data"]}
    assert models["al"]["alora_invocation_tokens"] == list(INVOKE)


def test_an_alora_gives_llama_servers_text_with_its_invocation_in_the_prompt_and_without(
    ours: str, theirs: str
) -> None:
    off = [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]
    # (llama-server: its prompt cache off, so each answer is a fresh evaluation)
    cases = {
        "at the end": PROMPT + INVOCATION,
        "mid-prompt": PROMPT + INVOCATION + "The ledgers say",
        "twice (the last counts)": INVOCATION + PROMPT + INVOCATION + "In short,",
    }
    for i, name in enumerate(("al", "al2")):
        on = [{"id": j, "scale": 1.0 if j == i else 0.0} for j in range(2)]
        for case, prompt in cases.items():
            text = _text(ours, prompt, model=name)
            # llama-server's text, as far as two programs' numbers allow (tests/_greedy.py:
            # on an AVX-512 Xeon one of these texts parts at a digit, "1420" / "1422")
            theirs_steps = _steps(theirs, prompt, lora=on, cache_prompt=False)
            assert_same_greedy_text((name, case), _steps(ours, prompt, model=name), theirs_steps)
            assert text != _text(ours, prompt), (name, case)  # (the adapter turned on: not the base's)
            assert text == _text(ours, prompt, model=name), (name, case)  # (again, from the cache)
        # without its invocation: the request runs without the adapter, as llama-server's
        text = _text(ours, PROMPT, model=name)
        assert _text(theirs, PROMPT, lora=on, cache_prompt=False) == _text(theirs, PROMPT, lora=off), name
        theirs_steps = _steps(theirs, PROMPT, lora=on, cache_prompt=False)
        assert_same_greedy_text((name, "no invocation"), _steps(ours, PROMPT, model=name), theirs_steps)
        assert text == _text(ours, PROMPT), name


def test_two_aloras_in_one_request_are_refused_as_llama_server_refuses_them(ours: str) -> None:
    answer = httpx.post(
        ours + "/v1/completions",
        json={"prompt": PROMPT + INVOCATION, "lora": [{"id": 0, "scale": 1}, {"id": 1, "scale": 1}]},
    )
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == "Cannot run multiple aLoRAs in a single request"
    assert answer.json()["error"]["param"] == "lora"


def test_the_base_prefix_is_evaluated_once_for_the_base_and_every_alora(ours: str, fresh: str) -> None:
    # a ~1,000-token prompt for the base, then with the invocation for each aLoRA: each
    # aLoRA evaluates only its last piece before the switch (llama-server's: the token
    # before the invocation) and on — the base's cells serve the rest — and its text
    # is a cache-off server's
    base = _complete(ours, LONG)
    total, evaluated = _evaluated(base)
    assert total > 900
    assert evaluated > 900  # (the first: all of it)
    for name in ("al", "al2"):
        answer = _complete(ours, LONG + INVOCATION, model=name)
        total, evaluated = _evaluated(answer)
        # (the invocation, the token before it and at most the rest of the canonical
        # piece that holds that one: 128 tokens at most, 512 past 1,024 tokens, where
        # pieces are deep ones: docs/prompt-cache.md, "Deep pieces")
        longest = 512 if total - len(INVOKE) > 1024 else 128
        assert evaluated <= 3 + longest, (name, total, evaluated)
        if name == "al2":  # (switched where al was: al's cells serve it up to the switch itself)
            assert evaluated == 1 + len(INVOKE), (total, evaluated)
        assert answer["choices"][0]["text"] == _text(fresh, LONG + INVOCATION, model=name), name
    # and the base prompt again: all of it from the cache, the aLoRAs changed nothing
    again = _complete(ours, LONG)
    assert again["choices"][0]["text"] == base["choices"][0]["text"]
    total, evaluated = _evaluated(again)
    assert evaluated <= (512 if total > 1024 else 128)  # (its last piece: it ends on no cut)


def test_an_aloras_cells_past_its_switch_serve_no_base_request_nor_another_alora(
    ours: str, fresh: str
) -> None:
    # an aLoRA's cells, then a longer prompt (its cells past the switch would match it)
    # for the base, and for the other aLoRA switched at the same place: each the text of
    # a cache-off server, reusing nothing past the switch — the cells the aLoRA computed
    # with its adapter would give the others its text (llama.cpp #26207)
    prompt = LONG.replace("river", "hill") + INVOCATION
    longer = prompt + "The"
    for first, fields, text_prompt in (
        ("al", {}, longer),
        ("al", {"model": "al2"}, longer),
    ):
        before = _complete(ours, prompt, model=first)
        assert before["choices"][0]["text"] == _text(fresh, prompt, model=first), first
        total, _ = _evaluated(before)
        switch = total - len(INVOKE) - 1  # (llama-server's: the token before the invocation)
        answer = _complete(ours, text_prompt, **fields)
        assert answer["choices"][0]["text"] == _text(fresh, text_prompt, **fields), (first, fields)
        reused = _evaluated(answer)[0] - _evaluated(answer)[1]
        assert reused <= switch, (first, fields, reused, switch)


def test_an_alora_loaded_at_run_time_is_listed_and_turns_on_as_one_given_at_start(ours: str) -> None:
    al, _ = _aloras()
    loaded = httpx.post(ours + "/v1/load_lora_adapter", json={"lora_name": "hot", "lora_path": str(al)})
    assert loaded.status_code == 200, loaded.text
    try:
        listed = {a["name"]: a for a in httpx.get(ours + "/lora-adapters").json()}
        assert listed["hot"]["alora_invocation_tokens"] == list(INVOKE)
        prompt = PROMPT + INVOCATION + "Hot:"
        assert _text(ours, prompt, model="hot") == _text(ours, prompt, model="al")
    finally:
        gone = httpx.post(ours + "/v1/unload_lora_adapter", json={"lora_name": "hot"})
        assert gone.status_code == 200, gone.text
