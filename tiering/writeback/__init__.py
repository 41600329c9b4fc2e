"""Write-back of files written through the mount: durable staging on local disk, then upload.

``facade``     ``WriteBack``: the facade the filesystem uses, and a staged file's life cycle.
``pending``    ``PendingIndex``: every key's pending operation and the namespace overlay on them.
``markers``    directory semantics: mkdir/rmdir/ensure_dir markers and their ordering rules.
``uploader``   ``Uploader`` and ``Barriers``: scheduling, per-key order, retries, flush barriers.
``records``    ``Records``: the journal's acknowledgements on disk (``journal`` is their format).
``durable``    ``DurableJournal``: with --write-durability cluster, the journal's copy in the cluster store.
``recovery``   ``recover_prefix``: a lost writer's copy replayed into the source (``cachefs recover``).
``datafiles``  ``DataFiles``: staged data files, their space, copy-in and copy-on-write.
``files``      ``StagedFiles``: the live staged files by key, disposal, unloading, promotion.
``space``      ``StagingSpace``: reservations in the budget and writers' back-pressure.
``staged``     the in-memory state of one staged file; ``report`` the status and stats views;
``settings``   the knobs and their reasons; ``budget`` the in-memory ``SpaceBudget`` double.
"""

from tiering.writeback.budget import InMemoryBudget
from tiering.writeback.facade import MISSING, STAGED_ETAG, FlushReport, UploadError, WriteBack
from tiering.writeback.settings import WriteBackSettings

__all__ = ["InMemoryBudget", "MISSING", "STAGED_ETAG", "FlushReport", "UploadError", "WriteBack", "WriteBackSettings"]
