"""Fault-tolerance engines beside NVRx, which the rest of the package is built around (``--engine``)."""
