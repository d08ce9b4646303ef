"""Placement over time (issue 34, offline half): drift statistics per window, re-placement policies (the engines'
EPLB schedules, Sem-MoE re-fitted on measured drift, static references, per-window hindsight) and the drift job that
scores them window by window with the offline evaluator. docs/drift.md says what it measures and how to run it."""
