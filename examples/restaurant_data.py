"""A small E2E-style table-to-text task generated on the fly (no download): restaurant attributes -> sentence.

Used by ``examples/demo.py`` (``make demo``) and the example smoke tests; real data sets (E2E, DART) go through
``examples/table_to_text.py``.
"""

from __future__ import annotations

import random

NAMES = [
    "The Eagle",
    "Blue Spice",
    "The Mill",
    "Aromi",
    "Zizzi",
    "The Golden Curry",
    "Alimentum",
    "The Punter",
    "Fitzbillies",
    "Giraffe",
    "Loch Fyne",
    "The Waterman",
    "Cotto",
    "Clowns",
    "Strada",
    "Wildwood",
]
FOODS = ["Italian", "French", "Chinese", "Indian", "Japanese", "English", "fast food"]
AREAS = ["riverside", "city centre"]
PRICES = ["cheap", "moderate", "high"]
RATINGS = ["low", "average", "high"]

TEMPLATES = [
    "{name} serves {food} food in the {area} area .",
    "{name} is a {price} {food} restaurant in the {area} .",
    "In the {area} , {name} offers {price} {food} food with a {rating} rating .",
    "{name} is a {food} place with {price} prices and a {rating} customer rating .",
]


def make_example(rng: random.Random) -> dict[str, str]:
    """One meaning representation (``key[value] | ...``) and a matching reference sentence."""
    attrs = {
        "name": rng.choice(NAMES),
        "food": rng.choice(FOODS),
        "area": rng.choice(AREAS),
        "price": rng.choice(PRICES),
        "rating": rng.choice(RATINGS),
    }
    template = rng.choice(TEMPLATES)
    used = [k for k in ("name", "food", "price", "rating", "area") if "{" + k + "}" in template]
    table = " | ".join(f"{k} [ {attrs[k]} ]" for k in used)
    return {"table": table, "text": template.format(**attrs)}


def make_dataset(n: int, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    return [make_example(rng) for _ in range(n)]
