"""The pieces of ``launch/bench.py``: contenders, interleaved timing, counters, sweeps and reports.

Imported as ``benchkit`` with ``launch/`` on ``sys.path`` (as ``launch/bench.py`` and the tests do).
"""
