"""A record of every engine step a serving process ran: when, and what was in the batch.

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

FLUSH_EVERY_S = 1.0  # a trace read while the server runs is at most this stale


def step_rows(sched) -> list[list[int]]:
    """[tokens computed before, tokens computed in the step, 1 if a decode] per scheduled
    sequence of a step that has run (the step has already advanced the counts)."""
    rows = []
    for s in sched.scheduled:
        n = s.num_new_tokens
        done = s.seq.num_computed_tokens - n
        rows.append([done, n, int(n == 1 and done >= s.seq.num_prompt_tokens)])
    return rows


class StepTraceWriter:
    """Appends step records to `path`; only the engine thread calls `record`."""

    def __init__(self, path: str):
        self.path = path
        self._f = open(path, "a", encoding="utf-8")
        self._flushed = time.monotonic()

    def record(self, t0: float, t1: float, sched, idle: bool, cpu: float | None = None) -> None:
        if sched is None or not sched.scheduled:
            return
        rec = {"t0": round(t0, 6), "t1": round(t1, 6)}
        if cpu is not None:
            rec["cpu"] = round(cpu, 6)
        rec.update(idle=idle, seqs=step_rows(sched))
        self._f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        if t1 - self._flushed > FLUSH_EVERY_S:
            self._f.flush()
            self._flushed = t1

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
