"""Surviving a run: checkpoints (``checkpoint``: save with rotation, load), their integrity
manifests (``manifest``), finding what to resume (``resume``), loading on another number of
ranks (``universal``), the scan that keeps planted pickles out (``safeload``), the loss-spike
guard (``guard``), preemption and requeue (``preempt``), liveness (``heartbeat``) and the
fault drills (``faults``)."""
