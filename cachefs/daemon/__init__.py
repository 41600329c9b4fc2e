"""The daemon floor: one process per mount (``cachefs.daemon.main``) and its features.

Features (write-back, prefetch jobs, metrics) are wired by direct import in ``cachefs.daemon.main``
and build on a ``DaemonContext`` (``cachefs.daemon.context``); the control API
(``cachefs.daemon.control``) serves the ``/stats`` document (``cachefs.daemon.stats``) and their
routes.
"""
