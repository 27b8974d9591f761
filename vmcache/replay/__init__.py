"""Policy replay: drive the real heat model and planner with a block trace, offline.

``trace`` reads and writes traces (CSV, fio iolog import), ``generate`` makes
synthetic ones, ``sim`` replays a trace through vmcache, plain LRU, Belady
and static top-k caches of the same size, ``report`` prints the table and
draws the plot. Nothing here touches the host; time is the trace's.
See docs/replay.md.
"""
