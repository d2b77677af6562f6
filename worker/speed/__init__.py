"""The kernels' own speed per commit (issue 18): each optimizer kernel of a build timed through its
project's adapter inside the kernel host (timing.py), with a device-to-device copy of the same
bytes as the card's bandwidth yardstick (timing.py), then stored with the run (record.py); the
comparison with the baseline's samples is service/core/speed_noise.py (numpy only, shared with the
service). docs/PERFORMANCE.md, "Kernel speed per commit".
"""
