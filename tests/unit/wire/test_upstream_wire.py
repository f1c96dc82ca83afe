"""What trioserve says to an upstream and reads back: tables, no I/O."""

from __future__ import annotations

import pytest

from trioserve._core._types import GenerationRequest, Infill, LineLimits, SamplingParams
from trioserve._wire._upstream import (
    CompletionEvent,
    NotJSON,
    base_url,
    completion_event,
    completion_payload,
    decode_rerank,
    error_fields,
    infill_event,
    infill_payload,
    models_answer,
    props_answer,
    rerank_payload,
)


@pytest.mark.parametrize(
    ("given", "base"),
    [
        ("http://h:1/v1/", "http://h:1"),
        (" h:1 ", "http://h:1"),
        ("https://h/v1", "https://h"),
    ],
)
def test_base_url(given: str, base: str) -> None:
    assert base_url(given) == base


def test_the_payload_sends_only_what_was_asked_for() -> None:
    request = GenerationRequest(prompt="<s>hi", max_tokens=5, add_bos=False, stop=("a", "b", "c", "d", "e"))
    assert completion_payload(request, bos_token="<s>", extra_body={"repeat_penalty": 1.0}) == {
        "prompt": "hi",
        "max_tokens": 5,
        "temperature": request.sampling.temperature,
        "top_p": request.sampling.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
        "stop": ["a", "b", "c", "d"],
        "repeat_penalty": 1.0,
    }


def test_the_payload_forwards_penalties_seed_and_bias() -> None:
    sampling = SamplingParams(seed=3, top_k=40, repeat_penalty=1.2, repeat_last_n=32, logit_bias={7: -1.0})
    payload = completion_payload(
        GenerationRequest(prompt="<s>hi", sampling=sampling), bos_token="<s>", extra_body={}
    )
    assert payload["prompt"] == "<s>hi"  # add_bos: the upstream adds none, the text keeps its own
    assert (payload["seed"], payload["top_k"], payload["repeat_penalty"], payload["repeat_last_n"]) == (
        3,
        40,
        1.2,
        32,
    )
    assert payload["logit_bias"] == {"7": -1.0}
    assert "min_p" not in payload


@pytest.mark.parametrize(
    ("data", "event"),
    [
        ('{"choices": [{"index": 0, "text": "a"}]}', CompletionEvent(texts=("a",))),
        ('{"choices": [{"index": 1, "text": "a", "finish_reason": "stop"}]}', CompletionEvent()),
        (
            '{"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}',
            CompletionEvent(finish_reason="stop"),
        ),
        (
            '{"choices": [{"text": "", "finish_reason": "length"}],'
            ' "trioserve": {"end_cause": "deadline", "message": "late"}}',
            CompletionEvent(finish_reason="deadline", message="late", has_extension=True),
        ),
        (
            '{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}',
            CompletionEvent(usage=(3, 4)),
        ),
        ('{"error": {"message": "boom"}}', CompletionEvent(error="boom")),
        ('{"error": "plain"}', CompletionEvent(error="plain")),
        ("[1, 2]", CompletionEvent()),
    ],
)
def test_completion_events(data: str, event: CompletionEvent) -> None:
    assert completion_event(data) == event


def test_an_event_that_is_not_json() -> None:
    with pytest.raises(NotJSON):
        completion_event("{nope")


@pytest.mark.parametrize(
    ("body", "fields"),
    [
        (b'{"error": {"message": "m", "param": "p", "code": "c"}}', ("m", "p", "c")),
        (b'{"error": {"message": "m", "code": 400}}', ("m", None, None)),
        (b'{"error": "s"}', ("s", None, None)),
        (b'{"message": "vllm"}', ("vllm", None, None)),
        (b'{"detail": "fastapi"}', ("fastapi", None, None)),
        (b'{"detail": [{"loc": ["body", "messages", 0], "msg": "bad"}]}', ("bad", "messages.0", None)),
        (b"plain text", ("plain text", None, None)),
        (b"", ("HTTP 502", None, None)),
    ],
)
def test_error_fields(body: bytes, fields: tuple[str, str | None, str | None]) -> None:
    assert error_fields(body, 502) == fields


def test_a_model_description_from_models_and_props() -> None:
    assert models_answer({"data": []}) == "GET /v1/models listed no model"
    description = models_answer({"data": [{"id": "m", "max_model_len": 512}]})
    assert not isinstance(description, str)
    assert (description.id, description.context_length) == ("m", 512)
    description = models_answer({"data": [{"id": "m"}]})
    assert not isinstance(description, str)
    props_answer(
        description,
        {"default_generation_settings": {"n_ctx": 2048}, "chat_template": "{{x}}", "bos_token": "<s>"},
    )
    assert (description.context_length, description.chat_template, description.bos_token) == (
        2048,
        "{{x}}",
        "<s>",
    )
    assert description.request_fields == {"return_progress": True}


def test_a_trioserve_upstream_s_props_give_its_context_and_no_llama_server_fields() -> None:
    """trioserve answers /props in llama-server's shape too (its build_info says whose):
    its context and template are read, llama-server's return_progress is not sent."""
    description = models_answer({"data": [{"id": "m", "context_length": None, "max_model_len": None}]})
    assert not isinstance(description, str)
    props = {
        "default_generation_settings": {"n_ctx": 4096},
        "build_info": "trioserve 0.1",
        "eos_token": "<eos>",
    }
    props_answer(description, props)
    assert (description.context_length, description.eos_token) == (4096, "<eos>")
    assert description.request_fields is None


# ------------------------------------------------------------------- /infill


def test_the_infill_payload_is_llama_servers_own() -> None:
    """Its own fields: the parts as given (token ids kept), the sampling whole, the
    line rules in ms, the penalties only when asked for."""
    request = GenerationRequest(
        prompt="ret",
        max_tokens=None,
        sampling=SamplingParams(
            temperature=0.0, top_k=40, top_p=0.95, min_p=0.05, seed=7, samplers=("top_k", "temperature")
        ),
        stop=("\n\n",),
        add_bos=False,
        cache_prompt=False,
        infill=Infill(prefix=["def f", 236769], suffix="\n", extra=(("a.py", "x = 1\n"),)),
        lines=LineLimits(n_indent=4, t_max_predict=0.25),
    )
    assert infill_payload(request, extra_body={"x": 1}) == {
        "input_prefix": ["def f", 236769],
        "input_suffix": "\n",
        "input_extra": [{"filename": "a.py", "text": "x = 1\n"}],
        "prompt": "ret",
        "n_predict": -1,
        "stream": True,
        "temperature": 0.0,
        "top_k": 40,
        "top_p": 0.95,
        "min_p": 0.05,
        "cache_prompt": False,
        "seed": 7,
        "stop": ["\n\n"],
        "samplers": ["top_k", "temperature"],
        "n_indent": 4,
        "t_max_predict_ms": 250,
        "x": 1,
    }


def test_a_suffix_completion_sends_its_own_top_k_and_the_penalties_asked_for() -> None:
    """``suffix`` on /v1/completions: top_k 0 and min_p 0 are sent (llama-server's
    defaults are 40 and 0.05); a penalty only when it is not off."""
    request = GenerationRequest(
        prompt="",
        max_tokens=16,
        sampling=SamplingParams(temperature=0.0, repeat_penalty=1.1, repeat_last_n=32, logit_bias={5: -2.0}),
        infill=Infill(prefix="a", suffix="b"),
    )
    payload = infill_payload(request, extra_body={})
    assert (payload["top_k"], payload["min_p"], payload["n_predict"]) == (0, 0.0, 16)
    assert (payload["repeat_penalty"], payload["repeat_last_n"]) == (1.1, 32)
    assert payload["logit_bias"] == {"5": -2.0}
    for absent in ("frequency_penalty", "presence_penalty", "samplers", "seed", "stop", "n_indent"):
        assert absent not in payload


@pytest.mark.parametrize(
    ("data", "event"),
    [
        # a delta, a prompt-progress event (no text), llama-server's final objects
        ('{"index":0,"content":"x","stop":false,"tokens_predicted":1}', CompletionEvent(texts=("x",))),
        ('{"content":"","stop":false,"prompt_progress":{"total":27}}', CompletionEvent()),
        (
            '{"content":"","stop":true,"stop_type":"eos","tokens_predicted":3,"tokens_evaluated":27}',
            CompletionEvent(finish_reason="stop", usage=(27, 3), last=True),
        ),
        (
            '{"content":"","stop":true,"stop_type":"word","stopping_word":"\\n",'
            '"tokens_predicted":1,"tokens_evaluated":12}',
            CompletionEvent(finish_reason="stop", usage=(12, 1), last=True),
        ),
        (
            '{"content":"","stop":true,"stop_type":"limit","tokens_predicted":12,"tokens_evaluated":19}',
            CompletionEvent(finish_reason="length", usage=(19, 12), last=True),
        ),
        # the final object's content is not handed on (an upstream trioserve's
        # repeats the whole text); the counts from timings when the others are absent
        (
            '{"content":"ab","stop":true,"stop_type":"limit","timings":{"prompt_n":5,"cache_n":2,'
            '"predicted_n":2}}',
            CompletionEvent(finish_reason="length", usage=(7, 2), last=True),
        ),
        # an upstream trioserve's early end says why
        (
            '{"content":"","stop":true,"stop_type":"limit","tokens_predicted":1,"tokens_evaluated":2,'
            '"trioserve":{"end_cause":"deadline","message":"late"}}',
            CompletionEvent(
                finish_reason="deadline", usage=(2, 1), message="late", has_extension=True, last=True
            ),
        ),
        ('{"content":"","stop":true}', CompletionEvent(finish_reason="stop", last=True)),
        ('{"error":{"code":500,"message":"boom"}}', CompletionEvent(error="boom")),
        ("[1]", CompletionEvent()),
    ],
)
def test_infill_events(data: str, event: CompletionEvent) -> None:
    assert infill_event(data) == event


def test_an_infill_event_that_is_not_json() -> None:
    with pytest.raises(NotJSON):
        infill_event("{nope")


# -------------------------------------------------------------------- rerank


def test_the_rerank_payload_asks_for_every_score() -> None:
    assert rerank_payload("q", ["a", "b"]) == {"query": "q", "documents": ["a", "b"], "top_n": 2}


def test_a_rerank_answer_gives_the_scores_in_the_documents_order() -> None:
    answer = decode_rerank(
        b'{"results":[{"index":1,"relevance_score":5.5},{"index":0,"relevance_score":-1.25}],'
        b'"usage":{"prompt_tokens":19,"total_tokens":19}}'
    )
    assert answer is not None
    assert answer.scores(2) == ([-1.25, 5.5], 19)
    assert answer.scores(3) is None  # one score missing
    assert answer.trioserve is None
    said = decode_rerank(
        b'{"results":[{"index":0,"relevance_score":0.5}],"trioserve":{"reranker":"yes-no","score":"probability"}}'
    )
    assert said is not None
    assert said.trioserve is not None
    assert (said.trioserve.reranker, said.trioserve.score, said.scores(1)) == (
        "yes-no",
        "probability",
        ([0.5], 0),
    )
    assert decode_rerank(b'{"data": []}') is None
    assert decode_rerank(b"nope") is None
