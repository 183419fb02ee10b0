"""The shaped-link lab: N namespace hosts x P processes, each host's link limited with ``tc``.

``python -m bench.lab --help``. Modules: :mod:`.net` (shaping, iperf3, interface counters),
:mod:`.workloads` (what runs, side by side with its peer), :mod:`.records` (step time, bytes on
the wire, wire efficiency), :mod:`.models` (the CNN), ``workers/`` (the processes on the hosts).
"""
