"""The policy floor: the bookkeeping the engine and the tiers consult; it holds no block and calls no store.

``readahead``  ``ReadAhead``: the sequential read-ahead window of one open file handle.
``readorder``  ``ReadOrder``: announced read orders, their positions and each block's next use.
``victims``    ``rank_victims``: LRU order, or farthest next use first under a ``VictimOrder``.
``pins``       ``PinTable``: the pinned object versions, the bytes they will take, and the pin file.

Independent of ``tiering.objectstore``, the other room on this floor; both stand on the leaf modules.
"""
