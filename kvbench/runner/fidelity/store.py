"""Full-cache references on disk, computed once and shared by every policy and budget scored against them.

A reference stores the full cache's output tokens and, per step, its top-``K`` next-token log-probabilities
(see :mod:`kvbench.runner.fidelity.metrics`). One JSON file per reference, ``<root>/<sha256 of the key>.json``
(what the key holds: :mod:`kvbench.runner.fidelity.references`). Writes are atomic (temp file + rename) and a
per-key ``flock`` makes concurrent processes compute each reference once: the second one waits and then reads
the first one's file.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvbench.runner.fidelity.metrics import LogitSummary

log = logging.getLogger("kvbench")

FORMAT_VERSION = 1
# Full-cache tokens kept per step for the KL (plus one bucket for the rest of the vocabulary).
TOP_K = 256
REFERENCE_DIR_ENV = "KVBENCH_REFERENCES"


@dataclass
class Reference:
    """The full cache's output for one example: tokens, text and per-step top-K log-probabilities."""

    tokens: list[int]
    text: str
    stop_reason: str
    summary: LogitSummary
    argmax: list[int] = field(default_factory=list)  # the full cache's most likely token per step
    nll: list[float] | None = None  # teacher-forced references: NLL of each forced token
    key: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "key": self.key,
            "tokens": self.tokens,
            "text": self.text,
            "stop_reason": self.stop_reason,
            "argmax": self.argmax,
            "nll": self.nll,
            "shape": list(self.summary.ids.shape),
            "topk_ids": _pack(self.summary.ids.numpy().astype(np.int32)),
            "topk_logprobs": _pack(self.summary.logprobs.numpy().astype(np.float32)),
            "rest_logprob": _pack(self.summary.rest.numpy().astype(np.float32)),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Reference:
        shape = tuple(data["shape"])
        summary = LogitSummary(
            ids=torch.from_numpy(_unpack(data["topk_ids"], np.int32).reshape(shape)).long(),
            logprobs=torch.from_numpy(_unpack(data["topk_logprobs"], np.float32).reshape(shape)),
            rest=torch.from_numpy(_unpack(data["rest_logprob"], np.float32).reshape(shape[:1])),
        )
        return cls(
            tokens=list(data["tokens"]),
            text=data["text"],
            stop_reason=data["stop_reason"],
            summary=summary,
            argmax=list(data["argmax"]),
            nll=data.get("nll"),
            key=data.get("key", {}),
        )


def _pack(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes()).decode()


def _unpack(text: str, dtype: Any) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype)


def key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]


# ---------------------------------------------------------------- store


class ReferenceStore:
    """References under one directory; each is computed at most once, across processes too."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self._memory: dict[str, Reference] = {}
        self.computed = 0  # how many references this store computed (the rest were read)

    def path(self, key: dict[str, Any]) -> Path:
        return self.root / f"{key_digest(key)}.json"

    def load(self, key: dict[str, Any]) -> Reference | None:
        digest = key_digest(key)
        if digest in self._memory:
            return self._memory[digest]
        path = self.root / f"{digest}.json"
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            log.warning("unreadable reference %s (%s); recomputing it", path, err)
            return None
        if data.get("format") != FORMAT_VERSION or data.get("key") != json.loads(json.dumps(key, default=str)):
            return None
        ref = Reference.from_json(data)
        self._memory[digest] = ref
        return ref

    def get_or_create(self, key: dict[str, Any], compute: Callable[[], Reference]) -> Reference:
        """The stored reference for ``key``, computing and storing it first if nobody has."""
        found = self.load(key)
        if found is not None:
            return found
        self.root.mkdir(parents=True, exist_ok=True)
        digest = key_digest(key)
        with (self.root / f".{digest}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process computing it: wait, then read its file
            try:
                found = self.load(key)
                if found is not None:
                    return found
                ref = compute()
                ref.key = json.loads(json.dumps(key, default=str))
                path = self.root / f"{digest}.json"
                tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
                tmp.write_text(json.dumps(ref.to_json()), encoding="utf-8")
                os.replace(tmp, path)
                self.computed += 1
                self._memory[digest] = ref
                return ref
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


_STORES: dict[str, ReferenceStore] = {}


def store_at(root: str | os.PathLike) -> ReferenceStore:
    """One store object per directory and process, so its in-memory copies are reused across cells."""
    path = str(Path(root).expanduser().resolve())
    if path not in _STORES:
        _STORES[path] = ReferenceStore(path)
    return _STORES[path]


def default_reference_dir() -> Path:
    """Where references go when the caller names no directory (``kvbench-run`` uses
    ``<results_dir>/.references``): ``$KVBENCH_REFERENCES``, else ``$KVBENCH_CACHE/references``."""
    explicit = os.environ.get(REFERENCE_DIR_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("KVBENCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kvbench"
    )
    return Path(base) / "references"
