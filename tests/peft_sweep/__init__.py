"""The PEFT tuner sweep (issue 38): ``sweep.py`` (the logic), ``tuners.py`` (the configs), ``test_peft_sweep.py``."""
