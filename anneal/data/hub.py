"""Reaching a Hugging Face dataset for an ``hf:`` input: ``datasets.load_dataset``, failing
within seconds and with a fix when the Hub cannot be reached, instead of hanging in retries.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

from anneal.data.readers import ReadOptions
from anneal.data.sources import Source
from anneal.errors import UserError

HUB_TIMEOUT_S = 5.0


def _hub_offline() -> bool:
    return any(
        os.environ.get(k, "").lower() in ("1", "true", "yes", "on")
        for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def _probe_hub(spec: str, timeout_s: float = HUB_TIMEOUT_S) -> None:
    """Fail within ``timeout_s`` when the Hub cannot be reached, instead of hanging in retries
    (name resolution has no timeout of its own, so it runs in a thread)."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    outcome: list[BaseException | None] = []

    def connect():
        try:
            socket.create_connection((url.hostname, port), timeout=timeout_s).close()
            outcome.append(None)
        except OSError as e:
            outcome.append(e)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome or outcome[0] is not None:
        why = f"{outcome[0]}" if outcome else f"no answer within {timeout_s:.0f} s"
        raise UserError(
            f"--input {spec}: cannot reach the Hugging Face Hub at {endpoint} ({why}); this "
            f"machine looks offline. To use a copy in the local cache, set HF_HUB_OFFLINE=1; "
            f"otherwise save the dataset on a machine with network access "
            f"(datasets' save_to_disk) and pass that directory as --input."
        )


def load_hub_dataset(source: Source, opts: ReadOptions):
    """``datasets.load_dataset`` for an ``hf:`` input, failing fast and clearly offline."""
    local = Path(source.path).exists()
    offline = _hub_offline()
    if not local and not offline:
        _probe_hub(source.spec)
    import datasets

    streaming = opts.streaming or source.query.get("streaming", "") in ("1", "true", "yes")
    try:
        ds = datasets.load_dataset(
            source.path,
            source.query.get("config"),
            split=source.query.get("split", "train"),
            revision=source.query.get("revision"),
            streaming=streaming,
        )
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; all end here
        hint = (
            " HF_HUB_OFFLINE is set, so only the local cache is used and this dataset is not "
            "in it: unset it on a machine with network access, or pass a local copy."
            if offline and not local
            else " Check the name, config= and split=."
        )
        raise UserError(
            f"--input {source.spec}: datasets.load_dataset failed ({type(e).__name__}: {e}).{hint}"
        ) from None
    return ds
