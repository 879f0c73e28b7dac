"""The simulator's calibration: a step cost fitted to this machine's measured steps, its links and
the request path's latencies, one versioned record (`record.Calibration`) that names the machine
and the versions it came from."""
