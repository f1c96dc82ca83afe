"""Issue 53: bursts of N streamed chat requests (max_tokens T) at a server on 127.0.0.1:PORT, R
rounds; prints each round's time and its last stream's first event (a SYN past the listen
backlog costs the client a second).

    python scripts/probes/burst_first_event.py PORT N T R
"""
import json, sys, time, trio
port, n, tokens, rounds = (int(x) for x in sys.argv[1:5])
payload = json.dumps({"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens, "stream": True}).encode()
head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
firsts = []
async def one(t0):
    sock = await trio.open_tcp_stream("127.0.0.1", port)
    async with sock:
        await sock.send_all(head + payload)
        first = None
        while data := await sock.receive_some(65536):
            if first is None and b"data:" in data:
                first = trio.current_time() - t0
        firsts.append(first or 0)
async def main():
    for r in range(rounds):
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(one, t0)
        print(f"round {r}: {trio.current_time()-t0:.3f} s, last first {max(firsts)*1e3:.0f} ms", flush=True)
        firsts.clear()
trio.run(main)
