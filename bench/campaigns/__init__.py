"""The fault campaigns that bench scripts run in full and CI tests run in part: the seeded SIGKILL
campaign (``sigkill``: bench/fault_campaign.py, tests/resilience/test_campaign.py) and the
damaged-input campaign (``damage`` with ``corruptions``, run by ``damage_runner``:
bench/damaged_inputs.py, tests/resilience/test_damaged_inputs.py). A bench script puts the
repository on ``sys.path`` and imports ``bench.campaigns``; nothing here imports ``tests``."""

# The miniature model both campaigns train (the ``tiny`` preset with these overrides; the tests'
# MINI model): 2 layers of width 32, 2 experts, batches of 2 x 32 tokens, one held-out batch.
MODEL = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, num_experts=2)
MODEL.update(moe_intermediate_size=32, router_hidden_size=8)
MINI_MODEL = [f"model.{key}={value}" for key, value in MODEL.items()]
MINI = [*MINI_MODEL, "train.batch_size=2", "train.seq_len=32", "eval.batches=1"]
