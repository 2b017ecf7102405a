"""Deterministic English-like text for `fleet bench` workloads, made here from a seed (no corpus to
download, nothing that changes between commits): town-chronicle sentences with names, places,
times and numbers, so a summary or an answer has concrete details to pick up, and a passage
rewritten by the model shares long runs of tokens with its prompt (what prompt lookup pays on)."""

from __future__ import annotations

import random

PEOPLE = [
    "the harbour master", "a young engineer", "the village council", "our neighbour Mrs Alder",
    "the night nurse", "a retired teacher", "the bakery owner", "the research team",
    "a travelling musician", "the ferry captain", "the school caretaker", "two volunteers",
    "the station manager", "Doctor Okafor", "the market traders", "a group of students",
    "the mayor", "the lighthouse keeper", "the librarian", "Mr Petrov from the hardware shop",
    "the farmers' cooperative", "the fire brigade", "a local journalist", "the museum curator",
]
ACTIONS = [
    "repaired", "inspected", "painted", "measured", "moved", "counted", "photographed",
    "cleaned", "delivered", "rebuilt", "catalogued", "tested", "replaced", "sold", "borrowed",
    "carried", "planted", "weighed", "opened", "closed", "mapped", "recorded", "restored", "sorted",
]
THINGS = [
    "the old water pump", "three wooden crates", "the school roof", "a map of the valley",
    "the broken clock", "forty bags of flour", "the footbridge", "a box of letters",
    "the signal lamps", "the orchard fence", "twelve new benches", "the ferry timetable",
    "the bell in the chapel tower", "a barrel of apples", "the flood barrier", "the reading room",
    "the solar panels on the hall", "a collection of old photographs", "the bus shelter",
    "the weather station", "two fishing boats", "the community garden", "the market stalls",
]
PLACES = [
    "near the river", "behind the station", "at the edge of town", "in the north field",
    "by the harbour wall", "on the hill road", "outside the town hall", "in the old mill",
    "beside the primary school", "at the crossroads", "along the canal", "in the covered market",
]
TIMES = [
    "on Monday morning", "after the storm", "before sunrise", "during the spring festival",
    "late in the evening", "on the first day of June", "over the weekend", "in early autumn",
    "just after lunch", "at the end of the month", "on a cold Tuesday", "before the elections",
]
REASONS = [
    "because winter was coming", "so that the children could play safely",
    "after complaints from the shopkeepers", "to save money on repairs",
    "because the old one had rusted", "as the council had promised in March",
    "so that visitors could find their way", "because the river had risen again",
    "to prepare for the harvest", "after a long discussion at the town meeting",
]
OPINIONS = [
    "the work went better than expected", "nobody had seen anything like it before",
    "the cost was higher than planned", "it would last for at least ten years",
    "more help would be needed next year", "the whole street turned out to watch",
]


def sentence(rng: random.Random) -> str:
    """One sentence; the forms vary so the text does not read as one repeated line."""
    who, did, what = rng.choice(PEOPLE), rng.choice(ACTIONS), rng.choice(THINGS)
    where, when, why = rng.choice(PLACES), rng.choice(TIMES), rng.choice(REASONS)
    form = rng.randrange(6)
    if form == 0:
        text = f"{who} {did} {what} {where} {when}."
    elif form == 1:
        text = f"{when}, {who} {did} {what} {why}."
    elif form == 2:
        text = f"It took {rng.randint(2, 30)} hours, and {who} said that {rng.choice(OPINIONS)}."
    elif form == 3:
        text = f"{rng.randint(3, 250)} people came {where} when {who} {did} {what}."
    elif form == 4:
        text = f"According to {who}, {rng.choice(OPINIONS)}, {why}."
    else:
        text = f"{what} was {did} {where} by {who}, who paid {rng.randint(5, 900)} pounds for it."
    return text[0].upper() + text[1:]


def paragraph(rng: random.Random) -> str:
    return " ".join(sentence(rng) for _ in range(rng.randint(3, 7)))


def question(rng: random.Random) -> str:
    """A user's question about the kind of things the text talks about."""
    who, what, when = rng.choice(PEOPLE), rng.choice(THINGS), rng.choice(TIMES)
    forms = [
        f"What did {who} do {when}?",
        f"Why was {what} {rng.choice(ACTIONS)}, and by whom?",
        f"How many people came when {who} {rng.choice(ACTIONS)} {what}?",
        f"Can you explain in two sentences what happened to {what}?",
        f"Who {rng.choice(ACTIONS)} {what} {rng.choice(PLACES)}, and what did it cost?",
    ]
    return rng.choice(forms)
