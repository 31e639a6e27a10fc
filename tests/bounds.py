"""Bounds of the suite's waits: they catch a hang, they do not measure speed.

On the 2-core machine this suite runs on, shared with other runs (load average ~17), a
producer took 90 s only to import torch and reach its loop. Bounds that include starting a
process are therefore generous. Waits on a process also fail at once, with its exit code
and log tail, when it dies, so a generous bound costs nothing when something is broken.
"""

START = 300.0  # a process starting (imports torch, loads the demo model) and its first work
RUN = 600.0  # a process running a short test run to its exit
