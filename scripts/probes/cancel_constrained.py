"""benchmarks/cancel.py with ``--request-extra`` reaching trioserve too (issue 15).

cancel.py merges ``--request-extra`` into llama-server's requests only (trioserve refuses
llama-server's own fields); this runs the same scenario, unchanged, with the extra merged
into trioserve's requests as well, e.g. a response_format, so its decode-disconnect and
deadline measurements run under a constraint. Every cancel.py option applies.

    flock /tmp/trioserve-cpu.lock .venv/bin/python scripts/probes/cancel_constrained.py \\
        --contestants trioserve --prefill-reps 0 \\
        --request-extra "$(.venv/bin/python scripts/probes/constrained_cost.py --print-extra)"
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import cancel
from benchmarks.harness import cli
from benchmarks.harness.clients import body


def request(server: Any, args: Any, tag: str | None, max_tokens: int) -> dict[str, Any]:
    """cancel.request, the extra merged for every server."""
    text = "Once upon a time" if tag is None else f"Record {tag}. " + cancel.SENTENCE * args.prefill_repeats
    return body(text, max_tokens, **args.request_extra)


if __name__ == "__main__":
    cancel.request = request
    raise SystemExit(cli.main(cancel.parse_args, cancel.run, cancel.report))
