"""Resolving one launch, before anything is written or any engine is built: the DeepSpeed JSON
found, read strictly and overridden (``ds``), its ``"auto"`` values filled from the run
(``ds_resolve``), the parallel layout (``parallel``), the model (``preset``), a cooldown branch's
parent (``cooldown``), and all of it with the data and the checkpoint to resume into one
``Launch`` (``resolve``). The typed schema these read is ``anneal.config``."""
