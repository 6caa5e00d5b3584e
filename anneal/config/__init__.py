"""Configuration: the typed run config (``run``) and its ``--set`` overrides and ranges
(``run_checks``); DeepSpeed JSON configs, read strictly (``ds``) against their schema
(``ds_schema``), with the run's values filled in where they say ``"auto"`` (``ds_resolve``); the
learning-rate schedule their ``scheduler`` section describes (``schedule``); and resolving one
launch for a world size and device before anything is written (``launch``)."""
