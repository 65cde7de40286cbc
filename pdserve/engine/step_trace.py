"""A record of every engine step a serving process ran: when, and what was in the batch.

Steps are timed once, by the engine: `LLMEngine.add_step_observer(fn)` has
`fn(StepRecord)` called after every step that ran something. The step trace
below is one observer; the live calibration of a worker's cost models
(server/calibrate.py) and the simulator's calibration (sim/calibrate.py) are
others.

`pdserve serve --step-trace FILE` (and `pdserve worker --step-trace FILE`)
append one JSON line per step:

    {"t0": 812.402113, "t1": 812.449870, "cpu": 0.047210, "idle": false, "seqs": [[192, 64, 0], [71, 1, 1]]}

- `t0` / `t1`: `time.monotonic()` around `LLMEngine.step` (one clock for every
  process of the host, so a client and several workers line up);
- `cpu`: CPU seconds the engine thread itself used in the step
  (`time.thread_time()`): with one torch thread, a `cpu` well under `t1 - t0`
  means the step waited for a core (other processes, the server's own event
  loop), where a longer `cpu` means the work itself was slower;
- `idle`: the engine thread waited for work before this step (so the time
  since the previous step is not that step's);
- `seqs`: per scheduled sequence, tokens already computed, tokens computed in
  this step, and 1 when it was a decode (one token past the prompt).

The simulator fits its per-iteration latency to these (`pdserve sim
--calibrate --served` / `--from-trace`): a step timed inside the server pays
what serving adds to it (the event loop taking the GIL for detokenised
deltas and SSE frames, the KV hand-off hooks), which a profile of the engine
alone misses.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

FLUSH_EVERY_S = 1.0  # a trace read while the server runs is at most this stale


def step_rows(sched) -> list[list[int]]:
    """[tokens computed before, tokens computed in the step, 1 if a decode] per scheduled
    sequence of a step that has run (the step has already advanced the counts)."""
    rows = []
    for s in sched.scheduled:
        n = s.num_new_tokens
        # a row with drafts (speculative decoding) advanced by its accepted tokens only
        done = s.seq.num_computed_tokens - (n - s.num_rejected)
        rows.append([done, n, int(n == 1 and done >= s.seq.num_prompt_tokens)])
    return rows


@dataclass
class StepRecord:
    """One engine step that ran something, as the engine hands it to its step observers."""

    t0: float  # time.monotonic() when the step began
    t1: float  # ... and when it ended
    cpu_s: float  # CPU seconds the engine thread used in it (time.thread_time())
    rows: list[list[int]]  # `step_rows` of what it ran, taken when it ended
    # the engine was found with nothing to do (has_unfinished_requests() false) since its
    # previous step: whoever drives it waited for work in between
    idle: bool = False
    calibration: bool = False  # it ran calibration requests (server/calibrate.py), not traffic

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0


class StepTraceWriter:
    """Appends step records to `path`; `record` is an engine step observer (engine thread only)."""

    def __init__(self, path: str):
        self.path = path
        self._f = open(path, "a", encoding="utf-8")
        self._flushed = time.monotonic()

    def record(self, step: StepRecord) -> None:
        if step.calibration:  # the trace is of served steps
            return
        rec = {
            "t0": round(step.t0, 6),
            "t1": round(step.t1, 6),
            "cpu": round(step.cpu_s, 6),
            "idle": step.idle,
            "seqs": step.rows,
        }
        self._f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        if step.t1 - self._flushed > FLUSH_EVERY_S:
            self._f.flush()
            self._flushed = step.t1

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def open_step_trace(path: str | None) -> StepTraceWriter | None:
    """The writer for a `--step-trace` flag; a path that cannot be written is a start-up error."""
    if not path:
        return None
    try:
        return StepTraceWriter(path)
    except OSError as e:
        raise ValueError(f"--step-trace {path}: {e.strerror or e}") from None


def read(path: str, since: float | None = None, until: float | None = None) -> list[dict]:
    """The records whose step started in [since, until]; a torn last line (a server killed
    mid-write) is skipped, any other bad line names the file and line."""
    out = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            t0, t1, seqs = float(rec["t0"]), float(rec["t1"]), rec["seqs"]
            if not isinstance(seqs, list) or t1 < t0:
                raise ValueError("t1 before t0" if t1 < t0 else "seqs is not a list")
        except (ValueError, KeyError, TypeError) as e:
            if i == len(lines):
                break  # the last line, cut short (no newline after it)
            raise ValueError(f"{path}:{i}: not a step-trace record ({e})") from None
        if (since is None or t0 >= since) and (until is None or t0 <= until):
            out.append(rec)
    return out
