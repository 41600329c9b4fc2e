"""Keeping credentials out of logs and error messages.

Two layers, because one mistake should not be enough to leak a key:

1. **Structural.** ``sanitize`` renders a protobuf request for the log with every field that the
   CSI proto marks ``[(csi_secret) = true]`` replaced by ``***`` (the approach of the Kubernetes CSI
   ``protosanitizer``): secrets maps never reach a formatter at all.
2. **By value.** ``SecretRegistry`` remembers every secret value the driver has been handed (from
   CSI secrets and FlexVolume options), and ``RedactingFormatter`` replaces any occurrence of one
   in a finished log line, traceback included. It catches what the first layer cannot see: a
   library or a child process that echoes a value back in an error message.
   ``SecretRegistry.scrub`` applies the same replacement to error messages returned to the CO.

The registry is bounded (least recently registered values are forgotten first) and holds values
only in this process's memory, where the requests already put them.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any, Iterable

MASK = "***"
# Values remembered by the registry. Each mounted volume contributes up to three; a node runs far
# fewer than a thousand volumes, so nothing still in use is forgotten.
MAX_REMEMBERED_SECRETS = 4096
# Shorter values are not redacted by value: masking every "a" or "1" in a log would garble it, and
# real access keys (16+ characters) and secrets (40) are far longer.
MIN_SECRET_LENGTH = 6


class SecretRegistry:
    """Secret values seen by this process, to be masked wherever they would be printed."""

    def __init__(self, capacity: int = MAX_REMEMBERED_SECRETS) -> None:
        self._values: OrderedDict[str, None] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def add(self, values: Iterable[str]) -> None:
        with self._lock:
            for value in values:
                if len(value) < MIN_SECRET_LENGTH:
                    continue
                self._values[value] = None
                self._values.move_to_end(value)
            while len(self._values) > self._capacity:
                self._values.popitem(last=False)

    def scrub(self, text: str) -> str:
        with self._lock:
            values = sorted(self._values, key=len, reverse=True)  # longest first: no partial leftovers
        for value in values:
            if value in text:
                text = text.replace(value, MASK)
        return text


REGISTRY = SecretRegistry()


class RedactingFormatter(logging.Formatter):
    """A ``logging.Formatter`` whose output never contains a registered secret value."""

    def __init__(self, fmt: str | None = None, registry: SecretRegistry = REGISTRY, **kwargs: Any) -> None:
        super().__init__(fmt, **kwargs)
        self.registry = registry

    def format(self, record: logging.LogRecord) -> str:
        return self.registry.scrub(super().format(record))


def sanitize(message: Any) -> str:
    """A one-line text form of a protobuf message with every ``csi_secret`` field masked."""
    from google.protobuf import text_format

    from csi_driver.proto import csi_pb2

    copy = type(message)()
    copy.CopyFrom(message)
    _mask_secrets(copy, csi_pb2.csi_secret)
    return text_format.MessageToString(copy, as_one_line=True)


def _mask_secrets(message: Any, extension: Any) -> None:
    for descriptor, value in message.ListFields():
        options = descriptor.GetOptions()
        if options.HasExtension(extension) and options.Extensions[extension]:
            if descriptor.message_type is not None and descriptor.message_type.GetOptions().map_entry:
                keys = list(value.keys())
                for key in keys:
                    value[key] = MASK
            else:
                message.ClearField(descriptor.name)
            continue
        if descriptor.message_type is None:
            continue
        if descriptor.message_type.GetOptions().map_entry:
            continue  # plain string maps (volume_context, parameters): not secret by the spec
        items = value if descriptor.is_repeated else [value]
        for item in items:
            _mask_secrets(item, extension)
