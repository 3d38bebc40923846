"""The reference training job of distscaler, as importable modules with one job each.

``launch/train.py`` is the entry script; it wires these together:

* ``config``: ``TrainConfig`` (every setting), YAML loading and validation.
* ``data``: the byte corpus, its train / held-out split, batches.
* ``model``: ``ByteGPT``, a compact nanoGPT-style decoder over bytes.
* ``optim``: the AdamW optimizer and the learning-rate schedule.
* ``distributed``: process group and device setup, object gathering.
* ``checkpoint``: ``ckpt.pt`` save / load with every rank's RNG state.
* ``evaluate``: held-out loss.
* ``metrics``: ``metrics.jsonl`` and ``summary.json``.
* ``loop``: the train step and the training loop.
"""

__all__: list[str] = []
