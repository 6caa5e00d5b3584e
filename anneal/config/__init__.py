"""Configuration, the typed schema and its checks: the run config (``run``) and its ``--set``
overrides and ranges (``run_checks``); the DeepSpeed JSON schema (``ds_schema``); the
learning-rate schedule a ds_config's ``scheduler`` section describes (``schedule``). Nothing here
reads a disk beyond the schema's own defaults: resolving a launch is ``anneal.resolution``."""
