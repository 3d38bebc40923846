"""The pieces of ``launch/bench.py``: contenders, interleaved timing, sweeps and reports.

Imported as ``benchkit`` with ``launch/`` on ``sys.path`` (as ``launch/bench.py`` and the tests do);
the probes it counts with (host reads, collectives, timers) are in ``launch/common``.
"""
