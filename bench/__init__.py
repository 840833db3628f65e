"""Herald's benchmarks: every scenario against its baseline, in one run (``python -m bench``).

See ``bench/RESULTS.md`` for a full run's numbers and what they mean.
"""
