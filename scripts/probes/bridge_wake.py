"""Issue 53 (docs/architecture.md, "More than one core for the HTTP side"): what a thread's
wake of the Trio loop costs (one ``TrioToken.run_sync_soon`` per wake, as ``PieceChannel.put``
posts one per channel), against one wake per 8 consumers (a scheduler step's frame), and a
64-byte message over a Unix socket pair (a front <-> engine hop). CPU of the whole process.
    python scripts/probes/bridge_wake.py
"""
import threading, time, trio, socket
N = 20000
async def main():
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()
    count = 0
    def cb():
        nonlocal count
        count += 1
        if count == N: done.set()
    def producer():
        for _ in range(N):
            token.run_sync_soon(cb)
    t0 = time.process_time(); w0 = time.perf_counter()
    th = threading.Thread(target=producer); th.start()
    await done.wait(); th.join()
    print(f"run_sync_soon x{N}: {(time.process_time()-t0)/N*1e6:.2f} us CPU each (both sides), wall {(time.perf_counter()-w0)/N*1e6:.2f} us")
    # batched: one run_sync_soon calling 8 callbacks
    count = 0; done2 = trio.Event()
    def cb8():
        nonlocal count
        for _ in range(8):
            count += 1
        if count >= N: done2.set()
    def producer8():
        for _ in range(N // 8):
            token.run_sync_soon(cb8)
    t0 = time.process_time()
    th = threading.Thread(target=producer8); th.start()
    await done2.wait(); th.join()
    print(f"one run_sync_soon per 8 wakes: {(time.process_time()-t0)/N*1e6:.2f} us CPU per wake")
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    t0 = time.process_time()
    msg = b"x" * 64
    for _ in range(N):
        a.send(msg); b.recv(64)
    print(f"unix socket 64-byte send+recv: {(time.process_time()-t0)/N*1e6:.2f} us CPU")
trio.run(main)
