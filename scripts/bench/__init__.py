"""The benchmark sweep's package (``scripts/sweep.py``); ``peers/`` holds the outside implementations it times."""
