"""The tools around training: its outputs and snapshots, the live viewer and its camera paths, the
scaling measurements and the cost model, the timeline, and the built-in demo."""
