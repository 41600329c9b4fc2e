"""Write-back of files written through the mount: durable staging on local disk, then upload.

``WriteBack`` (``engine``) is the engine; ``journal`` is the on-disk format of the staging area;
``staged`` the in-memory state of one staged file; ``settings`` the knobs and their reasons.
"""

from tiering.writeback.budget import InMemoryBudget
from tiering.writeback.engine import MISSING, STAGED_ETAG, FlushReport, UploadError, WriteBack
from tiering.writeback.settings import WriteBackSettings

__all__ = ["InMemoryBudget", "MISSING", "STAGED_ETAG", "FlushReport", "UploadError", "WriteBack", "WriteBackSettings"]
