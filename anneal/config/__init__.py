"""Configuration: the run config and its strict loader (``run``), DeepSpeed JSON configs and
their checks (``ds``), the learning-rate schedule their ``scheduler`` section describes
(``schedule``), and resolving one launch for a world size and device before anything is
written (``launch``)."""
