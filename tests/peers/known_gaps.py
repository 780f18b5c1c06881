"""Peer configurations that are silently wrong, crash, or are wrongly refused by today's engine (issue 17).

Key: ``"<config>@<mode>"`` (one clipping mode) or ``"<config>"`` (every mode); value: one line saying why.
Tests listed here are ``xfail(strict=True)``: remove the entry when the engine is fixed (that is the only edit
anyone else makes in tests/peers/). First recorded against the engine of commit d8d0c5c (278 entries, 2026-12-01);
empty since the engine rebuild of issue 17: every configuration is exact, or refused with a clear message where a
refusal is acceptable (the configuration's ``refusable``). ``.venv/bin/python tests/peers/report.py`` prints every
configuration's outcome; ``report.py --gaps`` lists failing rows missing here and entries whose rows now pass.
"""

KNOWN_GAPS: dict[str, str] = {}
