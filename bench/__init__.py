"""eksft-nb's benchmarks: ``python -m bench`` (``--quick`` for the short version). See README.md."""
