"""The ground floor: what every stage uses and which uses no stage.

- ``ops``: the operations of a plan (``Keep``, ``Recompute``, ``RecomputeSub``) and their JSON form;
- ``trace``: the training-step harness (one iteration of the user's loop, exact peaks, timings);
- ``probe``: forward/backward events of each block, for the profile and the timeline;
- ``runtime``: the span runtime that records and replays checkpointed blocks;
- ``wrapped``: seeing through DDP/FSDP wrappers, and the process group's rank.

The stages (profile → plan → apply → measure → report → cli) import only from here and from the
stages before them (tests/test_layers.py checks it).
"""
