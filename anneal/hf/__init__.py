"""Hugging Face I/O. In: ``load`` (a model directory to continue pretraining from, read and
checked when the launch resolves: ``--init-from``) and ``load_weights`` (its tensors copied into
the training model, ZeRO-3 partitioned). Out: ``export`` (a run's checkpoint -> a verified
Hugging Face model directory), built from ``source`` (what is read from the run, checked first),
``reader`` (torch zip files read lazily), ``zero`` (the ZeRO layouts and the reference reader),
``writer`` (safetensors, configs, tokenizer) and ``verify``; and ``generate`` (sample from an
export). The training loop imports only ``load`` and ``load_weights`` from here: a run's
per-save export is a child process (``anneal export``)."""
