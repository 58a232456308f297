"""Tools that explain a run after the fact: Flight Recorder traces of collectives (flight_recorder.py),
profiler traces and memory snapshots (profiling.py)."""
