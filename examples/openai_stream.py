"""Stream a chat completion from a running trioserve with the official ``openai`` SDK.

    ./scripts/serve &                       # or: trioserve serve
    python examples/openai_stream.py "Write a haiku about rivers."

Pass ``--url`` for another server and ``--timeout`` to set a per-request deadline
(sent as ``X-Request-Timeout``); a stream cut by its deadline ends with
``finish_reason == "length"`` and says why in trioserve's own field
(``chunk.model_extra["trioserve"]["end_cause"] == "deadline"``).
"""

from __future__ import annotations

import argparse

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("message")
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    parser.add_argument("--temperature", type=float, default=None, help="0: greedy, reproducible")
    args = parser.parse_args()
    headers = {"X-Request-Timeout": str(args.timeout)} if args.timeout else None
    with OpenAI(base_url=args.url, api_key="unused") as client:
        stream = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": args.message}],
            max_tokens=args.max_tokens,
            stream=True,
            **({"temperature": args.temperature} if args.temperature is not None else {}),
            extra_headers=headers,
        )
        finish = None
        for chunk in stream:
            if chunk.choices:
                print(chunk.choices[0].delta.content or "", end="", flush=True)
                finish = chunk.choices[0].finish_reason or finish
                extra = (chunk.model_extra or {}).get("trioserve")
                if extra:  # cut short: why (deadline, shutdown)
                    finish = f"{finish}: {extra['end_cause']}"
        print(f"\n[{finish}]")


if __name__ == "__main__":
    main()
