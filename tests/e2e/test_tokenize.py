"""``GET /v1/models/{id}``, ``POST /tokenize`` and ``POST /detokenize``: a real hypercorn
server on 127.0.0.1, the real default model (Gemma 3 270M), real clients (httpx, the
openai SDK); the tokenizer endpoints also against llama.cpp's own llama-server on the
same model, body for body."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import trio

from benchmarks.harness.servers import LLAMA_SERVER, Server, free_port
from trioserve import Backend, HTTPSettings, LlamaBackend, ScriptedBackend, default_model_path

from .._helpers import RunningServer, llama_server_command, start_server

pytestmark = pytest.mark.model

#: a second name for the model, with a slash, as ``--model-id org/name`` or an upstream gives
ALIAS = "google/gemma-3-270m"
N_VOCAB = 262144  # Gemma 3
BOS, START_OF_TURN = 2, 105
#: texts with every kind of piece: words, special tokens, characters that the
#: vocabulary holds only as UTF-8 byte tokens (pieces that are not valid UTF-8 alone)
TEXTS = [
    "Hello world",
    "<start_of_turn>user\nWhat is 2 + 2?<end_of_turn>\n<start_of_turn>model\n",
    "á 𝔘 ꙮ ᚠ 𓀀 — “quotes” ¿qué? 日本語",
    "  leading and trailing spaces  ",
    "",
]


@pytest.fixture
async def server(llama_backend: LlamaBackend, nursery: trio.Nursery) -> Any:
    running = await start_server(nursery, llama_backend, http=HTTPSettings(model_aliases=(ALIAS,)))
    yield running
    running.server.shutdown()


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def _piece_bytes(piece: str | list[int]) -> bytes:
    return piece.encode() if isinstance(piece, str) else bytes(piece)


# ------------------------------------------------------------------ GET /v1/models/{id}


async def test_a_model_by_id_is_its_entry_in_the_list(server: RunningServer) -> None:
    async with server.client() as client:
        listed = (await client.get("/v1/models")).json()["data"]
        assert [m["id"] for m in listed] == ["gemma-3-270m-q4_k_m", ALIAS]
        for entry in listed:
            response = await client.get(f"/v1/models/{entry['id']}")  # the alias: a slash in the path
            assert response.status_code == 200, response.text
            model = response.json()
            assert set(model) == {
                "id",
                "object",
                "created",
                "owned_by",
                "context_length",
                "max_model_len",
                "status",
                "capabilities",
                "input_modalities",
            }
            assert model["capabilities"] == {
                "completion": True,
                "chat": True,
                "infill": False,
                "embeddings": True,
                "rerank": None,
                "vision": False,
                "audio": False,
            }
            assert model["input_modalities"] == ["text"]
            assert model["context_length"] == model["max_model_len"] > 0
            assert model["status"]["state"] == "loaded"
            assert {**model, "created": 0} == {**entry, "created": 0}
            assert isinstance(model["created"], int)
            assert abs(model["created"] - entry["created"]) <= 2

    def retrieve(model_id: str) -> openai.types.Model:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as sdk:
            return sdk.models.retrieve(model_id)

    for entry in listed:
        model = await trio.to_thread.run_sync(retrieve, entry["id"])
        assert (model.id, model.object, model.owned_by) == (entry["id"], "model", "trioserve")


async def test_an_unknown_model_id_is_a_404_naming_the_available_ids(server: RunningServer) -> None:
    async with server.client() as client:
        for unknown in ("gpt-4o", "google/gemma-3-270m/extra", "gemma-3-270m-q4_k_m/"):
            error = _error(await client.get(f"/v1/models/{unknown}"), 404)
            assert error["code"] == "model_not_found"
            assert error["type"] == "invalid_request_error"
            assert error["param"] == "model"
            assert repr(unknown) in error["message"]
            assert "available: gemma-3-270m-q4_k_m, google/gemma-3-270m" in error["message"]

    def retrieve() -> None:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as sdk:
            sdk.models.retrieve("gpt-4o")

    with pytest.raises(openai.NotFoundError) as caught:
        await trio.to_thread.run_sync(retrieve)
    assert caught.value.code == "model_not_found"


# ------------------------------------------------------------------ /tokenize, /detokenize


async def test_tokenize_and_its_options_on_the_default_model(server: RunningServer) -> None:
    async with server.client() as client:

        async def tokenize(**body: object) -> list[Any]:
            response = await client.post("/tokenize", json=body)
            assert response.status_code == 200, response.text
            assert response.headers["content-type"] == "application/json"
            assert set(response.json()) == {"tokens"}
            tokens: list[Any] = response.json()["tokens"]
            return tokens

        hello = await tokenize(content="Hello world")
        assert hello == [9259, 1902]
        assert await tokenize(content="Hello world", add_special=True) == [BOS, *hello]  # BOS only
        assert await tokenize(content="Hello world", with_pieces=True) == [
            {"id": 9259, "piece": "Hello"},
            {"id": 1902, "piece": " world"},
        ]
        assert await tokenize(content="") == []
        assert await tokenize(content="", add_special=True) == [BOS]

        # parse_special (default true): a special token written in the text is one token
        turn = "<start_of_turn>user"
        special = await tokenize(content=turn, with_pieces=True)
        assert special[0] == {"id": START_OF_TURN, "piece": "<start_of_turn>"}
        assert len(special) == 2
        plain = await tokenize(content=turn, parse_special=False)
        assert START_OF_TURN not in plain
        assert len(plain) > 2

        # pieces that are not UTF-8 on their own come as byte values; all of them
        # together are the text's bytes
        for text in TEXTS:
            pieces = await tokenize(content=text, with_pieces=True)
            assert [p["id"] for p in pieces] == await tokenize(content=text)
            assert b"".join(_piece_bytes(p["piece"]) for p in pieces) == text.encode()
        rare = await tokenize(content="𝔘", with_pieces=True)
        assert all(isinstance(p["piece"], list) for p in rare)
        assert b"".join(bytes(p["piece"]) for p in rare) == "𝔘".encode()

        # the same tokenizer as generation: a completion's prompt_tokens
        completion = await client.post("/v1/completions", json={"prompt": TEXTS[1], "max_tokens": 1})
        usage = completion.json()["usage"]
        assert usage["prompt_tokens"] == len(await tokenize(content=TEXTS[1], add_special=True))


async def test_detokenize_inverts_tokenize(server: RunningServer) -> None:
    async with server.client() as client:

        async def detokenize(tokens: list[int]) -> str:
            response = await client.post("/detokenize", json={"tokens": tokens})
            assert response.status_code == 200, response.text
            assert set(response.json()) == {"content"}
            content: str = response.json()["content"]
            return content

        for text in TEXTS:
            tokens = (await client.post("/tokenize", json={"content": text})).json()["tokens"]
            assert await detokenize(tokens) == text
        assert await detokenize([]) == ""
        # special tokens are rendered as their text, as llama-server does
        assert await detokenize([BOS, START_OF_TURN, 9259]) == "<bos><start_of_turn>Hello"
        # ids that end inside a character: U+FFFD for the bytes that are not UTF-8
        first = (await client.post("/tokenize", json={"content": "𝔘"})).json()["tokens"][:2]
        assert await detokenize(first) == "\ufffd"
        assert await detokenize([N_VOCAB - 1]) == "<unused6241>"


async def test_long_texts_and_long_token_lists(server: RunningServer) -> None:
    """Past 4096 characters (1024 ids) the work goes to a worker thread; same answers."""
    words = " ".join(f"w{i % 97}ord" for i in range(3000))  # ~21,000 characters
    assert len(words) > 4096
    async with server.client() as client:
        tokens = (await client.post("/tokenize", json={"content": words})).json()["tokens"]
        assert len(tokens) > 1024
        short = (await client.post("/tokenize", json={"content": words[:2000]})).json()["tokens"]
        assert tokens[: len(short) - 2] == short[:-2]  # (the cut may split the last word)
        pieces = (await client.post("/tokenize", json={"content": words, "with_pieces": True})).json()
        assert [p["id"] for p in pieces["tokens"]] == tokens
        back = await client.post("/detokenize", json={"tokens": tokens})
        assert back.json() == {"content": words}
        # the event loop stayed free: /health answers while a long one runs
        big = "lorem ipsum " * 300_000  # 3.6 MB: well under the 4 MiB body limit
        async with trio.open_nursery() as nursery:
            done = trio.Event()

            async def long_tokenize() -> None:
                response = await client.post("/tokenize", json={"content": big})
                assert response.status_code == 200
                done.set()

            nursery.start_soon(long_tokenize)
            answered = 0
            while not done.is_set():
                assert (await client.get("/health")).status_code == 200
                answered += 1
                await trio.sleep(0.01)
        assert answered > 1


# (body or raw kwargs, status, code, param, a fragment of the message)
BAD: list[tuple[str, str, dict[str, Any], int, str | None, str | None, str]] = [
    (
        "/tokenize",
        "not JSON",
        {"content": b"{content: hi", "headers": {"content-type": "application/json"}},
        400,
        None,
        None,
        "not valid JSON",
    ),
    ("/tokenize", "not an object", {"json": ["hi"]}, 400, None, None, "must be a JSON object"),
    (
        "/tokenize",
        "no content",
        {"json": {"text": "hi"}},
        400,
        None,
        None,
        "missing required field `content`",
    ),
    (
        "/tokenize",
        "content a number",
        {"json": {"content": 42}},
        400,
        None,
        "content",
        "Expected `str`, got `int`",
    ),
    (
        "/tokenize",
        "a flag a string",
        {"json": {"content": "hi", "add_special": "yes"}},
        400,
        None,
        "add_special",
        "Expected `bool`, got `str`",
    ),
    (
        "/tokenize",
        "wrong Content-Type",
        {"content": b'{"content": "hi"}', "headers": {"content-type": "text/plain"}},
        415,
        "unsupported_media_type",
        None,
        "Content-Type must be application/json",
    ),
    (
        "/detokenize",
        "no tokens",
        {"json": {"content": "hi"}},
        400,
        None,
        None,
        "missing required field `tokens`",
    ),
    (
        "/detokenize",
        "tokens a string",
        {"json": {"tokens": "9259"}},
        400,
        None,
        "tokens",
        "Expected `array`, got `str`",
    ),
    (
        "/detokenize",
        "a token id a string",
        {"json": {"tokens": [9259, "1902"]}},
        400,
        None,
        "tokens[1]",
        "Expected `int`, got `str`",
    ),
    (
        "/detokenize",
        "a negative id",
        {"json": {"tokens": [9259, -1]}},
        400,
        None,
        "tokens[1]",
        "Expected `int` >= 0",
    ),
    (
        "/detokenize",
        "an id past the vocabulary",
        {"json": {"tokens": [9259, N_VOCAB]}},
        400,
        None,
        "tokens[1]",
        f"tokens[1] is {N_VOCAB}, which is not a token id of this model: its ids are 0 to {N_VOCAB - 1}",
    ),
]


@pytest.mark.parametrize("row", BAD, ids=[f"{row[0]}: {row[1]}" for row in BAD])
async def test_bad_input_is_a_400_that_names_the_field(server: RunningServer, row: Any) -> None:
    path, _name, kwargs, status, code, param, fragment = row
    async with server.client() as client:
        error = _error(await client.post(path, **kwargs), status)
        assert error["code"] == code
        assert error["param"] == param
        assert error["type"] == "invalid_request_error"
        assert fragment in error["message"], error["message"]
        assert (await client.get("/health")).status_code == 200  # and nothing broke
        assert (await client.post("/tokenize", json={"content": "Hello world"})).json() == {
            "tokens": [9259, 1902]
        }


async def test_wrong_method_and_a_backend_without_a_tokenizer(
    server: RunningServer, nursery: trio.Nursery
) -> None:
    async with server.client() as client:
        for path in ("/tokenize", "/detokenize"):
            error = _error(await client.get(path), 405)
            assert error["code"] == "method_not_allowed"

    class NoTokenizer(ScriptedBackend):
        tokenize_text = Backend.tokenize_text
        token_pieces = Backend.token_pieces

    bare = await start_server(nursery, NoTokenizer(), close_backend=True)
    async with bare.client() as client:
        for path, body in (("/tokenize", {"content": "hi"}), ("/detokenize", {"tokens": [1]})):
            error = _error(await client.post(path, json=body), 501)
            assert error == {
                "message": "this server's backend (NoTokenizer) has no tokenizer",
                "type": "not_supported_error",
                "param": None,
                "code": "no_tokenizer",
            }
    bare.server.shutdown()


async def test_the_tokenizer_endpoints_need_the_key_when_one_is_set(
    llama_backend: LlamaBackend, nursery: trio.Nursery
) -> None:
    keyed = await start_server(nursery, llama_backend, api_keys=("sk-tokenize-1",))
    model_path = f"/v1/models/{llama_backend.info.id}"
    async with keyed.client() as client:
        for method, path, body in (
            ("POST", "/tokenize", {"content": "hi"}),
            ("POST", "/detokenize", {"tokens": [9259]}),
            ("GET", model_path, None),
        ):
            for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
                error = _error(await client.request(method, path, json=body, headers=headers), 401)
                assert error["code"] == "invalid_api_key"
            good = {"Authorization": "Bearer sk-tokenize-1"}
            assert (await client.request(method, path, json=body, headers=good)).status_code == 200
    keyed.server.shutdown()


# ------------------------------------------------------------------ against llama-server


@pytest.fixture(scope="module")
def llama_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """llama.cpp's C++ llama-server on the default model (its tokenizer is all we ask)."""
    port = free_port()
    argv = llama_server_command(default_model_path(progress=False), port, ["--ctx-size", "512"])
    upstream = Server(LLAMA_SERVER, argv, port, tmp_path_factory.mktemp("llama-server"))
    try:
        upstream.wait_ready(120)
        yield upstream.url
    finally:
        upstream.stop()


async def test_the_same_answers_as_llama_server(server: RunningServer, llama_server_url: str) -> None:
    bodies: list[dict[str, object]] = []
    for text in TEXTS:
        bodies.append({"content": text})
        bodies.append({"content": text, "add_special": True, "with_pieces": True})
        bodies.append({"content": text, "parse_special": False, "with_pieces": True})
        bodies.append({"content": text, "add_special": True, "parse_special": False})
    async with server.client() as ours, httpx.AsyncClient(base_url=llama_server_url, timeout=60) as theirs:
        token_lists: list[list[int]] = [[], [BOS, START_OF_TURN, 106, N_VOCAB - 1], [478, 395]]
        for body in bodies:
            mine, reference = (
                await ours.post("/tokenize", json=body),
                await theirs.post("/tokenize", json=body),
            )
            assert mine.status_code == reference.status_code == 200
            assert mine.json() == reference.json(), body
            if not body.get("with_pieces"):
                token_lists.append(reference.json()["tokens"])
        for tokens in token_lists:
            body = {"tokens": tokens}
            mine, reference = (
                await ours.post("/detokenize", json=body),
                await theirs.post("/detokenize", json=body),
            )
            assert mine.status_code == reference.status_code == 200
            assert mine.json() == reference.json(), tokens


# ------------------------------------------------------------------ large bodies

#: insignificant whitespace that puts a body over the 64 KiB at which it is decoded,
#: rendered and counted in a worker thread
_PADDING = b" " * (70 * 1024)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/messages/count_tokens",
            {"model": ALIAS, "system": "Be brief.", "messages": [{"role": "user", "content": TEXTS[2]}]},
        ),
        ("/v1/responses/input_tokens", {"model": ALIAS, "instructions": "Be brief.", "input": TEXTS[1]}),
    ],
)
async def test_a_large_count_tokens_body_counts_what_the_small_one_counts(
    server: RunningServer, path: str, body: dict[str, Any]
) -> None:
    """The same request, once small (counted on the event loop) and once padded over
    64 KiB (decoded, rendered and tokenized in a worker thread): the same count; and a
    long conversation is counted too."""
    import json

    small = json.dumps(body).encode()
    padded = small[:1] + _PADDING + small[1:]
    headers = {"Content-Type": "application/json"}
    long_text = " ".join(TEXTS[:4]) * 400  # ~40 KB of text: ≥ 64 KiB with the rest
    if path.startswith("/v1/messages"):
        long_body = {**body, "messages": [{"role": "user", "content": long_text}] * 2}
    else:
        long_body = {**body, "input": [{"role": "user", "content": long_text}] * 2}
    async with server.client() as client:
        counted_small = await client.post(path, content=small, headers=headers)
        counted_padded = await client.post(path, content=padded, headers=headers)
        counted_long = await client.post(path, json=long_body)
    assert counted_small.status_code == 200, counted_small.text
    assert counted_padded.status_code == 200, counted_padded.text
    assert counted_padded.json()["input_tokens"] == counted_small.json()["input_tokens"] > 0
    assert counted_long.status_code == 200, counted_long.text
    assert len(json.dumps(long_body)) > 64 * 1024
    assert counted_long.json()["input_tokens"] > 2 * 400 * 4


async def test_a_large_tokenize_answer_equals_the_tokenizers(
    server: RunningServer, llama_backend: LlamaBackend
) -> None:
    """/tokenize and /detokenize of tens of thousands of tokens (answers encoded in a
    worker thread): the tokenizer's own ids, and the text back."""
    text = " ".join(TEXTS[:3]) * 1000
    expected = llama_backend.tokenize(text, add_bos=False, parse_special=True)
    assert len(expected) > 16 * 1024
    async with server.client() as client:
        tokens = (await client.post("/tokenize", json={"content": text})).json()["tokens"]
        content = (await client.post("/detokenize", json={"tokens": tokens})).json()["content"]
    assert tokens == expected
    assert content == text


@pytest.mark.parametrize("add_special", [True, False])
async def test_counting_tokens_gives_the_length_of_the_token_list(
    llama_backend: LlamaBackend, add_special: bool
) -> None:
    """Token counting (count_tokens, input_tokens) counts without building the list; the
    count is the list's length, long texts (a worker thread) and specials included."""
    for text in ("", "hello world", "<start_of_turn>user\nhi<end_of_turn>\n" * 400):
        tokens = await llama_backend.tokenize_text(text, add_special=add_special)
        assert await llama_backend.count_text_tokens(text, add_special=add_special) == len(tokens)
