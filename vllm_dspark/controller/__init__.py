"""The load-aware controller: load signals, online cost model, calibration,
and the per-step choice of how many drafted tokens each request verifies."""
