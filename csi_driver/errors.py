"""Errors of the driver's core, each carrying the CSI/gRPC status code it is answered with.

The core (``node``, ``controller``, ``attributes``) raises ``CsiError`` with a ``Code``; the gRPC
servicers turn it into a status (``server.py``) and the FlexVolume shim into a ``Failure`` reply
(``flex.py``). ``Code`` mirrors the gRPC status names, so the core needs no gRPC import and the
FlexVolume shim runs where grpcio is not installed.

Messages are one line and never contain a credential: they name the volume, the path, the
attribute key, the bucket; a value is quoted only for keys that are not secrets.

**What reaches Kubernetes reads as written** (``for_kubernetes``, applied where a status leaves the
gRPC server): the kubelet uses the message of a failed call as a Go format string, twice on the way
to a pod's Event (``GenerateErrorDetailed``'s ``fmt.Errorf``, then the recorder's ``Eventf``), so a
``%`` in it is garbled (``http%3A`` became ``http%!!(MISSING)A(MISSING)``, issue 36). No escape
survives an unknown number of passes; a message without ``%`` survives any. Dynamic volumes' ids
carry a percent-encoded endpoint (``v1:retain::http%3A%2F%2F...``): it is shown decoded
(``http://...``), and a ``%`` left after that is shown as the fullwidth sign ``％`` (U+FF05).
"""

from __future__ import annotations

import enum
import urllib.parse


class Code(enum.Enum):
    """The gRPC status codes CSI uses; the names are ``grpc.StatusCode`` member names."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ABORTED = "ABORTED"
    OUT_OF_RANGE = "OUT_OF_RANGE"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    INTERNAL = "INTERNAL"
    UNAVAILABLE = "UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"


class CsiError(Exception):
    """A request that cannot be served; ``code`` says how the CO should treat it."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return self.message


def invalid(message: str) -> CsiError:
    return CsiError(Code.INVALID_ARGUMENT, message)


def for_kubernetes(message: str) -> str:
    """``message`` without a ``%``, so that Go's fmt shows it as written (see the module docstring)."""
    if "%" not in message:
        return message
    return urllib.parse.unquote(message).replace("%", "\uff05")
