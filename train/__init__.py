"""Training: a Lightning module and data module that train any registered draft head on the cache.

* :mod:`train.data` — :class:`~train.data.CacheDataModule`: length-aware, seeded, rank-sharded batches.
* :mod:`train.module` — :class:`~train.module.DraftHeadModule`: AdamW + warmup schedule around a head.
* :mod:`train.checkpoint_io` — :class:`~train.checkpoint_io.SafetensorsCheckpointIO`: resume state without pickle.
* :mod:`train.run` — the trainer, loggers, checkpointing and the final export; CLI ``python -m train``.
"""
