"""Surviving a run: checkpoints (``checkpoint``: save with rotation, load), their integrity
manifests (``manifest``), finding what to resume (``resume``), loading on another number of
ranks (``universal``), the weights-only reading of every
checkpoint file (``safeload``), the loss-spike
guard (``guard``), preemption and requeue (``preempt``), liveness (``heartbeat``) and the
fault drills (``faults``)."""
