"""Prefetch: the LoRA files of a prompt queued behind a running one, read into the adapter cache while it waits.

A prompt posted while another runs waits in ComfyUI's queue. Meanwhile one daemon thread reads the LoRA files it
names (`prompt_files(prompt).loras`) into the process-wide adapter cache, so that it starts with them parsed. The
images do not change: the thread only fills the cache, by the loader's own read (`bridge.preload_lora`, the key and
converter of `bridge.load_lora`), and the prompt's loader then finds each adapter kept, waits for a read still in
flight (the cache reads a file once), or reads the file itself.

- Only behind a running prompt: a prompt posted to an idle server starts at once and reads its own files.
- The cache's bounds hold, and no LoRA file of the running prompt is evicted for one read ahead. Those files are
  protected, resolved when the thread takes the queued prompt (a prompt that has started since counts), and so are
  the files already read ahead for the queued prompt. A file that could be kept only by evicting one of them is
  not kept (`not_kept`): the prompt reads it itself.
- A name that does not resolve, or a file that does not read, is the prompt's to report: one debug line, and the
  thread goes on to the next file.
- A `<lora:…>` tag of LoRAStackFromPrompt names a LoRA by stem or path: a name that is no file of the loras
  folders is resolved against their listing as the node resolves it (`prompt_tags.resolve_name`); one that
  resolves to no file or to several is left out (counted as `failed`).
- ComfyUI runs its on-prompt hook before it validates the prompt: a prompt it then refuses has had its files read
  ahead all the same (files of the loras folders, into the cache only).

$MULTILORA_PREFETCH=0 in ComfyUI's environment turns it off (`enabled`). `stats()` is the "prefetch" part of
GET /multilora/status: prompts read ahead for, files read (and kept), files
found already cached (kept, held by a model, or being read), files not kept, files that failed, and prompts waiting
for the thread.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Iterable, Mapping

from ..lora_engine import LoRAError, LoRAFileError
from ..lora_engine.cache import Preload
from ..lora_engine.stack.prompt_files import prompt_files
from ..lora_engine.stack.prompt_tags import TagError, resolve_name

from . import bridge

log = logging.getLogger("multilora")

COUNTERS = ("prompts", "read", "cached", "not_kept", "failed")
ENV = "MULTILORA_PREFETCH"  # "0", "off" or "false" in ComfyUI's environment: no reading ahead


def enabled() -> bool:
    """Whether the server reads ahead ($MULTILORA_PREFETCH unset, or anything but 0, off, false, no)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


class Prefetcher:
    """Reads ahead the LoRA files of prompts queued behind a running one, on one daemon thread fed by a queue."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[frozenset[str]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._pending = 0

    def queued(self, prompt: Mapping[str, object]) -> None:
        """For each prompt posted to the server (in its event loop, so it returns at once): where another prompt
        runs, hand the prompt's LoRA names to the thread, which is started on the first."""
        if not bridge.running_prompts():
            return
        names = prompt_files(prompt).loras
        if not names:
            return
        with self._lock:
            self._counts["prompts"] += 1
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="multilora-prefetch", daemon=True)
                self._thread.start()
        self._jobs.put(names)

    def stats(self) -> dict:
        with self._lock:
            return {**self._counts, "pending": self._pending}

    def _work(self) -> None:
        while True:
            names = self._jobs.get()
            try:
                self.read_ahead(names)
            except Exception:  # a fault of this thread: logged with its traceback; the next prompt is read ahead
                log.exception("[MultiLoRA] prefetch failed on a queued prompt's LoRAs; its loader reads them")
            finally:
                with self._lock:
                    self._pending -= 1

    def read_ahead(self, names: Iterable[str]) -> None:
        """Read the LoRA files `names` (as a prompt names them) into the cache, keeping each only where that
        evicts no file of the running prompt, nor one read ahead before it for the same prompt."""
        listing = bridge.lora_names()
        protected = set()
        for running in bridge.running_prompts():
            for name in prompt_files(running).loras:
                try:
                    protected.add(loader_file(name, listing)[1])
                except (LoRAFileError, TagError):
                    continue  # a file the running prompt cannot read is no file it holds
        for name in sorted(names):
            try:
                loaded, path = loader_file(name, listing)
                outcome = bridge.preload_lora(loaded, protected)
            except (LoRAError, TagError) as e:
                self._count("failed")
                log.debug("[MultiLoRA] prefetch: %r left for its prompt to read and report: %s", name, e)
                continue
            self._count(outcome.value)
            if outcome is not Preload.NOT_KEPT:
                protected.add(path)

    def _count(self, counter: str) -> None:
        with self._lock:
            self._counts[counter] += 1


def loader_file(name: str, listing: list[str]) -> tuple[str, str]:
    """The name a prompt's loader reads `name` under, and its real path: a file of the loras folders as named, else
    a tag's name resolved among `listing` as LoRAStackFromPrompt resolves it. Raises the name's `LoRAFileError`
    where it is neither."""
    try:
        return name, bridge.resolve("loras", name)
    except LoRAFileError as missing:
        try:
            found = resolve_name(name, listing)
        except TagError:
            raise missing from None
        return found, bridge.resolve("loras", found)


PREFETCH = Prefetcher()
