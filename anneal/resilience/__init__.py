"""Surviving a run: checkpoints with integrity manifests (``checkpoint``), the scan that
keeps planted pickles out (``safeload``), the loss-spike guard (``guard``), preemption and
requeue (``preempt``), liveness (``heartbeat``) and the fault drills (``faults``)."""
