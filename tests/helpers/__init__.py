"""What the tests share, in one place (``tests/`` is on ``sys.path``: ``from helpers.oracle import ...``).

* :mod:`.oracle`: the float64 per-example oracle (one autograd call per example), independent of hf_dp's rules;
* :mod:`.models`: the tiny models built from configs (no Hub) and their per-example losses;
* :mod:`.trainer`: toy datasets, collators, DP arguments and the exact-update check of one DP step;
* :mod:`.user_level`: a multi-author dataset and the user-level settings;
* :mod:`.distributed`: two gloo processes on the CPU (DDP, FSDP2).
"""
