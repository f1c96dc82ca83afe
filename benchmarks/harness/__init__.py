"""The benchmark harness: what every scenario in ``benchmarks/`` shares — its modules (the command line
and run loop, the launchers, the clients, N concurrent streams, the ``/proc`` probes and the one "CPU
idle", statistics, the bare decode loop): benchmarks/README.md, "Layout"; the method: docs/benchmarks.md,
"Method". Only the public ``trioserve`` API and CLI are used. Scenario scripts put the repository root on
``sys.path`` and import ``benchmarks.harness``; tests import it the same way.
"""
