"""Helpers shared by everything under ``launch/`` (the training jobs, the benchmark, the tests).

Imported as ``common`` with ``launch/`` on ``sys.path`` (a script in ``launch/`` has it; pytest's
``pythonpath`` setting gives it to the tests):

* ``distributed``: ``Dist`` (where this process stands), process group setup under torchrun,
  object gathering.
* ``rendezvous``: the store a process group starts from, fresh on every torchrun restart.
* ``tensors``: ``local_tensor`` (a DTensor's shard), ``params_digest`` (equal models, compared).
* ``wrapping``: ``fully_shard`` of blocks then root, DDP's ``device_ids``.
* ``probes``: ``PhaseTimer``, ``HostReadSpy``, ``CollectiveLog``, ``count_per_step``.
* ``requirements``: the packages a script needs, checked before it starts anything.
"""
