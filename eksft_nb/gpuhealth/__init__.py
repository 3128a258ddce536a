"""GPU health per node from NVML: XID errors, ECC counts, clock throttling, temperature, power, in
three processes, one module each: :mod:`.sampler` in local rank 0 of every node reads NVML into
``gpu_health`` and ``gpu_fault`` events; :mod:`.fold` is what the monitor (wherever events are read)
keeps of them; :mod:`.export` serves that under the DCGM exporter's metric names. :mod:`.readings` is
their shared vocabulary: NVML's codes in words, and a ``gpus`` entry read back.

A recorded ``pynvml`` stand-in that runs the whole path without a GPU is in the tests
(``tests/nvml_replay.py``).
"""
