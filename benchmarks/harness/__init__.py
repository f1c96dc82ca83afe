"""The benchmark harness: what every scenario in ``benchmarks/`` shares.

* :mod:`.cli`: the command line every scenario words alike, the run loop, JSON output;
* :mod:`.servers`: launchers for trioserve, llama-cpp-python's server and llama.cpp's
  ``llama-server``, and :class:`~.servers.Server` (start, readiness, log, stop);
* :mod:`.clients`: the raw-socket SSE client (also the slow reader) and the httpx one;
* :mod:`.groups`: N concurrent streams against one server, and their summary;
* :mod:`.proc`: the ``/proc`` probes and the one definition of "CPU idle";
* :mod:`.stats`: percentiles, medians with ranges, markdown tables;
* :mod:`.decode_loop`: the bare llama.cpp decode loop (the ceiling), in process.

The method behind them is written once, in docs/benchmarks.md ("Method"). Only the public
``trioserve`` API and CLI are used. Scenario scripts put the repository root on
``sys.path`` and import ``benchmarks.harness``; tests import it the same way.
"""
