"""Speculative decoding from the prompt (issue 24): one stream, three workloads, trioserve's
``--speculate off|auto|fast`` against llama-server plain and with its n-gram speculation.

Workloads, several prompts each, ``POST /v1/completions`` (the base model, no chat
template), temperature 0: **edit** (a ~40-line Python function, then "the same function
with X renamed to Y": the model copies it), **quote** (a passage of factual prose, then a
question answered by quoting it), **free** (a short story: nothing to copy). Every server
is started once; requests go one at a time, each prompt to every contestant in turn, the
starting one rotating from prompt to prompt, so only one computes at a time and drift
hits all alike. Each prompt is new to every server in round 1 (later rounds may be helped
by a prompt cache: llama-server's default one, trioserve's own; the tables give rounds
apart too). Read by the raw-socket client; the events are parsed after the stream ended.

Per request: tok/s = completion tokens ÷ time to last token (request sent → last token
event); decode tok/s = (tokens − 1) ÷ (last − first token event); medians over prompts ×
rounds. Texts: each temperature-0 text against ``trioserve --speculate off``'s text of the
same prompt and round (= off), and against plain llama-server's (= llama-server).
llama-server runs with its defaults (4 slots, unified KV cache, prompt cache on) but the
same ``--ctx-size`` and threads as trioserve. Method: docs/benchmarks.md, "Method".

    python benchmarks/speculation.py --rounds 2 --json artifacts/speculation.json
    python benchmarks/speculation.py --quick       # 1 prompt per workload, 32 tokens: a smoke test
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import cli, servers
from benchmarks.harness.clients import RawStream, body
from benchmarks.harness.stats import fmt, median, ratio, table

OFF, PLAIN = "trioserve-off", servers.LLAMA_SERVER
#: contestant → (the server's name for ``servers.command``, its extra flags)
CONTESTANTS: dict[str, list[str]] = {
    OFF: ["--speculate", "off"],
    "trioserve-auto": ["--speculate", "auto"],
    "trioserve-exact": ["--speculate", "exact"],
    "trioserve-fast": ["--speculate", "fast"],
    PLAIN: [],
    "llama-server-ngram-simple": ["--spec-type", "ngram-simple"],
    "llama-server-ngram-mod": ["--spec-type", "ngram-mod"],
    "llama-server-ngram-map-k": ["--spec-type", "ngram-map-k"],
}
NAMES = tuple(CONTESTANTS)
SPEC_LLAMA = tuple(n for n in NAMES if n.startswith(PLAIN + "-"))
WARM_UP = "Once upon a time"

# --- the edit workload: a function, then the same function with one identifier renamed ---

FUNCTIONS: list[tuple[str, str, str]] = [
    (
        '''def summarize_requests(lines, slow_ms=500):
    """Count requests per status and endpoint in access-log lines, and list the slow ones."""
    by_status = {}
    by_endpoint = {}
    slow = []
    skipped = 0
    for raw in lines:
        raw = raw.strip()
        if not raw or raw.startswith("#"):
            continue
        entry = raw.split(" ")
        if len(entry) < 5:
            skipped += 1
            continue
        method, path, status, size, elapsed = entry[:5]
        try:
            status = int(status)
            elapsed = float(elapsed)
        except ValueError:
            skipped += 1
            continue
        endpoint = path.split("?")[0]
        by_status[status] = by_status.get(status, 0) + 1
        counts = by_endpoint.setdefault(endpoint, {"count": 0, "bytes": 0, "errors": 0})
        counts["count"] += 1
        counts["bytes"] += int(size) if size.isdigit() else 0
        if status >= 500:
            counts["errors"] += 1
        if elapsed * 1000 >= slow_ms:
            slow.append((elapsed, method, endpoint, entry))
    slow.sort(reverse=True)
    total = sum(by_status.values())
    return {
        "total": total,
        "skipped": skipped,
        "by_status": dict(sorted(by_status.items())),
        "by_endpoint": by_endpoint,
        "slowest": [e for _, _, _, e in slow[:10]],
    }
''',
        "entry",
        "fields",
    ),
    (
        '''def load_config(path, defaults=None, environ=None):
    """Read an INI-style file into a dict of sections, then apply environment overrides."""
    settings = {"main": dict(defaults or {})}
    section = "main"
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            line = line.split(";", 1)[0].strip()
            if not line:
                continue
            if line.startswith("[") and line.endswith("]"):
                section = line[1:-1].strip().lower()
                if not section:
                    raise ValueError(f"{path}:{number}: empty section name")
                settings.setdefault(section, {})
                continue
            if "=" not in line:
                raise ValueError(f"{path}:{number}: expected key = value")
            key, value = (part.strip() for part in line.split("=", 1))
            if value.lower() in ("true", "yes", "on"):
                value = True
            elif value.lower() in ("false", "no", "off"):
                value = False
            elif value.isdigit():
                value = int(value)
            settings[section][key.lower()] = value
    for name, value in (environ or {}).items():
        if not name.startswith("APP_"):
            continue
        parts = name[4:].lower().split("__")
        if len(parts) == 1:
            settings["main"][parts[0]] = value
        else:
            settings.setdefault(parts[0], {})[parts[1]] = value
    missing = [key for key in ("name", "port") if key not in settings["main"]]
    if missing:
        raise KeyError(f"{path}: missing {', '.join(missing)}")
    settings["main"]["port"] = int(settings["main"]["port"])
    return settings
''',
        "settings",
        "config",
    ),
    (
        '''def schedule_jobs(jobs, workers, now=0.0):
    """Assign jobs to the worker free soonest, respecting dependencies; return the plan."""
    done_at = {}
    free_at = {worker: now for worker in workers}
    plan = []
    pending = sorted(jobs, key=lambda job: (-job["priority"], job["name"]))
    while pending:
        ready = [
            job for job in pending
            if all(dep in done_at for dep in job.get("after", ()))
        ]
        if not ready:
            names = ", ".join(job["name"] for job in pending)
            raise RuntimeError(f"circular or missing dependencies: {names}")
        job = ready[0]
        pending.remove(job)
        earliest = max([done_at[dep] for dep in job.get("after", ())] + [now])
        worker = min(free_at, key=lambda w: (max(free_at[w], earliest), w))
        start = max(free_at[worker], earliest)
        finish = start + job["duration"]
        free_at[worker] = finish
        done_at[job["name"]] = finish
        plan.append(
            {
                "job": job["name"],
                "worker": worker,
                "start": start,
                "finish": finish,
                "waited": start - earliest,
            }
        )
    busy = {worker: 0.0 for worker in workers}
    for step in plan:
        busy[step["worker"]] += step["finish"] - step["start"]
    makespan = max(done_at.values(), default=now) - now
    usage = {
        worker: (busy[worker] / makespan if makespan else 0.0) for worker in workers
    }
    return plan, makespan, usage
''',
        "done_at",
        "finished_at",
    ),
    (
        '''def render_invoice(order, tax_rate=0.2, currency="EUR"):
    """Format an order as a plain-text invoice with subtotals, discounts and tax."""
    lines = []
    subtotal = 0
    lines.append(f"Invoice {order['number']} for {order['customer']}")
    lines.append("-" * 48)
    for item in order["items"]:
        quantity = item.get("quantity", 1)
        price = round(item["unit_price"] * quantity, 2)
        discount = item.get("discount", 0)
        if discount:
            price = round(price * (1 - discount), 2)
        subtotal += price
        label = item["description"][:28]
        if discount:
            label += f" (-{int(discount * 100)}%)"
        lines.append(f"{quantity:>3} x {label:<32} {price:>9.2f}")
    lines.append("-" * 48)
    shipping = order.get("shipping", 0)
    if subtotal >= order.get("free_shipping_over", float("inf")):
        shipping = 0
    tax = round((subtotal + shipping) * tax_rate, 2)
    total = round(subtotal + shipping + tax, 2)
    lines.append(f"{'Subtotal':<38} {subtotal:>9.2f}")
    lines.append(f"{'Shipping':<38} {shipping:>9.2f}")
    lines.append(f"{'Tax':<38} {tax:>9.2f}")
    lines.append(f"{'Total (' + currency + ')':<38} {total:>9.2f}")
    if order.get("notes"):
        lines.append("")
        for note in order["notes"]:
            lines.append(f"Note: {note}")
    return "\\n".join(lines), total
''',
        "label",
        "title",
    ),
    (
        '''def flood_fill(grid, start, new_color, diagonal=False):
    """Repaint the region of equal color that contains start; return how many cells changed."""
    rows = len(grid)
    if rows == 0:
        return 0
    cols = len(grid[0])
    row, col = start
    if not (0 <= row < rows and 0 <= col < cols):
        raise IndexError(f"start {start} outside a {rows}x{cols} grid")
    old_color = grid[row][col]
    if old_color == new_color:
        return 0
    steps = [(-1, 0), (1, 0), (0, -1), (0, 1)]
    if diagonal:
        steps += [(-1, -1), (-1, 1), (1, -1), (1, 1)]
    stack = [(row, col)]
    changed = 0
    while stack:
        cell = stack.pop()
        r, c = cell
        if grid[r][c] != old_color:
            continue
        grid[r][c] = new_color
        changed += 1
        for dr, dc in steps:
            nr, nc = r + dr, c + dc
            if 0 <= nr < rows and 0 <= nc < cols and grid[nr][nc] == old_color:
                stack.append((nr, nc))
    return changed
''',
        "stack",
        "frontier",
    ),
]

# --- the quote workload: a passage, then a question answered by quoting it ---

PASSAGES: list[tuple[str, str]] = [
    (
        "The Fresnel lens was invented by the French physicist Augustin-Jean Fresnel in the "
        "early 1820s to make lighthouses visible from farther out at sea. Earlier lighthouses "
        "relied on mirrors or very thick glass lenses, which were heavy, expensive and absorbed "
        "much of the light that passed through them. Fresnel's design divided a lens into a "
        "series of concentric rings, each a thin section of a curved surface, so that the lens "
        "bent light as strongly as a solid one while using a fraction of the glass. Prisms "
        "placed above and below the central rings caught light that would otherwise have "
        "escaped toward the sky or the sea and turned it into the horizontal beam. Lenses were "
        "made in several sizes, called orders, from the large first-order lenses used on major "
        "coastal lights to the small sixth-order lenses used in harbors. The first Fresnel lens "
        "was installed in the Cordouan lighthouse on the Gironde estuary in 1823, and its beam "
        "could be seen more than twenty miles away. Within a few decades the design had been "
        "adopted by lighthouse services around the world.",
        "the prisms above and below the central rings",
    ),
    (
        "Honeybee foragers tell their nestmates where to find food with a movement known as the "
        "waggle dance, first decoded by the Austrian biologist Karl von Frisch. A returning "
        "forager runs a short straight line on the vertical comb while shaking her abdomen from "
        "side to side, then circles back to her starting point and repeats the run, alternating "
        "between a left and a right return loop. The angle of the straight run relative to "
        "vertical gives the direction of the food relative to the sun: a run straight up the "
        "comb means the food lies toward the sun, while a run straight down means it lies away "
        "from the sun. The duration of the waggle run encodes distance, with each second of "
        "waggling corresponding to roughly one kilometer of flight, although the exact "
        "calibration differs between colonies. Because the sun moves across the sky during the "
        "day, dancers adjust the angle of their runs over time. Bees that follow the dance also "
        "learn the scent of the flowers from the dancer's body.",
        "how the duration of the waggle run is used",
    ),
    (
        "The Panama Canal crosses the Isthmus of Panama and connects the Atlantic Ocean with the "
        "Pacific Ocean. It opened in 1914 after a decade of construction by the United States, "
        "which took over the project after an earlier French attempt had failed because of "
        "disease, landslides and financial collapse. Instead of cutting a channel at sea level, "
        "the American engineers built a lock canal. Ships are raised by three sets of locks to "
        "Gatun Lake, an artificial lake about twenty-six meters above sea level that was "
        "created by damming the Chagres River, and lowered again by locks on the other side. "
        "The locks are filled and emptied by gravity: water flows from the lake through large "
        "culverts in the lock walls, and no pumps are used. Each passage through the locks uses "
        "millions of liters of fresh water, which then flows out to the sea. In 2016 a third, "
        "larger set of locks opened, allowing much bigger ships to use the canal, and these new "
        "locks include basins that save and reuse part of the water.",
        "how the locks are filled and emptied",
    ),
    (
        "The Rosetta Stone is a granite slab inscribed with a decree issued at Memphis in 196 BC "
        "on behalf of King Ptolemy V. The decree appears three times, in three scripts: "
        "Egyptian hieroglyphs, the cursive Egyptian script known as Demotic, and ancient Greek. "
        "French soldiers found the stone in 1799 near the town of Rashid, called Rosetta by "
        "Europeans, in the Nile Delta, and it passed to the British after the French surrender "
        "in Egypt in 1801. It has been displayed in the British Museum in London since 1802. "
        "Because scholars could read the Greek text, the stone offered a key to the other two "
        "scripts. The English scientist Thomas Young showed that some hieroglyphs enclosed in "
        "oval rings, called cartouches, spelled the name of Ptolemy. Building on this work, the "
        "French scholar Jean-Francois Champollion announced in 1822 that hieroglyphs recorded "
        "sounds as well as ideas, and he went on to read Egyptian texts that had been silent for "
        "more than a thousand years.",
        "what Thomas Young showed",
    ),
    (
        "Tardigrades, also called water bears or moss piglets, are microscopic animals about "
        "half a millimeter long with eight stubby legs ending in claws. They live in almost "
        "every habitat on Earth, from deep-sea sediments to mountain tops, but they are most "
        "easily found in the thin film of water on mosses and lichens. When their surroundings "
        "dry out, many species enter a state called cryptobiosis: they pull in their legs, lose "
        "almost all of the water in their bodies and curl into a dry shape known as a tun. In "
        "this state their metabolism drops to less than a hundredth of a percent of normal. Tuns "
        "have survived temperatures close to absolute zero, heating to above one hundred degrees "
        "Celsius for a short time, pressures six times those of the deepest ocean trench, and "
        "exposure to the vacuum of space during an experiment aboard a satellite in 2007. When "
        "water returns, a tardigrade can rehydrate and resume normal activity within hours.",
        "what tardigrades do when their surroundings dry out",
    ),
]

# --- the free workload: nothing to copy ---

STORIES = [
    "a lighthouse keeper who finds a message in a bottle written in her own handwriting",
    "a baker in a mountain village who wakes up to find that the bread has learned to sing",
    "two rival clockmakers who must work together when every clock in the city stops at once",
    "a young cartographer who is asked to map an island that appears only at low tide",
    "an old robot gardener that keeps tending a greenhouse long after the station was abandoned",
]


def edit_prompt(code: str, old: str, new: str) -> str:
    assert code.count(old) >= 3, (old, code.count(old))
    return f"{code}\n\n# The same function with `{old}` renamed to `{new}`:\n\n"


def quote_prompt(passage: str, about: str) -> str:
    question = f"What does the passage say about {about}? Answer by quoting the passage."
    return f'Passage: {passage}\n\nQuestion: {question}\nAnswer: "'


def free_prompt(subject: str) -> str:
    return f"Write a short story about {subject}.\n\nStory:\n"


# --- issue 40's two: short edits (~120-token prompts) and a long verbatim copy ---

SNIPPETS: list[tuple[str, str, str]] = [
    (
        "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
        "    return total / len(values)\n",
        "total",
        "acc",
    ),
    (
        "def find_user(users, name):\n    for user in users:\n        if user.name == name:\n"
        "            return user\n    return None\n",
        "user",
        "account",
    ),
    (
        "def clamp(x, low, high):\n    if x < low:\n        return low\n    if x > high:\n"
        "        return high\n    return x\n",
        "x",
        "value",
    ),
    (
        "def count_words(text):\n    counts = {}\n    for word in text.split():\n"
        "        counts[word] = counts.get(word, 0) + 1\n    return counts\n",
        "counts",
        "tally",
    ),
    (
        "def read_lines(path):\n    lines = []\n    with open(path) as handle:\n"
        "        for line in handle:\n            lines.append(line.rstrip())\n    return lines\n",
        "lines",
        "rows",
    ),
]


def long_copy_prompt(first: int) -> str:
    """The five passages (~1,100 tokens), then the start of a verbatim copy of them,
    beginning with passage ``first``."""
    passages = [p for p, _ in PASSAGES]
    text = "\n\n".join(passages[first:] + passages[:first])
    start = " ".join(text.split()[:6])
    return f"{text}\n\nThe text above, copied out word for word:\n\n{start}"


WORKLOADS: dict[str, list[str]] = {
    "edit": [edit_prompt(*f) for f in FUNCTIONS],
    "quote": [quote_prompt(*p) for p in PASSAGES],
    "free": [free_prompt(s) for s in STORIES],
    # (two small functions, the first one's identifier renamed: ~110 tokens)
    "short-edit": [
        edit_prompt(f"{code}\n\n{SNIPPETS[(i + 1) % len(SNIPPETS)][0]}", old, new)
        for i, (code, old, new) in enumerate(SNIPPETS)
    ],
    "long-copy": [long_copy_prompt(i) for i in range(len(PASSAGES))],
}


def parse_args() -> Any:
    p = cli.parser(__doc__, (NAMES, NAMES), threads=2, ctx_size=2048, max_tokens=160)
    cli.option(p, "--rounds", 2, "rounds: every prompt to every contestant once a round")
    cli.option(p, "--prompts-per-workload", 0, "prompts per workload, the first ones (0: all)")
    p.add_argument("--quick", action="store_true", help="1 prompt per workload, 32 tokens: a smoke test")
    p.add_argument(
        "--workloads", default="", help=f"comma-separated, from {','.join(WORKLOADS)} (default: all)"
    )
    args = p.parse_args()
    if args.quick:
        args.prompts_per_workload, args.max_tokens = 1, 32
    if args.out is None:
        args.out = Path("artifacts") / ("speculation-quick.json" if args.quick else "speculation.json")
    return args


def events_payload(stream: RawStream) -> list[dict[str, Any]]:
    """The JSON of each ``data:`` event (after the stream ended; chunk sizes skipped)."""
    decoder, out = json.JSONDecoder(), []
    for _, event in stream.events:
        at = event.find(b"data: ")
        if at < 0 or b"[DONE]" in event:
            continue
        try:
            out.append(decoder.raw_decode(event[at + 6 :].decode())[0])
        except (ValueError, UnicodeDecodeError):
            continue
    return out


def one_request(server: servers.Server, prompt: str, max_tokens: int, timeout: float) -> dict[str, Any]:
    """One streamed greedy completion, timed by the raw-socket client."""
    payload = body(prompt, max_tokens, stream_options={"include_usage": True})
    stream = RawStream(server.port, payload)
    for _ in stream.iter_events(timeout):
        pass
    times = stream.token_times()
    if stream.status != 200 or not times:
        raise RuntimeError(f"{server.name}: status {stream.status}, {len(times)} token events")
    text, usage, predicted = [], None, None
    for event in events_payload(stream):
        for choice in event.get("choices") or []:
            text.append(choice.get("text") or "")
        usage = (event.get("usage") or {}).get("completion_tokens", usage)
        predicted = (event.get("timings") or {}).get("predicted_n", predicted)
    tokens: int = len(times)
    source = "events"
    if usage or predicted:
        tokens, source = (int(usage), "usage") if usage else (int(predicted), "timings")
    last, first = times[-1] - stream.sent_at, times[0] - stream.sent_at
    return {
        "tokens": tokens,
        "token_source": source,
        "events": len(times),
        "ttft_s": first,
        "ttlt_s": last,
        "tps": tokens / last,
        "decode_tps": (tokens - 1) / (last - first) if last > first and tokens > 1 else None,
        "finish_reason": stream.finish_reason(),
        "text": "".join(text),
    }


def wait_idle(server: servers.Server, limit: float = 30.0) -> None:
    """Until trioserve's idle recompute of the reply it just sent is done (it runs while
    the server has no request: the next contestant must not share the CPU with it)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=5) as response:
            health = json.load(response)
        models = health.get("models")
        pending = 0
        for model in models.values() if isinstance(models, dict) else [health]:
            batch = model.get("batch") if isinstance(model, dict) else None
            if isinstance(batch, dict):
                pending += int(batch.get("cache", {}).get("idle_recompute", {}).get("pending", 0))
        if not pending:
            return
        time.sleep(0.05)


def run(args: Any) -> dict[str, Any]:
    model, settings = cli.resolve_model(args), {"threads": args.threads, "ctx_size": args.ctx_size}
    keep = args.prompts_per_workload or None
    chosen = (
        [w.strip() for w in args.workloads.split(",") if w.strip()] if args.workloads else list(WORKLOADS)
    )
    unknown = set(chosen) - set(WORKLOADS)
    if unknown:
        raise SystemExit(f"--workloads: unknown {sorted(unknown)}; pick from {','.join(WORKLOADS)}")
    workloads = {name: WORKLOADS[name][:keep] for name in chosen}
    cfg = cli.environment(model, **settings, max_tokens=args.max_tokens, contestants=args.contestants)
    cfg |= {"rounds": args.rounds, "quick": args.quick, "prompts": workloads}
    requests: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as logs, servers.running([]) as running:
        for name in args.contestants:
            extra = list(CONTESTANTS[name])
            if servers.kind(name) == servers.LLAMA_SERVER:
                extra += ["--ctx-size", str(args.ctx_size)]  # trioserve's: the same context
            running.append(servers.Server.start(name, model, Path(logs), **settings, extra=extra))
        for server in running:
            server.wait_ready(args.ready_timeout)
            one_request(server, WARM_UP, 8, args.request_timeout)  # warm-up, not counted
        cfg["commands"] = {s.name: s.command for s in running}
        turn = 0
        for round_ in range(1, args.rounds + 1):
            for workload, prompts in workloads.items():
                for i, prompt in enumerate(prompts):
                    shift, turn = turn % len(running), turn + 1
                    for server in running[shift:] + running[:shift]:
                        server.check_alive()
                        got = one_request(server, prompt, args.max_tokens, args.request_timeout)
                        if servers.kind(server.name) == servers.TRIOSERVE:
                            wait_idle(server)
                        got |= {"round": round_, "workload": workload, "prompt": i, "contestant": server.name}
                        requests.append(got)
                    cli.log(
                        f"round {round_} {workload} #{i}: "
                        + ", ".join(f"{r['contestant']} {r['tps']:.1f}" for r in requests[-len(running) :])
                    )
    compare(requests)
    summary = summarize(requests, args)
    return {"config": cfg, "requests": requests, "summary": summary, "notes": notes(requests)}


def compare(requests: list[dict[str, Any]]) -> None:
    """``equal_off`` / ``equal_llama``: the text equals trioserve-off's / llama-server's of
    the same prompt and round (``None`` when that contestant did not run)."""
    texts = {(r["contestant"], r["round"], r["workload"], r["prompt"]): r["text"] for r in requests}
    for r in requests:
        key = (r["round"], r["workload"], r["prompt"])
        for field, ref in (("equal_off", OFF), ("equal_llama", PLAIN)):
            other = texts.get((ref, *key))
            r[field] = None if other is None else r["text"] == other


def summarize(requests: list[dict[str, Any]], args: Any) -> dict[str, Any]:
    """Per contestant and workload: medians, texts equal; per round too; the ratios."""
    out: dict[str, Any] = {}
    for name in args.contestants:
        for workload in WORKLOADS:
            mine = [r for r in requests if r["contestant"] == name and r["workload"] == workload]
            if not mine:
                continue
            rounds = sorted({r["round"] for r in mine})
            out.setdefault(name, {})[workload] = {
                "n": len(mine),
                "tps": median(r["tps"] for r in mine),
                "decode_tps": median(r["decode_tps"] for r in mine),
                "ttlt_s": median(r["ttlt_s"] for r in mine),
                "ttft_s": median(r["ttft_s"] for r in mine),
                "tokens": median(r["tokens"] for r in mine),
                "equal_off": count(mine, "equal_off"),
                "equal_llama": count(mine, "equal_llama"),
                "tps_by_round": {str(k): median(r["tps"] for r in mine if r["round"] == k) for k in rounds},
            }
    for workload in WORKLOADS:
        best = max(
            (n for n in SPEC_LLAMA if workload in out.get(n, {})),
            key=lambda n: out[n][workload]["tps"],
            default=None,
        )
        for by in out.values():
            if workload not in by:
                continue
            cell, tps = by[workload], by[workload]["tps"]
            cell["vs_off"] = tps / out[OFF][workload]["tps"] if workload in out.get(OFF, {}) else None
            cell["best_llama_spec"] = best
            cell["vs_best_llama_spec"] = tps / out[best][workload]["tps"] if best else None
    return out


def count(records: list[dict[str, Any]], field: str) -> list[int] | None:
    """``[equal, compared]``, or ``None`` when nothing was compared."""
    seen = [r[field] for r in records if r[field] is not None]
    return [sum(seen), len(seen)] if seen else None


def notes(requests: list[dict[str, Any]]) -> list[str]:
    out = []
    short = [r for r in requests if r["finish_reason"] != "length"]
    if short:
        which = sorted({f"{r['contestant']} {r['workload']} #{r['prompt']}" for r in short})
        out.append(f"{len(short)} completions ended before max_tokens: {', '.join(which[:12])}")
    sources = sorted({f"{r['contestant']}: {r['token_source']}" for r in requests})
    out.append("completion tokens from " + "; ".join(sources))
    return out


def label(name: str) -> str:
    return servers.LABELS.get(name, name)


def equal(value: list[int] | None) -> str:
    return "—" if value is None else f"{value[0]}/{value[1]}"


def report(result: dict[str, Any], args: Any) -> None:
    cfg, summary = result["config"], result["summary"]
    names = [n for n in cfg["contestants"] if n in summary]
    loads = [w for w in WORKLOADS if any(w in summary[n] for n in names)]
    sizes = ", ".join(f"{w} {len(cfg['prompts'][w])}" for w in loads)
    what = f"{cfg['max_tokens']} tokens, one stream, {cfg['threads']} threads, ctx {cfg['ctx_size']}"
    what += f", POST /v1/completions, temperature 0, {cfg['rounds']} rounds × prompts ({sizes})"
    print(cli.header(cfg, what))

    def get(n: str, w: str, k: str) -> Any:
        return summary[n].get(w, {}).get(k)

    head = ["contestant"]
    for w in loads:
        head += [f"{w} tok/s", f"{w} to last token s", f"{w} = off"]
    rows = [head]
    for n in names:
        row = [label(n)]
        for w in loads:
            row += [fmt(get(n, w, "tps")), fmt(get(n, w, "ttlt_s"), ".2f"), equal(get(n, w, "equal_off"))]
        rows.append(row)
    print("tok/s = completion tokens ÷ time to last token (request sent → last token event); medians")
    print(table(rows))
    head = ["contestant"]
    for w in loads:
        head += [f"{w} ÷ off", f"{w} ÷ best llama spec"]
    rows = [head]
    for n in names:
        row = [label(n)]
        for w in loads:
            row += [ratio(get(n, w, "vs_off")), ratio(get(n, w, "vs_best_llama_spec"))]
        rows.append(row)
    best = ", ".join(f"{w}: {get(names[0], w, 'best_llama_spec') or '—'}" for w in loads)
    print(f"\nratios of tok/s; best llama-server speculation per workload: {best}")
    print(table(rows))
    head = ["contestant"]
    for w in loads:
        head += [f"{w} decode tok/s", f"{w} TTFT s", f"{w} = llama-server"]
    rows = [head]
    for n in names:
        row = [label(n)]
        for w in loads:
            cells = [fmt(get(n, w, "decode_tps")), fmt(get(n, w, "ttft_s"), ".2f")]
            row += [*cells, equal(get(n, w, "equal_llama"))]
        rows.append(row)
    print("\ndecode tok/s = (tokens − 1) ÷ (last − first token event); medians")
    print(table(rows))
    rounds = [str(k) for k in range(1, cfg["rounds"] + 1)]
    rows = [["contestant", *(f"{w} r{k}" for w in loads for k in rounds)]]
    for n in names:
        by_round = [get(n, w, "tps_by_round") or {} for w in loads]
        rows.append([label(n), *(fmt(b.get(k)) for b in by_round for k in rounds)])
    print("\ntok/s by round (round 1: every prompt new to every server)")
    print(table(rows))
    if args.markdown:
        keys = ["round", "workload", "prompt", "contestant", "tokens", "ttft_s", "ttlt_s", "tps"]
        keys.append("decode_tps")
        rows = [[*keys, "= off", "= llama-server"]]
        for r in result["requests"]:
            cells = [fmt(r[k], ".3f") if isinstance(r[k], float) else str(r[k]) for k in keys]
            rows.append([*cells, str(r["equal_off"]), str(r["equal_llama"])])
        print("\n" + table(rows))


if __name__ == "__main__":
    raise SystemExit(cli.main(parse_args, run, report))
