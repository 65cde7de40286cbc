"""Discrete-event simulator of a serving cluster (`pdserve sim`).

The contract: a `LatencyModel` (latency.py) says how long one engine
iteration of a given `StepShape` takes; everything else is the real thing.
Each simulated instance (instance.py) drives the engine's own Scheduler and
BlockManager; the cluster (cluster.py) places requests with the router's own
Placer and Admitter and replays workloads from pdserve/bench, reporting
pdserve bench's metrics. events.py is the clock; workload.py the requests;
calibrate.py measures our engine here to fit a `ProfileLatency`.
"""
