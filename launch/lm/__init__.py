"""The reference training job of distscaler, as importable modules with one job each.

``launch/train.py`` is the entry script; it wires these together:

* ``config``: ``TrainConfig`` (every setting, the scaler's nested), YAML loading and validation.
* ``data``: the byte corpus, its train / held-out split, batches.
* ``model``: ``ByteGPT``, a compact nanoGPT-style decoder over bytes.
* ``optim``: the AdamW optimizer and the learning-rate schedule.
* ``layout``: ``Parallel``, the model laid out over the ranks.
* ``parallel``: one builder of a ``Parallel`` per ``--parallelism``; ``pipeline``: the stages.
* ``faults``: the inf written into one rank's gradient (``inject_inf``).
* ``checkpoint``: ``ckpt.pt`` (and DCP shards) save / load with every rank's RNG state.
* ``evaluate``: held-out loss.
* ``metrics``: ``metrics.jsonl`` and ``summary.json``; ``plot``: ``metrics.png``.
* ``agreement``: the end-of-run check that the ranks agree (both jobs).
* ``trainer``: the train step and ``Trainer`` (setup, step, finish).

The generic pieces (process group setup, digests, timers, counters) are in ``launch/common``.
"""

__all__: list[str] = []
